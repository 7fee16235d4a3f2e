"""Which Linears hurt most when quantized: rank them, keep the worst few in 16 bits.

Score (method "kl", the default): quantize *only* that layer (weights per channel, activations
per token or per tensor as the recipe says, through reference.py's math), run a few calibration
blocks, and measure the mean KL divergence ``KL(p_fp || p_quant)`` of the next-token distribution
at a fixed subset of positions, in nats per token. It is what perplexity feels (the log-loss
increase on the model's own predictions) without needing labels, and it includes how the layer's
error propagates through the rest of the network. Cost: one forward of ``n_blocks`` blocks per
layer; logits are computed only at ``positions_per_block`` positions (a 262k vocabulary would
otherwise dominate). Memory: the reference log-probabilities, ``n_blocks * positions_per_block *
vocab`` float32.

Method "layer_error" is the cheap proxy: one forward with every layer observed at once; the
score is each layer's own relative output error ``||y - y_q|| / ||y||``. It ignores propagation.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from quantkit.calibration.calibrate import check_blocks, forward_backbone, input_device, storage_key
from quantkit.calibration.weights import weight_amax
from quantkit.config import QuantConfig
from quantkit.convert import target_linears
from quantkit.kernels.reference import quantize_per_channel, quantize_per_tensor, quantize_per_token, scale_from_amax

METHODS = ("kl", "layer_error")


def target_layers(model: nn.Module, config: QuantConfig) -> dict[str, nn.Linear]:
    """The Linears the recipe quantizes (everything not matched by ``config.ignore``)."""
    return target_linears(model, config)


def fake_quantized_weight(weight: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """The weight after per-channel quantize -> dequantize, ranges from the recipe's weight observer."""
    dtype = config.torch_dtype
    w = weight.detach().float()
    q, scale = quantize_per_channel(w, dtype, weight_amax(w, dtype, config.weight_observer, config.percentile))
    return (q.float() * scale[:, None]).to(weight.dtype)


