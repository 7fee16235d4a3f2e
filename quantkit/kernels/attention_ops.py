"""Attention, RoPE and normalization ops: torch.library custom ops + explicit backend dispatch.

Same contract as ``ops.py``: callers pass ``backend="triton"`` (registered custom ops around the
Triton launchers, so they trace under torch.compile and capture in CUDA graphs) or
``backend="torch"`` (the twins in ``reference_attention.py``); ``"auto"`` is resolved once by
``ops.resolve_backend``. Both backends validate inputs the same way, before any GPU work, and
raise ValueError. Triton is imported on first use of a Triton op only.

Registered ops (namespace ``quantkit``): ``flash_attention``, ``decode_attention``, ``rope``,
``write_kv_cache`` (in place), ``rms_norm``, ``rms_norm_residual``, ``layer_norm``,
``layer_norm_residual``. Custom ops may not return aliases of their inputs, so norms without a
residual are separate ops. As in ``triton_ops``, eager calls on plain tensors launch directly
(``triton_ops.direct_launch``: the op dispatcher's ~20-30 us per call dominated eager prefill);
tracing still goes through the ops.
The Triton launchers validate their inputs themselves, so the direct path checks once.
"""

from typing import Optional

import torch

from quantkit.kernels import reference_attention as reference
from quantkit.kernels.ops import is_triton, kernel_module
from quantkit.kernels.reference_attention import (
    check_decode_inputs,
    check_kv_cache_write_inputs,
    check_norm_inputs,
    check_prefill_inputs,
    check_rope_inputs,
)


def _attention_kernels():
    return kernel_module("attention")


def _rope_kernels():
    return kernel_module("rope")


def _norm_kernels():
    return kernel_module("norm")


def _direct(x: torch.Tensor, name: str = "x") -> bool:
    return kernel_module("triton_ops").direct_launch(x, name)


# --------------------------------------------------------------------------- registered ops


@torch.library.custom_op("quantkit::flash_attention", mutates_args=())
def _flash_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: Optional[int],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: Optional[int],
) -> torch.Tensor:
    return _attention_kernels().flash_attention(q, k, v, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)


@_flash_attention_op.register_fake
def _(q, k, v, scale, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("quantkit::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
    window: Optional[int],
    max_seqlen: Optional[int],
) -> torch.Tensor:
    return _attention_kernels().decode_attention(q, k_cache, v_cache, cache_seqlens, scale, window, max_seqlen)


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, scale, window, max_seqlen):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("quantkit::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_kernels().apply_rope(q, k, cos, sin)


@_rope_op.register_fake
def _(q, k, cos, sin):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


@torch.library.custom_op("quantkit::write_kv_cache", mutates_args=("k_cache", "v_cache"))
def _write_kv_cache_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       positions: torch.Tensor) -> None:
    kernel_module("kv_cache").write_kv_cache(k, v, k_cache, v_cache, positions)


@_write_kv_cache_op.register_fake
def _(k, v, k_cache, v_cache, positions):
    return None


