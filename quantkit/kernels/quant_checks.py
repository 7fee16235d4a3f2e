"""Argument checks of the quantization ops (shapes, dtypes, strides, devices): shared by the Triton
launchers in ``quant.py``, the registered ops' fake implementations (``triton_ops.py``) and the torch
backend (``ops.py``), so a bad call raises the same ValueError on every path. No triton import.

``layout=False`` (the torch backend) leaves out what only the kernels need: unit strides and the
fused norm's row length.
"""

from __future__ import annotations

import torch

from quantkit.kernels.reference import QUANT_DTYPES, check_eps, check_offset

# A whole row stays in registers up to this many elements (one read of the input); longer rows
# take two passes (the second mostly hits L2).
MAX_SINGLE_PASS_K = 16384
FLOAT_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_quant_dtype(dtype: torch.dtype) -> None:
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"dtype={dtype} is not a quantized dtype; use torch.int8 or torch.float8_e4m3fn")


def check_activation_input(x: torch.Tensor, name: str = "x", layout: bool = True) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (M, K), got shape {tuple(x.shape)}; flatten leading dims first")
    if x.dtype not in FLOAT_INPUT_DTYPES:
        raise ValueError(f"{name}.dtype={x.dtype} is not supported; use float32, float16 or bfloat16")
    if layout and x.shape[1] > 0 and x.stride(1) != 1:
        raise ValueError(f"{name} has stride {x.stride()} along K; the kernel needs unit stride: pass {name}.contiguous()")


def check_rms_norm_args(x, weight, residual, layout: bool = True, eps: float = 0.0, offset: float = 0.0) -> None:
    check_eps(eps)
    check_offset(offset)
    check_activation_input(x, layout=layout)
    for name, tensor in (("weight", weight), ("residual", residual)):
        if not (isinstance(tensor, torch.Tensor) or (name == "residual" and tensor is None)):
            raise TypeError(f"{name} is a {type(tensor).__name__}; pass a tensor"
                            + (" (or None)" if name == "residual" else ""))
    K = x.shape[1]
    if weight.dim() != 1 or weight.shape[0] != K:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; RMSNorm over K={K} needs shape ({K},)")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"weight.dtype={weight.dtype} must be a float dtype")
    if layout and weight.stride(0) != 1 and K > 1:
        raise ValueError("weight must be contiguous; pass weight.contiguous()")
    if layout and K > MAX_SINGLE_PASS_K:
        raise ValueError(f"K={K} > {MAX_SINGLE_PASS_K}: the fused RMSNorm keeps a row in registers; "
                         "use the unfused norm + quantize_per_token for such rows")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual.dtype={residual.dtype} != x.dtype={x.dtype}; cast one of them")
        if layout and K > 0 and residual.stride(1) != 1:
            raise ValueError("residual needs unit stride along K: pass residual.contiguous()")
    for name, tensor in (("weight", weight), ("residual", residual)):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")


def check_per_tensor_scale(scale: torch.Tensor, x: torch.Tensor) -> None:
    """Shape, dtype and device only: a static scale's value is checked where it is made (calibration,
    checkpoint loading), since reading it here would synchronize with the GPU on every call."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"scale must be a 1-element float32 tensor, got {type(scale).__name__}; "
                        "pass torch.tensor([scale], dtype=torch.float32)")
    if scale.numel() != 1:
        raise ValueError(f"scale has {scale.numel()} elements; static per-tensor quantization takes one")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale.dtype={scale.dtype}; pass a float32 scale (scale.float())")
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device} but x is on {x.device}")
