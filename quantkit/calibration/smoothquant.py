"""SmoothQuant: migrate activation outliers into the weights with an exact per-channel rescaling.

For a Linear ``y = x W^T``, ``x W^T = (x / s) (W * s)^T`` for any positive per-input-channel ``s``.
Choosing ``s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha)`` flattens the activation's outlier
channels at the cost of slightly rougher weight columns. The division by ``s`` is folded into
whatever produced ``x`` so inference pays nothing:

- a norm (``out = n(x) * (c + w) + b``; c = 0 for Llama/LayerNorm, 1 for Gemma): ``w' = (c + w)/s - c``,
  ``b' = b / s``; it feeds q/k/v (input norm) or gate/up (post-attention / pre-feedforward norm);
- a Linear whose output reaches the consumer only through channel-wise linear operations:
  ``up`` -> ``down`` (``act(gate) * up``) and ``v`` -> ``o`` (``softmax(qk) v``, with the kv heads
  repeated over the query heads under GQA): the producer's output rows are divided by ``s``.

Which module feeds which Linear is read from the model by running it, one mechanism for every
architecture (no per-model tables):

1. one probe forward records every norm's output and every Linear's input by storage identity
   (data pointer, shape, strides): a Linear whose input *is* a norm's output is fed by that norm;
2. for Linear -> Linear paths, a probe forward multiplies the producer's output channels by
   distinct factors ``d``; a consumer whose input channels come out multiplied by exactly one of
   those factors each is channel-wise linear in the producer, and the factors name the channel
   map (identity for up -> down, the GQA head repetition for v -> o);
3. every candidate group is then folded with random scales and the model's output on the probe
   tokens must not change (relative change < ``EXACTNESS_TOL``); a group whose producer also feeds
   something else (a residual, another norm) fails this check and is skipped, with the reason in
   the report.

Memory bound: the probe runs keep every Linear's input for ``probe_tokens`` tokens (sum of
in_features x probe_tokens floats); statistics are one (in_features,) float32 vector per smoothed
Linear. Models in 16 bits are smoothed in float32 (a transient float32 copy of the parameters, then
cast back), because the channel map is read from ratios that 16-bit arithmetic blurs.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from quantkit.kernels.reference import (
    MIN_SCALE,
    qmax_of,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
)

# Relative change of the probe output above which a candidate rescaling is not an identity.
# Float32 rounding through a few layers stays around 1e-6; a broken identity changes it by O(1).
EXACTNESS_TOL = 1e-3
# A consumer channel is "multiplied by one factor" when its least-squares ratio explains the
# perturbed input to this relative residual.
RATIO_RESIDUAL_TOL = 1e-4
# Channels whose activation absmax exceeds this multiple of the median are reported as outliers.
OUTLIER_FACTOR = 10.0
# Scales are kept within [1/SCALE_LIMIT, SCALE_LIMIT] so no weight over/underflows in 16 bits.
SCALE_LIMIT = 1e4


# --- running the model -----------------------------------------------------------------------


def backbone(model: nn.Module) -> nn.Module:
    """The transformer without its LM head (``model.model`` for HF causal LMs), else the model.

    Calibration statistics never need the logits; skipping a 262k-vocabulary head saves most
    of the compute on small models.
    """
    prefix = getattr(model, "base_model_prefix", None)
    inner = getattr(model, prefix, None) if prefix else None
    return inner if isinstance(inner, nn.Module) else model


def input_device(model: nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        return embeddings.weight.device
    return next(model.parameters()).device


def check_blocks(blocks: torch.Tensor) -> None:
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            "blocks must be an integer tensor (n_samples, seq_len) of token ids; got "
            f"{type(blocks).__name__} {getattr(blocks, 'dtype', '')} {tuple(getattr(blocks, 'shape', ()))}"
        )
    if blocks.shape[0] == 0:
        raise ValueError("blocks is empty; pass at least one calibration block")


def _hidden(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0]


@torch.no_grad()
def forward_backbone(model: nn.Module, blocks: torch.Tensor, batch_size: int, desc: str = "calibrating",
                     progress: bool = True) -> None:
    """Run every block through the model's backbone in batches; hooks do the recording."""
    check_blocks(blocks)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    body, device = backbone(model), input_device(model)
    starts = range(0, blocks.shape[0], batch_size)
    for start in tqdm(starts, desc=desc, unit="batch", disable=not progress, leave=False):
        body(input_ids=blocks[start : start + batch_size].to(device), use_cache=False)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(leaf, p) for p in patterns)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


