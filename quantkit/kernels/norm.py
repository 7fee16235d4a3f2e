"""RMSNorm and LayerNorm with the residual add fused in; 16-bit (or fp32) in and out.

One program normalizes a block of rows held whole in registers (``BLOCK_N`` = next power of
two of the hidden size). The residual stream ``x + residual`` is rounded to the input dtype,
stored as the next layer's residual, and normalized from that rounded value, so the fused
kernel matches an unfused ``add`` then ``norm`` in 16 bits exactly. Statistics run in float32.
The fused RMSNorm + quantization kernel for quantized layers lives in ``quant.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.launch import INTERPRETED as _INTERPRETED
from quantkit.kernels.launch import CachedLaunch, aligned, cdiv, int_spec, next_power_of_2, on_its_gpu
from quantkit.kernels.reference_attention import check_norm_inputs


@triton.jit
def _load_rows_with_residual(X, RES, RES_OUT, offs, mask, HAS_RESIDUAL: tl.constexpr):
    x = tl.load(X + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        summed = (x.to(tl.float32) + tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(RES_OUT + offs, summed, mask=mask)
        x = summed
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    X, RES, W, Y, RES_OUT, n_rows, n_cols, eps, offset,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_ok[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = _load_rows_with_residual(X, RES, RES_OUT, offs, mask, HAS_RESIDUAL)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 1) / n_cols + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    tl.store(Y + offs, (x * inv_rms[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_kernel(
    X, RES, W, B, Y, RES_OUT, n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_ok[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = _load_rows_with_residual(X, RES, RES_OUT, offs, mask, HAS_RESIDUAL)
    mean = tl.sum(x, 1) / n_cols
    centered = tl.where(mask, x - mean[:, None], 0.0)
    inv_std = 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / n_cols + eps)
    y = centered * inv_std[:, None] * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


_RMS_NORM = CachedLaunch(_rms_norm_kernel)
_LAYER_NORM = CachedLaunch(_layer_norm_kernel)


def _launch_shape(x: torch.Tensor) -> tuple[int, int, int, int, int]:
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    block_n = next_power_of_2(n_cols)
    # Interpreter cost is per program: many rows each. On the GPU one row a program is enough
    # once rows are long; short rows share a program so that each moves a useful tile.
    block_m = 16 if _INTERPRETED else max(1, min(16, 4096 // block_n))
    num_warps = 4 if block_n * block_m <= 4096 else 8
    return n_rows, n_cols, block_m, block_n, num_warps


@on_its_gpu
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch RMSNorm (+ residual); returns (y, new residual or None). Twin: ``reference_attention.rms_norm``."""
    check_norm_inputs(x, weight, residual, eps=eps)
    x, weight = x.contiguous(), weight.contiguous()  # the kernel reads the weight with unit stride
    residual = residual.contiguous() if residual is not None else None
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    n_rows, n_cols, block_m, block_n, num_warps = _launch_shape(x)
    if n_rows:
        res_arg = residual if residual is not None else x
        res_out_arg = res_out if res_out is not None else y
        key = (x.dtype, weight.dtype, residual is not None, n_cols, int_spec(n_rows), block_m, block_n, num_warps,
               aligned(x, res_arg, weight, y, res_out_arg))
        _RMS_NORM(key, (cdiv(n_rows, block_m),),
                  (x, res_arg, weight, y, res_out_arg, n_rows, n_cols, float(eps), float(offset)),
                  dict(HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n), num_warps, 3)
    return y, res_out


@on_its_gpu
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch LayerNorm (+ residual); returns (y, new residual or None). Twin: ``reference_attention.layer_norm``."""
    check_norm_inputs(x, weight, residual, bias, eps)
    x, weight = x.contiguous(), weight.contiguous()  # the kernel reads weight and bias with unit stride
    bias = bias.contiguous() if bias is not None else None
    residual = residual.contiguous() if residual is not None else None
    y = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    n_rows, n_cols, block_m, block_n, num_warps = _launch_shape(x)
    if n_rows:
        res_arg = residual if residual is not None else x
        bias_arg = bias if bias is not None else weight
        res_out_arg = res_out if res_out is not None else y
        key = (x.dtype, weight.dtype, bias_arg.dtype, residual is not None, bias is not None, n_cols, int_spec(n_rows),
               block_m, block_n, num_warps, aligned(x, res_arg, weight, bias_arg, y, res_out_arg))
        _LAYER_NORM(key, (cdiv(n_rows, block_m),),
                    (x, res_arg, weight, bias_arg, y, res_out_arg, n_rows, n_cols, float(eps)),
                    dict(HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m,
                         BLOCK_N=block_n), num_warps, 3)
    return y, res_out
