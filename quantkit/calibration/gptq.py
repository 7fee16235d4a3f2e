"""Error-compensated 8-bit weight rounding (GPTQ, Frantar et al. 2022) from calibration activations.

Round-to-nearest quantizes each weight independently. GPTQ rounds the input columns one at a
time and pushes each column's rounding error onto the columns not yet rounded, weighted by the
inverse Hessian ``H = 2 X^T X / n`` of the layer's inputs, so that the *output* ``X W^T`` moves as
little as possible. The per-channel scale is fixed up front (absmax or the MSE clip search), so
the result drops into the same (q, scale per channel) layout as round-to-nearest. The rounding is
reference.py's ``cast_to_quantized``, so the same algorithm serves INT8 and FP8 (e4m3) grids.

Memory bound: one K x K float32 Hessian per layer being calibrated (``4 K^2`` bytes; layers that
read the same input tensor, e.g. q/k/v, share one), plus one calibration batch in flight. Pass
``layer_names`` in groups (e.g. one decoder block at a time) to bound it on large models.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from quantkit.calibration.blockwise import BlockInputs
from quantkit.calibration.calibrate import check_blocks, forward_backbone, storage_key
from quantkit.calibration.sensitivity import quantize_dequantize_input
from quantkit.calibration.weights import WEIGHT_OBSERVERS, weight_amax
from quantkit.kernels.reference import MIN_SCALE, cast_to_quantized, qmax_of, quantize_per_channel, scale_from_amax
from quantkit.models.experts import expert_linears

logger = logging.getLogger(__name__)


class HessianAccumulator:
    """Running ``2 X^T X / n`` over every token of the inputs seen (float32, float64 would double memory)."""

    def __init__(self, in_features: int, device: torch.device):
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n_tokens = 0

    def update(self, x: torch.Tensor, first_token_weight: float = 1.0) -> None:
        """Add a batch of inputs (..., seq, K); ``first_token_weight`` counts position 0 that many times.

        Position 0 (BOS) is the attention sink of causal LMs: every later token reads its keys and
        values, so its output error weighs more than one token's share of the average.
        """
        x = x.detach().float()
        if first_token_weight != 1.0 and x.dim() >= 2:
            # One row per sequence scaled by sqrt(w): it then enters X^T X w times.
            x = torch.cat([x[..., 1:, :].reshape(-1, x.shape[-1]),
                           x[..., 0, :].reshape(-1, x.shape[-1]) * first_token_weight ** 0.5])
        x = x.reshape(-1, x.shape[-1])
        n = x.shape[0]
        if n == 0:
            return
        # Running mean keeps the magnitudes bounded whatever the token count.
        total = self.n_tokens + n
        self.hessian.mul_(self.n_tokens / total)
        self.hessian.addmm_(x.t(), x, alpha=2.0 / total)
        self.n_tokens = total


class _StopForward(Exception):
    """Raised after the last module whose inputs are being recorded: the rest of the forward is waste."""


class _HessianHooks:
    """Forward pre-hooks that feed one ``HessianAccumulator`` per distinct input of the named Linears.

    Within one batch, inputs are matched by storage identity; the tensors stay referenced in
    ``seen`` until ``end_batch`` so an address cannot be reused by another tensor meanwhile.
    """

    def __init__(self, modules: dict[str, nn.Module], layer_names: list[str], first_token_weight: float):
        self.accumulators: dict[str, HessianAccumulator] = {}
        self.seen: dict[tuple, tuple[str, torch.Tensor]] = {}
        self.leader_of: dict[str, str] = {}
        self.first_token_weight = first_token_weight
        self.handles = [modules[n].register_forward_pre_hook(self._hook(n)) for n in layer_names]

    def _hook(self, name):
        def fn(_m, args):
            x = args[0]
            key = storage_key(x)
            if name not in self.leader_of:  # first batch: decide who shares with whom
                leader = self.seen[key][0] if key in self.seen else name
                self.leader_of[name] = leader
                if leader == name:
                    self.accumulators[name] = HessianAccumulator(x.shape[-1], x.device)
            self.seen.setdefault(key, (name, x))
            if self.leader_of[name] == name:
                self.accumulators[name].update(x, self.first_token_weight)
        return fn

    def end_batch(self) -> None:
        self.seen.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.seen.clear()

    def result(self, model: nn.Module, modules: dict[str, nn.Module], layer_names: list[str]
               ) -> dict[str, HessianAccumulator]:
        # A mixture of experts' expert may get no calibration token: an empty Hessian (n_tokens == 0).
        experts = expert_linears(model)
        not_run = [n for n in layer_names if n not in self.leader_of and n not in experts]
        if not_run:
            raise RuntimeError(f"layers never ran during calibration (not in the backbone?): {not_run[:5]}")
        for name in layer_names:
            if name not in self.leader_of:
                self.leader_of[name] = name
                self.accumulators[name] = HessianAccumulator(modules[name].in_features, modules[name].weight.device)
        return {n: self.accumulators[self.leader_of[n]] for n in layer_names}


def _check_linears(modules: dict[str, nn.Module], layer_names: list[str]) -> None:
    missing = [n for n in layer_names if not isinstance(modules.get(n), nn.Linear)]
    if missing:
        raise ValueError(f"not nn.Linear layers of this model: {missing[:5]}")


@torch.no_grad()
def collect_hessians(
    model: nn.Module, blocks: torch.Tensor, layer_names: list[str], batch_size: int = 4, progress: bool = True,
    stop_after: nn.Module | None = None, first_token_weight: float = 1.0,
) -> dict[str, HessianAccumulator]:
    """One Hessian per named Linear; layers fed the very same input tensor share one accumulator.

    stop_after: end each forward once this module (the last one holding ``layer_names``) has run.
    """
    check_blocks(blocks)
    modules = dict(model.named_modules())
    _check_linears(modules, layer_names)
    hooks = _HessianHooks(modules, layer_names, first_token_weight)

    def stop(_m, _args, _output):
        raise _StopForward

    stop_handle = stop_after.register_forward_hook(stop) if stop_after is not None else None
    try:
        starts = range(0, blocks.shape[0], batch_size)
        for start in tqdm(starts, desc="gptq statistics", unit="batch", disable=not progress, leave=False):
            try:
                forward_backbone(model, blocks[start : start + batch_size], batch_size, progress=False,
                                 layers=[modules[n] for n in layer_names])
            except _StopForward:
                pass
            hooks.end_batch()
    finally:
        hooks.remove()
        if stop_handle is not None:
            stop_handle.remove()
    return hooks.result(model, modules, layer_names)


@torch.no_grad()
def _block_hessians(inputs: BlockInputs, index: int, model: nn.Module, modules: dict[str, nn.Module],
                    layer_names: list[str], first_token_weight: float, keep: bool) -> dict[str, HessianAccumulator]:
    """Hessians of the named Linears of block ``index`` from one run of that block on every batch
    of ``inputs`` (the blocks before it run first if they have not); ``keep``: step past it."""
    while inputs.step < index:  # blocks holding none of the layers
        inputs.run(inputs.step)
    hooks = _HessianHooks(modules, layer_names, first_token_weight)
    try:
        inputs.run(index, keep=keep, each_batch=hooks.end_batch)
    finally:
        hooks.remove()
    return hooks.result(model, modules, layer_names)


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.int8,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = True,
    cuda_graphs: "ColumnGraphs | None" = None,
) -> torch.Tensor:
    """Quantize ``weight`` (N, K) column by column with error feedback; returns q (N, K) of ``dtype``.

    hessian: (K, K) ``2 X^T X / n``; scale: (N,) fixed per-channel scale (``amax / qmax``).
    damp: fraction of the mean diagonal added to it, which keeps the Cholesky factorization
    stable when inputs are (nearly) collinear. act_order: round the columns with the largest
    input energy first, while the most unrounded columns remain to absorb their error.
    cuda_graphs: on a CUDA device, the column loop of each full block runs as a replayed CUDA
    graph from this cache (``ColumnGraphs``; pass one to share it between the layers of a model);
    the same kernels, so the same result as eager. None: eager.
    """
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]) or scale.shape != (weight.shape[0],):
        raise ValueError(
            f"shapes do not match: weight {tuple(weight.shape)}, hessian {tuple(hessian.shape)}, scale {tuple(scale.shape)}"
        )
    if block_size < 1 or damp < 0:
        raise ValueError(f"block_size={block_size} must be >= 1 and damp={damp} >= 0")
    qmax = qmax_of(dtype)
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    s = scale.detach().float().clamp_min(MIN_SCALE).to(W.device)[:, None]
    K = W.shape[1]
    # Columns that never saw a non-zero input cannot affect the output: zero them and give them the
    # live columns' mean diagonal so H stays positive definite. The damping is a fraction of that
    # mean too: a unit diagonal counted in it over-damped layers with small inputs (down_proj),
    # which then fell back towards round-to-nearest.
    dead = torch.diag(H) == 0
    live_mean = torch.diag(H)[~dead].mean() if bool((~dead).any()) else H.new_tensor(1.0)
    H[dead, dead] = live_mean
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(K, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * live_mean)
    # Upper Cholesky factor of H^-1: row i holds the update coefficients of column i onto the
    # columns after it (the OBS update, done once instead of re-inverting per column).
    L = torch.linalg.cholesky(H.double())
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).float()
    Q = torch.zeros_like(W)
    graphed = cuda_graphs is not None and W.is_cuda
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        if graphed and i2 - i1 == block_size:
            Q[:, i1:i2], E1 = cuda_graphs.run(W[:, i1:i2], Hinv[i1:i2, i1:i2], s, dtype)
        else:
            W1 = W[:, i1:i2].clone()
            E1 = torch.empty_like(W1)
            _round_columns(W1, Hinv[i1:i2, i1:i2], s, Q[:, i1:i2], E1, dtype)
        # Lazy batch update: the columns after this block receive the whole block's error at once.
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    inverse = torch.argsort(perm)
    Q = Q[:, inverse].clamp(-qmax, qmax)
    return cast_to_quantized(Q, dtype)


def _round_columns(W1: torch.Tensor, Hinv1: torch.Tensor, s: torch.Tensor, Q1: torch.Tensor, E1: torch.Tensor,
                   dtype: torch.dtype) -> None:
    """GPTQ's loop over the columns of one block: column i is rounded (into ``Q1``) and its error,
    scaled by the inverse Hessian's diagonal (into ``E1``), moves the block's later columns of
    ``W1`` (updated in place). s: (N, 1) scales."""
    for i in range(W1.shape[1]):
        w = W1[:, i]
        q = cast_to_quantized(w[:, None] / s, dtype).float()
        Q1[:, i] = q[:, 0]
        err = (w - q[:, 0] * s[:, 0]) / Hinv1[i, i]
        W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
        E1[:, i] = err


class ColumnGraphs:
    """``_round_columns`` on a full block captured as a CUDA graph per (rows, block width, dtype,
    device), then replayed. Eagerly the loop launches about 13 small kernels a column from the
    host, which is most of GPTQ's time on a GPU (an 8B model has ~1.2M columns); a replay launches
    them all at once. Inputs are copied into the graph's buffers, so results are the eager ones."""

    def __init__(self):
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor]]] = {}

    def run(self, W1: torch.Tensor, Hinv1: torch.Tensor, s: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q1, E1) of one block; both are the graph's buffers, valid until the next ``run``."""
        with torch.cuda.device(W1.device):  # capture and replay on the weight's GPU, whichever is current
            return self._run(W1, Hinv1, s, dtype)

    def _run(self, W1, Hinv1, s, dtype):
        key = (*W1.shape, dtype, W1.device)
        if key not in self._graphs:
            buffers = {"W1": W1.clone(), "Hinv1": Hinv1.clone(), "s": s.clone(), "Q1": torch.empty_like(W1),
                       "E1": torch.empty_like(W1)}
            # Warm-up outside the capture (the kernels load on first use), which also rounds this block.
            side = torch.cuda.Stream(W1.device)
            side.wait_stream(torch.cuda.current_stream(W1.device))
            with torch.cuda.stream(side):
                _round_columns(buffers["W1"], buffers["Hinv1"], buffers["s"], buffers["Q1"], buffers["E1"], dtype)
            torch.cuda.current_stream(W1.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records without running: the buffers keep the warm-up's results
                _round_columns(buffers["W1"], buffers["Hinv1"], buffers["s"], buffers["Q1"], buffers["E1"], dtype)
            self._graphs[key] = graph, buffers
            return buffers["Q1"], buffers["E1"]
        graph, buffers = self._graphs[key]
        buffers["W1"].copy_(W1)
        buffers["Hinv1"].copy_(Hinv1)
        buffers["s"].copy_(s)
        graph.replay()
        return buffers["Q1"], buffers["E1"]


@torch.no_grad()
def gptq_quantize_weights(
    model: nn.Module,
    blocks: torch.Tensor,
    layer_names: list[str],
    dtype: torch.dtype = torch.int8,
    block_size: int = 128,
    damp: float = 0.01,
    progress: bool = True,
    weight_observer: str = "absmax",
    batch_size: int = 4,
    percentile: float = 99.99,
    act_order: bool = True,
    per_block: bool = False,
    first_token_weight: float = 1.0,
    sequential: bool = False,
    input_amax: dict[str, torch.Tensor] | None = None,
    cuda_graphs: bool = True,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """GPTQ-quantize the named Linears of ``model`` (weights are not modified).

    Returns ``{name: (q_weight (N, K) of ``dtype``, weight_scale float32 (N,))}`` with
    ``q_weight * weight_scale[:, None] ~= weight``, ready for ``QuantLinear.from_linear(...,
    quantized_weight=...)``. weight_observer: "absmax" (scale from the row max), "percentile"
    (``percentile`` of the row's |w|) or "mse" (clip search of ``weights.search_weight_clip``,
    weighted by the inputs' mean square).
    The statistics are collected one decoder block at a time from the unquantized model, so only
    one block's Hessians exist at once: the blocks' inputs are recorded in one forward and stepped
    through the blocks (``calibration.blockwise``), each block running once per batch for its
    statistics, 2L block forwards in all for L blocks, plus the calibration hidden states held
    (see there). A model whose blocks do not run as a chain (or that has none) gets one forward
    that collects every layer's Hessian at once, unless ``per_block``: then block i's come from a
    forward through blocks 0..i (L(L+1)/2 block forwards), as the memory bound of streaming
    (``calibration.offload``) needs. sequential: block by block too, and each block's statistics come
    from the inputs the blocks before it give once quantized: their Linears run with their rounded
    weights and their inputs quantized as the converted model will (per token, or per tensor at
    ``input_amax``'s calibrated range for static schemes), so a block's rounding also corrects the
    error that reaches it (as the GPTQ paper runs it). Each block but the last runs once more,
    quantized, to give the next one its inputs (3L - 1); the quantized layers compute from their
    (q, scale) results, so no extra copy of a weight is held; the model is restored. Linears
    outside the decoder blocks (an lm_head) are rounded last, on statistics from a whole-model
    pass (with the quantized blocks if sequential).
    The rounding runs where the statistics were gathered; results land on each weight's device.
    cuda_graphs: on a GPU, replay each full block's column loop as a CUDA graph (``ColumnGraphs``;
    the same codes as eager, 4-9x less time per layer on an H200).
    """
    qmax_of(dtype)  # validates: torch.int8 or torch.float8_e4m3fn
    check_blocks(blocks, model)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    if weight_observer not in WEIGHT_OBSERVERS:
        raise ValueError(f"weight_observer={weight_observer!r} is not one of {WEIGHT_OBSERVERS}")
    if not layer_names:
        return {}
    modules = dict(model.named_modules())
    _check_linears(modules, layer_names)  # before any forward
    input_scales: dict[str, torch.Tensor] = {}
    if sequential and input_amax is not None:  # static: every layer's range, checked before any work
        missing = [name for name in layer_names if name not in input_amax]
        if missing:
            raise ValueError(f"sequential GPTQ of a static scheme needs every layer's input range; {len(missing)} "
                             f"have none, the first {missing[0]}")
        input_scales = {name: scale_from_amax(input_amax[name].detach().float(), dtype) for name in layer_names}
    groups: list[tuple[list[str], int]] = [(list(layer_names), -1)]  # (names, decoder block or -1)
    inputs: BlockInputs | None = None
    last_block = -1
    from quantkit.calibration.offload import block_of, decoder_blocks

    try:
        stacks = decoder_blocks(model)
    except ValueError as exc:
        if sequential:
            raise ValueError(f"gptq_sequential=True runs GPTQ one decoder block at a time, and "
                             f"{type(model).__name__} has no list of decoder blocks; use gptq_sequential=False") from exc
        if per_block:
            raise
        stacks = None  # one pass over the whole model
    if stacks is not None:
        owner = block_of(model, list(layer_names))
        by_block: dict[int, list[str]] = {}
        for name in layer_names:
            by_block.setdefault(owner.get(name, -1), []).append(name)
        block_groups = [(by_block[i], i) for i in sorted(by_block) if i >= 0]
        if block_groups:
            last_block = block_groups[-1][1]
            inputs = BlockInputs.record(model, stacks, blocks, batch_size, last=last_block, progress=progress)
        if inputs is not None or per_block or sequential:
            groups = block_groups + ([(by_block[-1], -1)] if -1 in by_block else [])  # an lm_head: a full pass
        if inputs is None and (per_block or sequential) and block_groups:
            logger.warning("%s's decoder blocks do not run as a chain (each fed the one before's output), so "
                           "block i's GPTQ statistics come from a forward through blocks 0..i: L(L+1)/2 block "
                           "forwards instead of 2L or 3L", type(model).__name__)
    result = {}
    experts = expert_linears(model)
    graphs = ColumnGraphs() if cuda_graphs and torch.cuda.is_available() else None  # used for CUDA Hessians
    with tqdm(total=len(layer_names), desc="gptq", unit="layer", disable=not progress, leave=False) as bar, \
            ExitStack() as quantized:  # sequential: the blocks rounded so far run quantized until it closes
        for names, index in groups:
            if inputs is not None and index >= 0:
                hessians = _block_hessians(inputs, index, model, modules, names, first_token_weight,
                                           keep=not sequential)
            else:
                hessians = collect_hessians(model, blocks, names, batch_size, progress and index < 0,
                                            stacks[index] if index >= 0 else None, first_token_weight)
            for name in names:
                tokens = hessians[name].n_tokens
                if tokens == 0 or (name in experts and tokens < modules[name].in_features):
                    # An expert that few calibration tokens reached: on fewer tokens than inputs the
                    # Hessian is singular and GPTQ fits those tokens (worse than rounding on others),
                    # and with none it would zero every column it never saw, the whole weight.
                    logger.info("%s saw %d calibration tokens for %d inputs; its weight is rounded to nearest, not by "
                                "GPTQ", name, tokens, modules[name].in_features)
                    weight = modules[name].weight.detach()
                    q, scale = quantize_per_channel(
                        weight, dtype, weight_amax(weight, dtype, weight_observer, percentile))
                    result[name] = (q, scale.reshape(-1))
                else:
                    result[name] = _gptq_layer(modules[name].weight.detach(), hessians[name].hessian, dtype,
                                               block_size, damp, act_order, weight_observer, percentile, graphs)
                bar.update()
            del hessians
            for name in names if sequential else ():  # this block runs quantized in the next passes
                quantized.enter_context(_run_quantized(modules[name], result[name], dtype, input_scales.get(name)))
            if inputs is not None and index == last_block:
                inputs.release()  # every sample's hidden states: not needed by an lm_head's whole-model pass
                inputs = None
            elif sequential and inputs is not None and index >= 0:
                inputs.run(index)  # the next block's inputs: this one's outputs, quantized
    return result


@contextmanager
def _run_quantized(linear: nn.Linear, quantized: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype,
                   input_scale: torch.Tensor | None):
    """While open, ``linear`` computes as its QuantLinear will: the rounded weight (dequantized per
    call from (q, scale), so no 16-bit copy is held), the input quantized per token, or per tensor
    at ``input_scale`` (static). q and scale ride along as buffers, so streaming moves them with the
    block; the weight Parameter is left alone."""
    q, scale = quantized
    linear.register_buffer("_gptq_q", q, persistent=False)
    linear.register_buffer("_gptq_scale", scale.reshape(-1), persistent=False)

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = (linear._gptq_q.float() * linear._gptq_scale.float()[:, None]).to(linear.weight.dtype)
        static = None if input_scale is None else input_scale.to(x.device)
        return F.linear(quantize_dequantize_input(x, dtype, static), weight, linear.bias)

    linear.forward = forward
    try:
        yield linear
    finally:
        del linear.forward  # the instance attribute: nn.Linear.forward again
        del linear._buffers["_gptq_q"], linear._buffers["_gptq_scale"]


def _gptq_layer(weight: torch.Tensor, H: torch.Tensor, dtype: torch.dtype, block_size: int, damp: float,
                act_order: bool, weight_observer: str, percentile: float,
                graphs: ColumnGraphs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer: scales from the observer, GPTQ rounding on the Hessian's device, results on the weight's."""
    w = weight.to(H.device)
    amax = weight_amax(w, dtype, weight_observer, percentile, column_weight=torch.diag(H).clamp_min(0))
    scale = scale_from_amax(amax, dtype)
    q = gptq_quantize(w, H, scale, dtype, block_size, damp, act_order, graphs)
    return q.to(weight.device), scale.to(weight.device)