def fake_quantize_input(x: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """Quantize -> dequantize an activation: per token (dynamic) or per tensor (static).

    Static uses the tensor's own absmax as the scale, an optimistic stand-in for a calibrated
    one that is good enough to rank layers.
    """
    if not config.is_static:
        return quantize_dequantize_input(x, config.torch_dtype)
    scale = scale_from_amax(x.detach().float().abs().amax(), config.torch_dtype)
    return quantize_dequantize_input(x, config.torch_dtype, scale)


def quantize_dequantize_input(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` as a QuantLinear's GEMM sees it: quantized per token (``scale`` None) or per tensor
    with ``scale``, dequantized, in ``x``'s dtype."""
    flat = x.reshape(-1, x.shape[-1]).float()
    if scale is not None:
        scale = scale.reshape(1).float().to(flat.device)
        deq = quantize_per_tensor(flat, scale, dtype).float() * scale
    else:
        q, token_scale = quantize_per_token(flat, dtype)
        deq = q.float() * token_scale[:, None]
    return deq.reshape(x.shape).to(x.dtype)


@contextmanager
def fake_quantized(module: nn.Linear, config: QuantConfig):
    """Temporarily run ``module`` as its W8A8 version (weight swapped, input quantized by a hook).

    The weight Parameter itself is swapped, not written into: a tied ``lm_head`` shares its
    weight with the input embeddings, which must stay 16-bit while the head is scored.
    """
    original = module._parameters["weight"]
    module._parameters["weight"] = nn.Parameter(fake_quantized_weight(original.detach(), config),
                                                requires_grad=False)
    handle = module.register_forward_pre_hook(lambda _m, args: (fake_quantize_input(args[0], config), *args[1:]))
    try:
        yield module
    finally:
        handle.remove()
        module._parameters["weight"] = original


def _positions(seq_len: int, count: int) -> torch.Tensor:
    # Skip position 0: predicting after BOS alone says little about the layer.
    count = max(1, min(count, seq_len - 1)) if seq_len > 1 else 1
    return torch.linspace(seq_len > 1, seq_len - 1, count).round().long().unique()


@torch.no_grad()
def _log_probs(model: nn.Module, batches: list[torch.Tensor], positions: torch.Tensor, keep_supported: bool):
    device = input_device(model)
    out = []
    for batch in batches:
        if keep_supported:
            logits = model(input_ids=batch.to(device), use_cache=False, logits_to_keep=positions.to(device)).logits
        else:
            logits = model(input_ids=batch.to(device), use_cache=False).logits[:, positions.to(device)]
        out.append(F.log_softmax(logits.float(), dim=-1))
    return out


def _kl(ref: list[torch.Tensor], new: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for p_log, q_log in zip(ref, new):
        kl = (p_log.exp() * (p_log - q_log)).sum(-1)
        total += float(kl.sum())
        count += kl.numel()
    # KL is >= 0; float32 rounding can leave an unperturbed layer at -1e-8.
    return max(0.0, total / max(count, 1))


@torch.no_grad()
def rank_layers(
    model: nn.Module,
    blocks: torch.Tensor,
    config: QuantConfig,
    n_blocks: int = 2,
    batch_size: int = 2,
    positions_per_block: int = 64,
    method: str = "kl",
    layer_names: list[str] | None = None,
    progress: bool = True,
    max_seq_len: int | None = None,
) -> list[tuple[str, float]]:
    """``[(layer name, score)]``, most sensitive first; see the module docstring for the scores.

    blocks: (n_samples, seq_len) calibration token ids; the first ``n_blocks`` are used, cut to
    their first ``max_seq_len`` tokens if given (the cost is one forward per layer).
    layer_names: restrict the ranking (default: every Linear the recipe quantizes).
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not one of {METHODS}")
    check_blocks(blocks)
    if n_blocks < 1 or batch_size < 1:
        raise ValueError(f"n_blocks={n_blocks} and batch_size={batch_size} must be >= 1")
    if max_seq_len is not None:
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len={max_seq_len} must be >= 2")
        blocks = blocks[:, :max_seq_len]
    layers = target_layers(model, config)
    if layer_names is not None:
        unknown = [n for n in layer_names if n not in layers]
        if unknown:
            raise ValueError(f"not quantized Linears of this model under this config: {unknown[:5]}")
        layers = {n: layers[n] for n in layer_names}
    blocks = blocks[:n_blocks]
    was_training = model.training
    model.eval()
    try:
        if method == "layer_error":
            scores = _layer_errors(model, blocks, layers, config, batch_size, progress)
        else:
            batches = [blocks[i : i + batch_size] for i in range(0, blocks.shape[0], batch_size)]
            positions = _positions(blocks.shape[1], positions_per_block)
            keep_supported = "logits_to_keep" in inspect.signature(model.forward).parameters
            reference = _log_probs(model, batches, positions, keep_supported)
            scores = {}
            for name, module in tqdm(layers.items(), desc="sensitivity", unit="layer", disable=not progress, leave=False):
                with fake_quantized(module, config):
                    scores[name] = _kl(reference, _log_probs(model, batches, positions, keep_supported))
    finally:
        model.train(was_training)
    return sorted(scores.items(), key=lambda item: item[1], reverse=True)


def _layer_errors(model, blocks, layers, config, batch_size, progress) -> dict[str, float]:
    err = {n: 0.0 for n in layers}
    ref = {n: 0.0 for n in layers}
    quantized_weights = {n: fake_quantized_weight(m.weight, config) for n, m in layers.items()}

    def hook(name):
        def fn(module, args):
            x = args[0]
            y = F.linear(x.float(), module.weight.float())
            y_q = F.linear(fake_quantize_input(x, config).float(), quantized_weights[name].float())
            err[name] += float((y - y_q).pow(2).sum())
            ref[name] += float(y.pow(2).sum())
        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    try:
        # layers: the whole model runs when one of them (an lm_head) lives outside the backbone.
        forward_backbone(model, blocks, batch_size, desc="layer errors", progress=progress, layers=layers.values())
    finally:
        for h in handles:
            h.remove()
    return {n: (err[n] / ref[n]) ** 0.5 if ref[n] > 0 else 0.0 for n in layers}


def most_sensitive(ranking: list[tuple[str, float]], n: int, groups: list[list[str]] | None = None) -> list[str]:
    """Names of the ``n`` most sensitive layers of a ``rank_layers`` ranking (for the ignore list).

    ``groups`` (``shared_input_groups``): layers that read one input, which serving engines fuse
    into one GEMM (q/k/v, gate/up) and which must then share one scheme (vLLM refuses a fused
    layer whose parts differ). A layer is kept with its whole group, so the list holds at least
    ``n`` names: whole groups, in the order of their most sensitive member, each in layer order.
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    ordered = [name for name, _ in sorted(ranking, key=lambda item: item[1], reverse=True)]
    group_of = {name: group for group in groups or () for name in group}
    kept: list[str] = []
    for name in ordered:
        if len(kept) >= n:
            break
        if name not in kept:
            kept.extend(member for member in group_of.get(name, [name]) if member not in kept)
    return kept


@torch.no_grad()
def shared_input_groups(model: nn.Module, blocks: torch.Tensor, layers: dict[str, nn.Module],
                        tokens: int = 8) -> list[list[str]]:
    """The named layers grouped by the input tensor they read and the module that holds them, from
    one short forward (groups of one included), in ``layers``' order.

    The parent module splits what one input feeds in parallel-attention blocks (Cohere, Phi, GPT-J
    feed q/k/v and the MLP's first layer from one norm): engines fuse q/k/v and gate/up separately.
    """
    check_blocks(blocks)
    readers: dict[tuple, list[str]] = {}
    inputs = []  # referenced until the forward ends, so no address is reused by another tensor

    def hook(name):
        def fn(_module, args):
            x = args[0]
            inputs.append(x)
            key = (*storage_key(x), name.rpartition(".")[0])
            if name not in readers.setdefault(key, []):  # a module called twice reads its input twice
                readers[key].append(name)
        return fn

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in layers.items()]
    try:
        forward_backbone(model, blocks[:1, :tokens], 1, progress=False, layers=layers.values())
    finally:
        for handle in handles:
            handle.remove()
    group_of = {name: group for group in readers.values() for name in group}
    groups, seen = [], set()
    for name in layers:
        group = group_of.get(name, [name])
        if group[0] not in seen:
            seen.add(group[0])
            groups.append(group)
    return groups