# --- the module graph --------------------------------------------------------------------------


@dataclass
class SmoothGroup:
    """One exact rescaling: ``producer``'s output channels divided by s, consumers' columns times s.

    kind "norm": producer is an affine norm ``n(x) * (offset + weight) + bias``.
    kind "linear": producer is a Linear; ``channel_maps[i][c]`` is the producer output channel
    that consumer i's input channel c comes from.
    """

    kind: str
    producer: str
    consumers: list[str]
    offset: float = 0.0
    channel_maps: list[torch.Tensor] = field(default_factory=list)


def _norm_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Leaf modules holding only a 1-D ``weight`` (and optionally a same-size ``bias``)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) or any(True for _ in module.children()):
            continue
        params = dict(module.named_parameters(recurse=False))
        weight = params.get("weight")
        if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"}:
            continue
        if "bias" in params and params["bias"].shape != weight.shape:
            continue
        found[name] = module
    return found


def _shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (tied embeddings / heads)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


@torch.no_grad()
def _norm_offset(norm: nn.Module, x: torch.Tensor) -> float | None:
    """c in ``out = n(x) * (c + weight) + bias``, read by evaluating the norm with weight 0 and 1.

    Returns None when the output is not affine in the weight that way.
    """
    weight = norm.weight
    bias = getattr(norm, "bias", None)
    saved_w, saved_b = weight.detach().clone(), None if bias is None else bias.detach().clone()
    try:
        if bias is not None:
            bias.zero_()
        outs = []
        for value in (0.0, 1.0, 2.0):
            weight.fill_(value)
            outs.append(norm(x).double())
    finally:
        weight.copy_(saved_w)
        if bias is not None:
            bias.copy_(saved_b)
    normalized = outs[1] - outs[0]
    denom = normalized.pow(2).sum()
    if denom == 0:
        return None
    offset = float((outs[0] * normalized).sum() / denom)
    # Affine in the weight: the step from 1 to 2 equals the step from 0 to 1, and out(0) = c * n(x).
    scale = normalized.abs().amax()
    if (outs[2] - outs[1] - normalized).abs().amax() > 1e-4 * scale:
        return None
    if (outs[0] - offset * normalized).abs().amax() > 1e-4 * max(scale, outs[0].abs().amax()):
        return None
    return round(offset, 4) if abs(offset - round(offset)) < 1e-4 else offset


def _channel_map(base: torch.Tensor, perturbed: torch.Tensor, log_factors: torch.Tensor) -> torch.Tensor | None:
    """Producer channel per consumer input channel, or None if the consumer is not channel-wise linear."""
    x = base.reshape(-1, base.shape[-1]).double()
    y = perturbed.reshape(-1, perturbed.shape[-1]).double()
    power = x.pow(2).sum(0)
    if bool((power == 0).any()):
        return None  # a dead channel says nothing about where it comes from
    ratio = (x * y).sum(0) / power
    if bool((ratio <= 0).any()):
        return None
    residual = (y - ratio * x).pow(2).sum(0).sqrt() / y.pow(2).sum(0).sqrt().clamp_min(1e-300)
    if bool((residual > RATIO_RESIDUAL_TOL).any()):
        return None
    sorted_log, order = torch.sort(log_factors.double())
    log_ratio = ratio.log()
    pos = torch.searchsorted(sorted_log, log_ratio).clamp(1, len(sorted_log) - 1)
    left, right = sorted_log[pos - 1], sorted_log[pos]
    nearest = torch.where((log_ratio - left).abs() <= (right - log_ratio).abs(), pos - 1, pos)
    spacing = float((sorted_log[1:] - sorted_log[:-1]).min()) if len(sorted_log) > 1 else 1.0
    if bool(((log_ratio - sorted_log[nearest]).abs() > spacing / 3).any()):
        return None
    return order[nearest]


