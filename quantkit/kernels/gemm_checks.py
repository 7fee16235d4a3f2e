"""Argument checks of the scaled GEMM (shapes, dtypes, strides, devices): shared by the launchers
in ``gemm.py`` and the registered ops' fake implementations (``triton_ops.py``), so a bad call
raises the same ValueError on every path. No triton import: nothing here launches.
"""

from __future__ import annotations

import torch

from quantkit.kernels.reference import ACTIVATIONS, INT8_MIN, QUANT_DTYPES

ACTIVATION_CODES = {name: code for code, name in enumerate(ACTIVATIONS)}  # none=0 relu=1 silu=2 gelu=3 gelu_tanh=4
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Rows of a and w must start on 16-byte boundaries for wide loads (and the tensor-core paths
# of cuBLAS/_scaled_mm have the same rule); with 1-byte elements that is K % 16 == 0.
K_ALIGNMENT = 16
# Largest K whose INT8 dot products cannot overflow an int32 accumulator.
MAX_INT8_K = (2**31 - 1) // int(INT8_MIN * INT8_MIN)


def _check_scale(scale: torch.Tensor, name: str, length: int, length_name: str, ref: torch.Tensor) -> bool:
    """Validate a scale; returns True when it is a vector (one entry per row / channel)."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(
            f"{name} is a {type(scale).__name__}; scales are float32 tensors: pass torch.tensor({name}, dtype=torch.float32)"
        )
    if scale.dtype != torch.float32:
        raise ValueError(f"{name}.dtype={scale.dtype}; scales must be float32: pass {name}.float()")
    if scale.device != ref.device:
        raise ValueError(f"{name} is on {scale.device} but the operands are on {ref.device}")
    if scale.numel() == 1:
        return False
    if scale.dim() != 1 or scale.shape[0] != length:
        raise ValueError(
            f"{name} has shape {tuple(scale.shape)}; expected ({length},) (one per {length_name}) or a single "
            f"element. A (N, 1) checkpoint scale must be passed as scale.view(-1)"
        )
    if scale.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous: pass {name}.contiguous()")
    return True


def check_scaled_mm_args(a, w, a_scale, w_scale, bias, activation, out_dtype, gated=False, layout=True):
    """Raise ValueError naming the problem for anything the kernel cannot take; return (M, N_out, K).

    ``layout=False`` (the torch backend) leaves out what only the kernels need: K a multiple of 16
    and their strides."""
    for name, t in (("a", a), ("w", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(
            f"a and w must be 2-D, got a {tuple(a.shape)} and w {tuple(w.shape)}; flatten leading dims of a"
        )
    if a.dtype not in QUANT_DTYPES:
        raise ValueError(f"a.dtype={a.dtype}; the GEMM takes int8 or float8_e4m3fn: quantize the activation first")
    if w.dtype != a.dtype:
        raise ValueError(f"w.dtype={w.dtype} != a.dtype={a.dtype}; quantize both to the same dtype")
    M, K = a.shape
    N_w, K_w = w.shape
    if K_w != K:
        raise ValueError(f"K mismatch: a is (M={M}, K={K}) but w is (N={N_w}, K={K_w}); w must be (N, K)")
    if K == 0 and M > 0 and N_w > 0:
        raise ValueError(f"K=0: nothing to multiply; the GEMM needs K >= {K_ALIGNMENT if layout else 1}")
    if layout and K % K_ALIGNMENT != 0:
        raise ValueError(
            f"K={K} is not a multiple of {K_ALIGNMENT}; pad K with zero columns in both a and w "
            f"(zeros do not change the product)"
        )
    if a.dtype == torch.int8 and K > MAX_INT8_K:
        raise ValueError(f"K={K} > {MAX_INT8_K} could overflow the int32 accumulator; split the reduction")
    for name, t in (("a", a), ("w", w)) if layout else ():
        # A single row's row stride is never used, but its K stride always is.
        if (t.shape[1] > 1 and t.stride(1) != 1) or (t.shape[0] > 1 and t.stride(0) % K_ALIGNMENT != 0):
            raise ValueError(
                f"{name} has strides {t.stride()}; the kernel needs unit stride along K and a row stride "
                f"that is a multiple of {K_ALIGNMENT}: pass {name}.contiguous()"
            )
    if w.device != a.device:
        raise ValueError(f"w is on {w.device} but a is on {a.device}")
    if gated:
        if N_w % 2 != 0:
            raise ValueError(f"w_gate_up has {N_w} rows; it must stack gate and up, 2 * N rows")
        N = N_w // 2
    else:
        N = N_w
    _check_scale(a_scale, "a_scale", M, "token (row of a)", a)
    _check_scale(w_scale, "w_scale", N_w, "output channel (row of w)", a)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias is a {type(bias).__name__}; pass a ({N},) float tensor or None")
        if gated:
            raise ValueError("the gated GEMM takes no bias")
        if bias.dim() != 1 or bias.shape[0] != N:
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({N},)")
        if not bias.dtype.is_floating_point:
            raise ValueError(f"bias.dtype={bias.dtype} must be a float dtype")
        if bias.device != a.device:
            raise ValueError(f"bias is on {bias.device} but a is on {a.device}")
        if N > 1 and bias.stride(0) != 1:
            raise ValueError("bias must be contiguous: pass bias.contiguous()")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation={activation!r} is not supported; choose one of {ACTIVATIONS}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype={out_dtype} is not supported; use torch.bfloat16, torch.float16 or torch.float32")
    return M, N, K


def check_grouped_args(a, w, a_scale, w_scale, experts, row_div, activation, out_dtype, gated=False, layout=True,
                       row_scale=None):
    """The grouped (mixture-of-experts) GEMM's checks: ``a`` (R, K) rows, ``w`` (E, N, K) one
    matrix per expert, ``w_scale`` (E, N), ``experts`` (P,) with P = R * row_div, ``row_scale``
    None or (P,) float32. Returns
    (P, N_out, K); each expert's GEMM is then checked as ``check_scaled_mm_args`` checks one."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise ValueError(f"w must be a 3-D (experts, N, K) tensor, got {getattr(w, 'shape', type(w).__name__)}")
    if not isinstance(w_scale, torch.Tensor) or tuple(w_scale.shape) != tuple(w.shape[:2]):
        raise ValueError(f"w_scale has shape {tuple(getattr(w_scale, 'shape', ()))}; expected {tuple(w.shape[:2])} "
                         "(one per expert and output channel)")
    if layout and (not w.is_contiguous() or not w_scale.is_contiguous()):
        raise ValueError("w and w_scale must be contiguous: pass w.contiguous() and w_scale.contiguous()")
    if not isinstance(row_div, int) or row_div < 1:
        raise ValueError(f"row_div={row_div!r} must be an int >= 1 (pairs per row of a)")
    if not isinstance(experts, torch.Tensor) or experts.dim() != 1 or experts.is_floating_point() \
            or experts.dtype == torch.bool:
        raise ValueError(f"experts must be a 1-D integer tensor (the expert of each pair), got "
                         f"{getattr(experts, 'dtype', type(experts).__name__)} {tuple(getattr(experts, 'shape', ()))}")
    if experts.device != getattr(a, "device", None):
        raise ValueError(f"experts is on {experts.device} but a is on {getattr(a, 'device', None)}; move it with "
                         "experts.to(a.device)")
    if experts.numel() > 1 and experts.stride(0) != 1:
        raise ValueError(f"experts has stride {experts.stride(0)}; the kernel reads it as one contiguous row: pass "
                         "experts.contiguous()")
    if w.shape[0] < 1:
        raise ValueError("w holds no expert (shape (0, N, K)); pass at least one expert's weight")
    _, n_out, K = check_scaled_mm_args(a, w[0], a_scale, w_scale[0], None, activation, out_dtype, gated=gated,
                                       layout=layout)
    if experts.numel() != a.shape[0] * row_div:
        raise ValueError(f"experts has {experts.numel()} pairs but a has {a.shape[0]} rows x row_div={row_div}; "
                         "pass one expert per (row, slot) pair")
    if row_scale is not None and (not isinstance(row_scale, torch.Tensor) or row_scale.dtype != torch.float32
                                  or tuple(row_scale.shape) != (experts.numel(),) or row_scale.stride(0) != 1
                                  or row_scale.device != a.device):
        raise ValueError(f"row_scale must be a contiguous float32 ({experts.numel()},) tensor on {a.device} (one per "
                         f"pair), got {getattr(row_scale, 'dtype', type(row_scale).__name__)} "
                         f"{tuple(getattr(row_scale, 'shape', ()))}")
    return experts.numel(), n_out, K


def tma_ready(w: torch.Tensor) -> bool:
    """A stacked expert weight TMA can move whole: contiguous, a 16-byte aligned base, K a multiple of 16."""
    return w.is_contiguous() and w.data_ptr() % 16 == 0 and w.shape[-1] % 16 == 0


def check_combine_weights(weights: torch.Tensor | None, tokens: int, k: int) -> None:
    """A mixture of experts' routing weights for its combine: one per (token, slot) pair, float, contiguous."""
    if weights is not None and (weights.numel() != tokens * k or not weights.is_floating_point()
                                or not weights.is_contiguous()):
        raise ValueError(f"weights must be a contiguous float tensor of tokens * k = {tokens * k} routing weights, "
                         f"got {weights.dtype} {tuple(weights.shape)}")
