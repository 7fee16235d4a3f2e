"""Per-output-channel weight ranges: absmax, a percentile of |w|, or the clip whose quantization error is smallest.

Round-to-nearest with ``scale = row_absmax / qmax`` spends the whole grid on the row's single
largest weight; clipping a little (a ratio of the absmax) shrinks the step for every other weight.
The search scores each ratio by the squared error of the dequantized row, optionally weighted per
input column by the activations' mean square ``E[x_k^2]`` — then it is the expected output error
of that row, ``E[(dW . x)^2]`` for uncorrelated inputs.
"""

from __future__ import annotations

import torch

from quantkit.kernels.reference import MIN_SCALE, cast_to_quantized, qmax_of

# Ratios of the row absmax tried; 1.0 (plain absmax) is always among them so the search never
# returns a worse clip than round-to-nearest on the error it measures.
WEIGHT_CLIP_RATIOS = tuple(0.5 + 0.5 * i / 50 for i in range(51))
# Rows are processed in chunks so the temporary (rows x K) copies stay near 64 MiB of float32.
CHUNK_ELEMENTS = 1 << 24
WEIGHT_OBSERVERS = ("absmax", "percentile", "mse")


def weight_amax(
    weight: torch.Tensor,
    dtype: torch.dtype,
    observer: str = "absmax",
    percentile: float = 99.99,
    column_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row clipping magnitude (N,) float32 of ``weight`` (N, K) as ``observer`` says.

    "absmax": the row's largest |w| (no clipping). "percentile": the ``percentile``-th of the row's
    |w| (nearest rank, so 100 is the absmax). "mse": ``search_weight_clip`` (``column_weight``
    weighs its error per input column).
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (N, K); got shape {tuple(weight.shape)}")
    if observer == "mse":
        return search_weight_clip(weight, dtype, column_weight=column_weight)
    w = weight.detach().float().abs()
    if observer == "absmax":
        return w.amax(dim=1)
    if observer == "percentile":
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile={percentile} must be in (0, 100]")
        k = max(1, min(w.shape[1], int(round(percentile / 100.0 * w.shape[1]))))
        return w.kthvalue(k, dim=1).values
    raise ValueError(f"weight observer={observer!r} is not one of {WEIGHT_OBSERVERS}")


def search_weight_clip(
    weight: torch.Tensor,
    dtype: torch.dtype,
    ratios: tuple[float, ...] = WEIGHT_CLIP_RATIOS,
    column_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped per-row amax (N,) float32 of ``weight`` (N, K) that minimizes quantization MSE.

    dtype: torch.int8 or torch.float8_e4m3fn (rounding is reference.py's ``cast_to_quantized``).
    column_weight: optional (K,) non-negative importance per input column, e.g. the calibration
    activations' mean square; None weighs every column equally.
    Feed the result to ``scale = amax / qmax_of(dtype)``.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (N, K); got shape {tuple(weight.shape)}")
    qmax = qmax_of(dtype)
    if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
        raise ValueError(f"clip ratios must be non-empty and in (0, 1]; got {ratios}")
    N, K = weight.shape
    if column_weight is not None:
        if column_weight.shape != (K,):
            raise ValueError(f"column_weight must have shape ({K},); got {tuple(column_weight.shape)}")
        if bool((column_weight < 0).any()):
            raise ValueError("column_weight must be non-negative")
        column_weight = column_weight.detach().float().to(weight.device)
    w_all = weight.detach().float()
    amax_all = w_all.abs().amax(dim=1)
    ratio_list = sorted(ratios, reverse=True)  # 1.0 first: ties keep the larger (unclipped) range
    best_amax = torch.empty(N, dtype=torch.float32, device=weight.device)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(K, 1))
    for start in range(0, N, rows_per_chunk):
        w = w_all[start : start + rows_per_chunk]
        amax = amax_all[start : start + rows_per_chunk]
        best_err = torch.full_like(amax, float("inf"))
        best = amax.clone()
        for ratio in ratio_list:
            candidate = amax * ratio
            scale = (candidate / qmax).clamp_min(MIN_SCALE)[:, None]
            err = (w - cast_to_quantized(w / scale, dtype).float() * scale).pow(2)
            err = err @ column_weight if column_weight is not None else err.sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, candidate, best)
        best_amax[start : start + rows_per_chunk] = best
    return best_amax