class _ProbeDone(Exception):
    """Raised by a probe hook once the rest of the forward cannot tell anything more."""


class _Prober:
    """Runs the backbone on a few probe tokens with temporary hooks.

    A hook may raise ``_ProbeDone`` to cut the forward short; ``run`` then returns None.
    """

    def __init__(self, model: nn.Module, probe_ids: torch.Tensor):
        self.body = backbone(model)
        self.ids = probe_ids.to(input_device(model))

    @torch.no_grad()
    def run(self, pre_hooks=(), hooks=()) -> torch.Tensor | None:
        handles = [m.register_forward_pre_hook(fn) for m, fn in pre_hooks]
        handles += [m.register_forward_hook(fn) for m, fn in hooks]
        try:
            return _hidden(self.body(input_ids=self.ids, use_cache=False)).detach().double()
        except _ProbeDone:
            return None
        finally:
            for h in handles:
                h.remove()


def _relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp_min(1e-300))


@torch.no_grad()
def find_smoothing_groups(
    model: nn.Module,
    probe_ids: torch.Tensor,
    exclude: tuple[str, ...] = ("lm_head",),
    linear_pairs: bool = True,
    seed: int = 0,
) -> tuple[list[SmoothGroup], list[dict]]:
    """The exact rescalings this model admits, read from probe forwards (see the module docstring).

    probe_ids: (1, T) token ids (a few dozen tokens suffice). Returns (groups, skipped), where
    skipped lists ``{"module", "reason"}`` for candidates that were not exact or not allowed.
    """
    check_blocks(probe_ids)
    modules = dict(model.named_modules())
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    norms = _norm_candidates(model)
    shared = _shared_parameters(model)
    prober = _Prober(model, probe_ids)
    generator = torch.Generator().manual_seed(seed)
    skipped: list[dict] = []

    # 1. Who feeds whom, by storage identity. Tensors stay referenced until the end of the pass,
    #    so a freed tensor's address cannot be reused by another one.
    norm_out: dict[tuple, list[str]] = {}
    norm_in: dict[str, torch.Tensor] = {}
    lin_in: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    calls: dict[str, int] = {}
    keep_alive: list[torch.Tensor] = []

    def norm_hook(name):
        def hook(_m, args, out):
            calls[name] = calls.get(name, 0) + 1
            if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                keep_alive.append(out)
                norm_out.setdefault(_storage_key(out), []).append(name)
                norm_in[name] = args[0].detach().clone()
        return hook

    def lin_hook(name):
        def hook(_m, args):
            lin_in[name].append(args[0])
        return hook

    base_hidden = prober.run(
        pre_hooks=[(m, lin_hook(n)) for n, m in linears.items()],
        hooks=[(m, norm_hook(n)) for n, m in norms.items()],
    )
    fed_by: dict[str, list[str]] = {}
    for lname, inputs in lin_in.items():
        if len(inputs) != 1:
            continue
        for nname in norm_out.get(_storage_key(inputs[0]), []):
            fed_by.setdefault(nname, []).append(lname)
    baseline_inputs = {n: v[0].detach().clone() for n, v in lin_in.items() if len(v) == 1}
    del keep_alive, lin_in, norm_out

    def usable_consumers(producer: str, consumers: list[str]) -> str | None:
        for c in consumers:
            if _matches(c, exclude):
                return f"feeds excluded layer {c}"
            if id(linears[c].weight) in shared:
                return f"feeds {c}, whose weight is tied to another module"
        return None

    candidates: list[SmoothGroup] = []
    for nname, consumers in fed_by.items():
        if calls.get(nname, 0) != 1:
            skipped.append({"module": nname, "reason": "norm runs more than once per forward"})
            continue
        reason = usable_consumers(nname, consumers)
        if reason is None and any(id(p) in shared for p in norms[nname].parameters()):
            reason = "norm weight is shared with another module"
        offset = None if reason else _norm_offset(norms[nname], norm_in[nname])
        if reason is None and offset is None:
            reason = "output is not n(x) * (c + weight) + bias"
        if reason:
            skipped.append({"module": nname, "reason": reason})
            continue
        candidates.append(SmoothGroup("norm", nname, sorted(consumers), offset=offset))

    # 2. Linear -> Linear paths that are channel-wise linear.
    if linear_pairs:
        for aname, producer in linears.items():
            if aname not in baseline_inputs or _matches(aname, exclude) or id(producer.weight) in shared:
                continue
            n_out = producer.out_features
            log_factors = torch.linspace(-1.0, 1.0, n_out, dtype=torch.float64)[torch.randperm(n_out, generator=generator)]
            factors = log_factors.exp()
            seen: dict[str, torch.Tensor] = {}

            def scale_output(_m, _args, out, factors=factors):
                return out * factors.to(out.device, out.dtype)

            def record(name):
                def hook(_m, args):
                    seen[name] = args[0].detach().clone()
                return hook

            def stop_at_norm(name):
                # Once the perturbation reaches a norm's input, everything after it depends on the
                # producer through that normalization, which is not channel-wise linear: the rest
                # of the forward cannot reveal another consumer, so the probe ends there. (A path
                # that would bypass it is only missed, never wrongly accepted: step 3 checks.)
                def hook(_m, args):
                    if not torch.equal(args[0], norm_in[name]):
                        raise _ProbeDone
                return hook

            prober.run(
                pre_hooks=[(m, record(n)) for n, m in linears.items() if n in baseline_inputs and n != aname]
                + [(norms[n], stop_at_norm(n)) for n in norm_in if calls.get(n) == 1],
                hooks=[(producer, scale_output)],
            )
            consumers, maps = [], []
            for bname, x in seen.items():
                base = baseline_inputs[bname]
                if base.shape != x.shape or torch.equal(base, x):
                    continue
                mapping = _channel_map(base, x, log_factors)
                if mapping is not None:
                    consumers.append(bname)
                    maps.append(mapping)
            if not consumers:
                continue
            reason = usable_consumers(aname, consumers)
            if reason:
                skipped.append({"module": aname, "reason": reason})
                continue
            candidates.append(SmoothGroup("linear", aname, consumers, channel_maps=maps))

    # 3. Fold random scales into the candidates and check the output does not move: all at once
    #    first (one forward; independent random scales cannot cancel each other's error), and
    #    group by group only if that fails, to find and skip the culprits.
    def folded_change(batch: list[SmoothGroup]) -> float:
        saved = [item for g in batch for item in _snapshot(g, modules)]
        for g in batch:
            _fold(g, modules, torch.exp(torch.empty(_group_size(g, modules), dtype=torch.float64).uniform_(-1.0, 1.0, generator=generator)))
        change = _relative_change(base_hidden, prober.run())
        _restore(saved)
        return change

    if not candidates or folded_change(candidates) <= EXACTNESS_TOL:
        return candidates, skipped
    groups = []
    for group in candidates:
        change = folded_change([group])
        if change > EXACTNESS_TOL:
            skipped.append({"module": group.producer, "reason": f"rescaling is not exact (output changed by {change:.2e})"})
        else:
            groups.append(group)
    return groups, skipped


