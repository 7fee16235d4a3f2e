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


import torch
from torch import nn

from quantkit.calibration.calibrate import check_blocks, forward_backbone
from quantkit.calibration.smoothing_graph import (
    EXACTNESS_TOL,
    SmoothGroup,
    _fold,
    _group_size,
    _Prober,
    _relative_change,
    find_smoothing_groups,
)
from quantkit.kernels.reference import (
    qmax_of,
    scale_from_amax,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
)

# Channels whose activation absmax exceeds this multiple of the median are reported as outliers.
OUTLIER_FACTOR = 10.0
# Scales are kept within [1/SCALE_LIMIT, SCALE_LIMIT] so no weight over/underflows in 16 bits.
SCALE_LIMIT = 1e4


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
            scale = scale_from_amax(x.abs().max(), quant_dtype).reshape(1)
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
    storage_dtype: torch.dtype | None = None,
) -> dict:
    """Apply SmoothQuant in place (an exact identity in floating point) and return a JSON-able report.

    blocks: (n_samples, seq_len) token ids; statistics are collected over all of them.
    alpha: migration strength in [0, 1], ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``: at 1 every
    activation channel ends with the same range (the weights take all of it), at 0 every weight
    input channel does (activations are still rescaled, by ``max|W_j|``). exclude: glob patterns of Linears not to touch (their producers are
    then left alone too). linear_pairs: also smooth Linear -> Linear paths (up -> down, v -> o).
    alpha_grid: if given, ``alpha`` is ignored and each group takes the strength of the grid (or
    no smoothing at all) that minimizes its consumers' W8A8 output error on ``search_tokens``
    sampled calibration tokens, quantized as ``quant_dtype`` / ``static_activations`` say.
    storage_dtype: the 16-bit dtype a float32 model's weights will be saved in (``quantize`` passes
    the source checkpoint's); norm gains are rounded to it as they are folded, so the saved model
    is the one smoothed.

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
    stored = dict(upcast)
    if storage_dtype is not None:
        stored.update({p: storage_dtype for p in model.parameters() if p.dtype == torch.float32})
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
            _fold(group, modules, scales, stored_dtypes=stored)
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