@torch.library.custom_op("quantkit::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    return _norm_kernels().rms_norm(x, weight, eps, None, offset)[0]


@_rms_norm_op.register_fake
def _(x, weight, eps, offset):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("quantkit::rms_norm_residual", mutates_args=())
def _rms_norm_residual_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_kernels().rms_norm(x, weight, eps, residual, offset)


@_rms_norm_residual_op.register_fake
def _(x, residual, weight, eps, offset):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("quantkit::layer_norm", mutates_args=())
def _layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return _norm_kernels().layer_norm(x, weight, bias, eps, None)[0]


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("quantkit::layer_norm_residual", mutates_args=())
def _layer_norm_residual_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm_kernels().layer_norm(x, weight, bias, eps, residual)


@_layer_norm_residual_op.register_fake
def _(x, residual, weight, bias, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)


# --------------------------------------------------------------------------- public dispatch


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Causal prefill attention, batched (B, H, S, D) or packed (T, H, D) with cu_seqlens.

    See ``reference_attention.flash_attention``. Packed inputs on the Triton backend also need
    ``max_seqlen_q``, a host-side bound on the longest sequence.
    """
    triton = is_triton(backend)
    if triton and _direct(q, "q"):
        return _attention_kernels().flash_attention(q, k, v, float(scale), window, cu_seqlens_q, cu_seqlens_k,
                                                    max_seqlen_q)
    check_prefill_inputs(q, k, v, window, cu_seqlens_q, cu_seqlens_k)
    if triton:
        return _flash_attention_op(q, k, v, float(scale), window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q)
    return reference.flash_attention(q, k, v, scale, window, cu_seqlens_q, cu_seqlens_k)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
    max_seqlen: Optional[int] = None,
    backend: str = "torch",
) -> torch.Tensor:
    """One query token per sequence over a static (B, Hkv, capacity, D) cache; see the twin."""
    triton = is_triton(backend)
    if triton and _direct(q, "q"):
        return _attention_kernels().decode_attention(q, k_cache, v_cache, cache_seqlens, float(scale), window,
                                                     max_seqlen)
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, window, max_seqlen)
    if triton:
        return _decode_attention_op(q, k_cache, v_cache, cache_seqlens, float(scale), window, max_seqlen)
    return reference.decode_attention(q, k_cache, v_cache, cache_seqlens, scale, window)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on q (B, Hq, S, D) and k (B, Hkv, S, D) with HF's cos/sin (B|1, S, D)."""
    triton = is_triton(backend)
    if triton and _direct(q, "q"):
        return _rope_kernels().apply_rope(q, k, cos, sin)
    check_rope_inputs(q, k, cos, sin)
    if triton:
        return _rope_op(q, k, cos, sin)
    return reference.apply_rope(q, k, cos, sin)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   positions: torch.Tensor, backend: str = "torch") -> None:
    """``k_cache[b, h, positions[s], :D] = k[b, h, s]`` and the same for v, in place; k, v
    (B, Hkv, S, D), caches (B, Hkv, capacity, Dc >= D), positions (S,) int64. The Triton backend
    writes both in one launch and skips a position outside [0, capacity); the torch backend
    (``index_copy_``) raises there (a device assert on CUDA)."""
    triton = is_triton(backend)
    if triton and _direct(k, "k"):
        return kernel_module("kv_cache").write_kv_cache(k, v, k_cache, v_cache, positions)
    check_kv_cache_write_inputs(k, v, k_cache, v_cache, positions)
    if triton:
        return _write_kv_cache_op(k, v, k_cache, v_cache, positions)
    return reference.write_kv_cache(k, v, k_cache, v_cache, positions)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    offset: float = 0.0,
    backend: str = "torch",
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm (+ fused residual add, + Gemma's ``offset=1``); returns (y, new residual or None)."""
    triton = is_triton(backend)
    if triton and _direct(x):
        return _norm_kernels().rms_norm(x, weight, eps, residual, float(offset))
    check_norm_inputs(x, weight, residual, eps=eps)
    if not triton:
        return reference.rms_norm(x, weight, eps, residual, offset)
    if residual is None:
        return _rms_norm_op(x, weight, float(eps), float(offset)), None
    return _rms_norm_residual_op(x, residual, weight, float(eps), float(offset))


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    residual: Optional[torch.Tensor] = None,
    backend: str = "torch",
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """LayerNorm (+ fused residual add); returns (y, new residual or None)."""
    triton = is_triton(backend)
    if triton and _direct(x):
        return _norm_kernels().layer_norm(x, weight, bias, eps, residual)
    check_norm_inputs(x, weight, residual, bias, eps)
    if not triton:
        return reference.layer_norm(x, weight, bias, eps, residual)
    if residual is None:
        return _layer_norm_op(x, weight, bias, float(eps)), None
    return _layer_norm_residual_op(x, residual, weight, bias, float(eps))