def _group_size(group: SmoothGroup, modules: dict[str, nn.Module]) -> int:
    producer = modules[group.producer]
    return producer.weight.shape[0]


def _snapshot(group: SmoothGroup, modules: dict[str, nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    params = []
    for name in [group.producer, *group.consumers]:
        params += [p for p in modules[name].parameters(recurse=False)]
    return [(p, p.detach().clone()) for p in params]


def _restore(saved) -> None:
    for param, value in saved:
        param.data.copy_(value)


@torch.no_grad()
def _fold(group: SmoothGroup, modules: dict[str, nn.Module], scales: torch.Tensor) -> None:
    """Divide the producer's output channels by ``scales`` and multiply the consumers' columns by them.

    The arithmetic runs in float64 and is rounded once to each parameter's dtype.
    """
    producer = modules[group.producer]
    s = scales.double()
    if group.kind == "norm":
        w = producer.weight
        w.copy_(((w.double() + group.offset) / s.to(w.device) - group.offset).to(w.dtype))
        bias = getattr(producer, "bias", None)
        if bias is not None:
            bias.copy_((bias.double() / s.to(bias.device)).to(bias.dtype))
        column_scales = [s] * len(group.consumers)
    else:
        w = producer.weight
        w.copy_((w.double() / s.to(w.device)[:, None]).to(w.dtype))
        if producer.bias is not None:
            producer.bias.copy_((producer.bias.double() / s.to(w.device)).to(producer.bias.dtype))
        column_scales = [s[m] for m in group.channel_maps]
    for name, cs in zip(group.consumers, column_scales):
        cw = modules[name].weight
        cw.copy_((cw.double() * cs.to(cw.device)[None, :]).to(cw.dtype))


# --- statistics and the migration strength -------------------------------------------------------


@torch.no_grad()
def collect_channel_absmax(
    model: nn.Module,
    blocks: torch.Tensor,
    layer_names: list[str],
    batch_size: int = 4,
    progress: bool = True,
    sample_tokens: int = 0,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-input-channel max |x| (in_features,) float32 of the input of each named Linear, and
    (with ``sample_tokens`` > 0) a uniform random sample of at most that many input rows per layer.

    Memory: one (in_features,) vector per layer, plus ``sample_tokens x in_features`` floats per
    layer when sampling; one calibration batch in flight.
    """
    modules = dict(model.named_modules())
    stats: dict[str, torch.Tensor] = {}
    samples: dict[str, list[torch.Tensor]] = {n: [] for n in layer_names}
    generator = torch.Generator().manual_seed(seed)
    n_batches = -(-blocks.shape[0] // batch_size)
    per_batch = -(-sample_tokens // n_batches) if sample_tokens else 0

    def hook(name):
        def fn(_m, args):
            x = args[0].detach()
            rows = x.reshape(-1, x.shape[-1])
            current = rows.abs().amax(0).float().cpu()
            stats[name] = current if name not in stats else torch.maximum(stats[name], current)
            if per_batch:
                idx = torch.randperm(rows.shape[0], generator=generator)[:per_batch]
                samples[name].append(rows[idx.to(rows.device)].float().cpu())
        return fn

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in layer_names]
    try:
        forward_backbone(model, blocks, batch_size, desc="smoothquant statistics", progress=progress)
    finally:
        for h in handles:
            h.remove()
    return stats, {n: torch.cat(v)[:sample_tokens] for n, v in samples.items() if v}


def smoothing_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = max|x_j|^alpha / max|W_j|^(1 - alpha)`` in float64, 1 where a channel never fired."""
    x = act_absmax.double()
    w = weight_absmax.double().clamp_min(1e-8)
    s = x.clamp_min(1e-8).pow(alpha) / w.pow(1.0 - alpha)
    s = torch.where(x > 0, s, torch.ones_like(s))
    return s.clamp(1.0 / SCALE_LIMIT, SCALE_LIMIT)


def _group_statistics(group: SmoothGroup, modules, stats) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation absmax, weight column absmax) per producer output channel."""
    if group.kind == "norm":
        act = stats[group.consumers[0]]
        weight = torch.stack([modules[c].weight.detach().abs().amax(0).float().cpu() for c in group.consumers]).amax(0)
        return act, weight
    size = _group_size(group, modules)
    act = torch.zeros(size, dtype=torch.float32)
    weight = torch.zeros(size, dtype=torch.float32)
    for name, mapping in zip(group.consumers, group.channel_maps):
        cols = modules[name].weight.detach().abs().amax(0).float().cpu()
        act.scatter_reduce_(0, mapping, stats[name], "amax")
        weight.scatter_reduce_(0, mapping, cols, "amax")
    return act, weight


def _fake_quant_error(inputs: list[torch.Tensor], weights: list[torch.Tensor], outputs: list[torch.Tensor],
                      column_scales: list[torch.Tensor] | None, quant_dtype: torch.dtype, static: bool) -> float:
    """Relative output error of W8A8 (per-channel weights, per-token or per-tensor inputs) of the
    consumers after dividing their inputs / multiplying their columns by ``column_scales``.

    float32 throughout: the quantization error is ~1e-2 relative, far above float32 rounding.
    """
    error = reference = 0.0
    for i, (x, w, y) in enumerate(zip(inputs, weights, outputs)):
        if column_scales is not None:
            cs = column_scales[i].float()
            x, w = x / cs, w * cs
        if static:
            scale = (x.abs().max() / qmax_of(quant_dtype)).clamp_min(MIN_SCALE).reshape(1)
            x_q = quantize_per_tensor(x, scale, quant_dtype).float() * scale
        else:
            q, scale = quantize_per_token(x, quant_dtype)
            x_q = q.float() * scale[:, None]
        q_w, w_scale = quantize_per_channel(w, quant_dtype)
        y_q = x_q @ (q_w.float() * w_scale[:, None]).t()
        error += float((y - y_q).pow(2).sum())
        reference += float(y.pow(2).sum())
    return (error / reference) ** 0.5 if reference > 0 else 0.0


def search_alpha(group: SmoothGroup, modules, act: torch.Tensor, weight: torch.Tensor, samples: dict[str, torch.Tensor],
                 grid: tuple[float, ...], quant_dtype: torch.dtype, static: bool) -> tuple[float | None, dict]:
    """The migration strength of ``grid`` (or None: no smoothing) whose W8A8 output error on the
    sampled calibration inputs is smallest for this group; also returns every candidate's error.

    The same procedure runs for every group of every architecture: what adapts to the model is the
    measurement, not a constant.
    """
    if group.kind == "norm":
        inputs = [samples[group.consumers[0]]] * len(group.consumers)
        maps = [None] * len(group.consumers)
    else:
        inputs = [samples[c] for c in group.consumers]
        maps = group.channel_maps
    weights = [modules[c].weight.detach().float().cpu() for c in group.consumers]
    outputs = [x @ w.t() for x, w in zip(inputs, weights)]
    errors = {"none": _fake_quant_error(inputs, weights, outputs, None, quant_dtype, static)}
    best, best_error = None, errors["none"]
    for alpha in grid:
        scales = smoothing_scales(act, weight, alpha)
        column_scales = [scales if m is None else scales[m] for m in maps]
        errors[f"{alpha:g}"] = _fake_quant_error(inputs, weights, outputs, column_scales, quant_dtype, static)
        if errors[f"{alpha:g}"] < best_error:
            best, best_error = alpha, errors[f"{alpha:g}"]
    return best, errors


def _outliers(act: torch.Tensor, top: int = 8) -> dict:
    median = float(act.median())
    ratio = act / max(median, 1e-12)
    idx = torch.nonzero(ratio > OUTLIER_FACTOR).flatten()
    idx = idx[torch.argsort(act[idx], descending=True)][:top]
    return {
        "count": int((ratio > OUTLIER_FACTOR).sum()),
        "top": [{"channel": int(i), "absmax": round(float(act[i]), 4)} for i in idx],
        "median_absmax": round(median, 6),
    }


# --- the public entry point ---------------------------------------------------------------------


@torch.no_grad()
def smooth_model(
    model: nn.Module,
    blocks: torch.Tensor,
    alpha: float = 0.5,
    batch_size: int = 4,
    progress: bool = True,
    exclude: tuple[str, ...] = ("lm_head",),
    linear_pairs: bool = True,
    probe_tokens: int = 32,
    alpha_grid: tuple[float, ...] | None = None,
    quant_dtype: torch.dtype = torch.int8,
    static_activations: bool = False,
    search_tokens: int = 1024,
) -> dict:
    """Apply SmoothQuant in place (an exact identity in floating point) and return a JSON-able report.

    blocks: (n_samples, seq_len) token ids; statistics are collected over all of them.
    alpha: migration strength in [0, 1] (0 leaves activations as they are, 1 moves all their
    range into the weights). exclude: glob patterns of Linears not to touch (their producers are
    then left alone too). linear_pairs: also smooth Linear -> Linear paths (up -> down, v -> o).
    alpha_grid: if given, ``alpha`` is ignored and each group takes the strength of the grid (or
    no smoothing at all) that minimizes its consumers' W8A8 output error on ``search_tokens``
    sampled calibration tokens, quantized as ``quant_dtype`` / ``static_activations`` say.

    Memory: see the module docstring — O(sum of in_features) floats of statistics, probe inputs of
    ``probe_tokens`` tokens, and a transient float32 copy of 16-bit models.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")
    if alpha_grid is not None and (not alpha_grid or any(not 0.0 <= a <= 1.0 for a in alpha_grid)):
        raise ValueError(f"alpha_grid={alpha_grid} must be a non-empty tuple of values in [0, 1]")
    qmax_of(quant_dtype)  # validates the dtype
    if probe_tokens < 2:
        raise ValueError(f"probe_tokens={probe_tokens} must be >= 2")
    check_blocks(blocks)
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    # Only 16-bit parameters are upcast, and each returns to its own dtype afterwards: buffers
    # (RoPE's float32 inv_freq) and parameters a model keeps in float32 are left alone.
    upcast = {p: p.dtype for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16)}
    was_training = model.training
    model.eval()
    for param in upcast:
        param.data = param.data.float()
    try:
        probe = blocks[:1, :probe_tokens]
        groups, skipped = find_smoothing_groups(model, probe, exclude=exclude, linear_pairs=linear_pairs)
        modules = dict(model.named_modules())
        names = sorted({c for g in groups for c in (g.consumers[:1] if g.kind == "norm" else g.consumers)})
        sample_tokens = search_tokens if alpha_grid is not None else 0
        stats, samples = collect_channel_absmax(model, blocks, names, batch_size, progress, sample_tokens) if groups else ({}, {})
        prober = _Prober(model, probe)
        before = prober.run()
        entries = []
        plans = []
        # All scales are computed from the untouched weights first; the folds commute (row and
        # column rescalings of the same matrix), so their order does not matter.
        for group in groups:
            act, weight = _group_statistics(group, modules, stats)
            group_alpha, search = alpha, None
            if alpha_grid is not None:
                group_alpha, search = search_alpha(group, modules, act, weight, samples, tuple(alpha_grid),
                                                   quant_dtype, static_activations)
                if group_alpha is None:
                    entries.append({"producer": group.producer, "kind": group.kind, "consumers": group.consumers,
                                    "alpha": None, "search_errors": search})
                    continue
            scales = smoothing_scales(act, weight, group_alpha)
            plans.append((group, scales))
            entries.append({
                "producer": group.producer,
                "kind": group.kind,
                "consumers": group.consumers,
                "alpha": group_alpha,
                **({"search_errors": search} if search is not None else {}),
                "channels": int(scales.numel()),
                "scale": {
                    "min": float(scales.min()), "median": float(scales.median()), "max": float(scales.max()),
                },
                "act_absmax_before": float(act.max()),
                "act_absmax_after": float((act.double() / scales).max()),
                "outlier_channels": _outliers(act),
                **({"norm_offset": group.offset} if group.kind == "norm" else {}),
            })
        for group, scales in plans:
            _fold(group, modules, scales)
        change = _relative_change(before, prober.run()) if groups else 0.0
    finally:
        for param, dtype in upcast.items():
            param.data = param.data.to(dtype)
        model.train(was_training)
    if change > EXACTNESS_TOL:
        raise RuntimeError(
            f"SmoothQuant changed the model's output by {change:.2e} (relative) on the probe tokens although "
            "each rescaling was verified exact; scales may be too extreme for this dtype — lower alpha"
        )
    return {
        "alpha": "searched" if alpha_grid is not None else alpha,
        "alpha_grid": list(alpha_grid) if alpha_grid is not None else None,
        "n_smoothed": len(plans),
        "groups": entries,
        "skipped": skipped,
        "probe_relative_change": change,
        "n_calibration_tokens": int(blocks.numel()),
    }
