"""The one entry point from modules into kernels.

Modules call these functions with an explicit ``backend`` chosen once (at conversion or load):
``"triton"`` runs the Triton kernels (registered torch.library custom ops, so they trace under
torch.compile and capture in CUDA graphs), ``"torch"`` runs the pure-torch twins in
``reference.py``. Nothing here sniffs devices per call or catches exceptions to fall back.
Choose the backend with ``resolve_backend`` (or build the module for it): choosing "triton" imports
the kernel modules, which a torch.compile trace could not do, so the first call may be traced.
"""

from __future__ import annotations

import importlib

import torch

from quantkit.kernels import reference
from quantkit.kernels.gemm_checks import (check_combine_weights, check_grouped_args, check_scaled_mm_args,  # noqa: F401
                                          tma_ready)
from quantkit.kernels.quant_checks import (check_activation_input, check_per_tensor_scale, check_quant_dtype,
                                           check_rms_norm_args)

BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Turn ``"auto"`` into a concrete backend for ``device``; validate explicit choices."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    device = torch.device(device)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    elif backend == "triton" and not triton_available():
        raise ValueError("backend='triton' needs the triton package; install it or use backend='torch'")
    if backend == "triton":
        load_triton_kernels()
    return backend


# Triton-side modules by name, imported on first use so that the torch path never pays for (or
# needs) Triton, and kept: an import statement per call costs ~1 us on the eager hot path.
_KERNEL_MODULES: dict = {}


def kernel_module(name: str):
    """``quantkit.kernels.<name>``, imported once."""
    module = _KERNEL_MODULES.get(name)
    if module is None:
        module = _KERNEL_MODULES[name] = importlib.import_module(f"quantkit.kernels.{name}")
    return module


# Every module kernel_module loads. torch.compile cannot trace an import, so whoever chooses the
# "triton" backend (resolve_backend, a QuantLinear built for it) loads them all at that moment:
# a model's first forward may then be a traced one (torch.compile(fullgraph=True) before any
# eager call).
TRITON_KERNEL_MODULES = ("triton_ops", "attention", "rope", "norm", "kv_cache")


def load_triton_kernels() -> None:
    """Import the Triton-side kernel modules now (once), outside any torch.compile trace."""
    for name in TRITON_KERNEL_MODULES:
        kernel_module(name)


def _triton_ops():
    return kernel_module("triton_ops")


def is_triton(backend: str) -> bool:
    """Whether a resolved backend is "triton"; anything but "triton" or "torch" is refused. (The
    ops' torch path validates its arguments as the kernels do, minus their layout rules, so a bad
    call fails the same way on both.)"""
    if backend == "triton":
        return True
    if backend != "torch":
        raise ValueError(f"backend={backend!r}: pass 'triton' or 'torch' (resolve 'auto' once with resolve_backend)")
    return False


def scaled_mm(a, w, a_scale, w_scale, bias=None, activation="none", out_dtype=torch.bfloat16, backend="torch"):
    """GEMM + dequantization + bias + activation; see ``reference.scaled_mm`` for the math."""
    if is_triton(backend):
        return _triton_ops().scaled_mm(a, w, a_scale, w_scale, bias, activation, out_dtype)
    check_scaled_mm_args(a, w, a_scale, w_scale, bias, activation, out_dtype, layout=False)
    return reference.scaled_mm(a, w, a_scale, w_scale, bias, activation, out_dtype)


def gated_scaled_mm(a, w_gate_up, a_scale, w_scale, activation="silu", out_dtype=torch.bfloat16, backend="torch"):
    """``act(gate) * up`` from one GEMM over the stacked [gate; up] weight."""
    if is_triton(backend):
        return _triton_ops().gated_scaled_mm(a, w_gate_up, a_scale, w_scale, activation, out_dtype)
    check_scaled_mm_args(a, w_gate_up, a_scale, w_scale, None, activation, out_dtype, gated=True, layout=False)
    return reference.gated_scaled_mm(a, w_gate_up, a_scale, w_scale, activation, out_dtype)


def grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div=1, activation="none", gated=False,
                      out_dtype=torch.bfloat16, row_scale=None, plan=None, backend="torch"):
    """A mixture of experts' GEMMs in one call, one row per (token, slot) pair; see
    ``reference.grouped_scaled_mm``. The Triton kernel routes on the GPU (no host sync) by
    ``plan`` (``moe_route_plan``; made here if None)."""
    if is_triton(backend):
        return _triton_ops().grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div, activation, gated, out_dtype,
                                               row_scale, plan)
    check_grouped_args(a, w, a_scale, w_scale, experts, row_div, activation, out_dtype, gated, layout=False,
                       row_scale=row_scale)
    return reference.grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div, activation, gated, out_dtype,
                                       row_scale)


def moe_route_plan(experts, num_experts, slot_order=False, backend="torch"):
    """The routing plan of a mixture of experts' (token, slot) pairs for ``grouped_scaled_mm``
    (made once per layer, passed to both of its GEMMs); None on the torch backend, which needs none.
    ``slot_order``: the layer runs 128-row plans in slot order and its GEMMs fit the Gluon kernel
    (2-byte outputs), which takes 128-row blocks from fewer pairs an expert (``moe.block_m_for``)."""
    if is_triton(backend):
        return _triton_ops().moe_route_plan(experts, num_experts, slot_order)
    return None


def moe_slot_order(plan) -> bool:
    """A mixture of experts' layer keeps its rows in slot order between its GEMMs for this plan:
    prefill sizes (128-row blocks), on the Triton backend (the torch one plans nothing)."""
    return plan is not None and plan.block_m == 128


def moe_gather_slots(a, a_scale, plan, row_div, num_experts, backend="torch"):
    """(a_slots, scales): each routed pair's row of ``a`` (row ``pair // row_div``) and scale in its
    slot of ``plan``, zeros elsewhere; see ``reference.gather_slots``."""
    if is_triton(backend):
        return _triton_ops().moe_gather_slots(a, a_scale, plan, row_div, num_experts)
    return reference.gather_slots(a, a_scale, plan.rows, plan.block_expert, int(plan.used), plan.block_m, row_div,
                                  num_experts)


def grouped_slot_mm(a, w, a_scale, w_scale, plan, activation="none", gated=False, out_dtype=torch.bfloat16,
                    backend="torch"):
    """A mixture of experts' GEMM over rows in slot order (``moe_gather_slots``); see
    ``reference.grouped_slot_mm``."""
    if is_triton(backend):
        return _triton_ops().grouped_slot_mm(a, w, a_scale, w_scale, plan, activation, gated, out_dtype)
    return reference.grouped_slot_mm(a, w, a_scale, w_scale, plan.block_expert, int(plan.used), plan.block_m,
                                     activation, gated, out_dtype)


def moe_combine(y, slots, tokens, k, weights=None, backend="torch"):
    """(tokens, H): each token's k slot rows of ``y``, times the pairs' routing ``weights`` if given,
    summed in float32; see ``reference.combine``."""
    if is_triton(backend):
        return _triton_ops().moe_combine(y, slots, tokens, k, weights)
    check_combine_weights(weights, tokens, k)
    return reference.combine(y, slots, tokens, k, weights)


def quantize_per_token(x, dtype, backend="torch"):
    """(M, K) float -> (q (M, K), scale (M,) fp32), symmetric, one scale per row."""
    if is_triton(backend):
        return _triton_ops().quantize_per_token(x, dtype)
    check_activation_input(x, layout=False)
    check_quant_dtype(dtype)
    return reference.quantize_per_token(x, dtype)


def quantize_per_tensor(x, scale, dtype, backend="torch"):
    """(M, K) float -> (M, K) quantized with one static fp32 scale."""
    if is_triton(backend):
        return _triton_ops().quantize_per_tensor(x, scale, dtype)
    check_activation_input(x, layout=False)
    check_quant_dtype(dtype)
    check_per_tensor_scale(scale, x)
    return reference.quantize_per_tensor(x, scale, dtype)


def rms_norm_quant_per_token(x, weight, eps, dtype, residual=None, offset=0.0, backend="torch"):
    """RMSNorm (+ residual add, + Gemma's 1 + w) fused with per-token quantization."""
    if is_triton(backend):
        return _triton_ops().rms_norm_quant_per_token(x, weight, eps, dtype, residual, offset)
    check_rms_norm_args(x, weight, residual, layout=False, eps=eps, offset=offset)
    check_quant_dtype(dtype)
    return reference.rms_norm_quant_per_token(x, weight, eps, dtype, residual, offset)
