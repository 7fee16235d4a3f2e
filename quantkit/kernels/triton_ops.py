"""The Triton kernels registered as torch.library custom ops (namespace ``quantkit``).

Registering them makes each launch one opaque node for torch.compile (fullgraph=True works, the
autotuner and the launcher's Python never get traced) and lets CUDA graphs capture them. The
fake implementations run the launchers' own shape/dtype validation, so a bad call fails the same
way while tracing as it does eagerly.

``torch.library.custom_op`` (not ``triton_op``/``wrap_triton``): the latter fails opcheck and
torch.compile on CPU tensors, which is how the CI runs these kernels under the interpreter.

Eager calls skip the op and call the launcher directly (``direct_launch``): the custom-op
dispatcher costs ~20-30 us of Python per call (autograd wrapper, dynamo-disable frame,
redispatch), more than the launch itself, and eager prefill is host-bound on it. The op still
runs whenever torch.compile/export traces (``torch.compiler.is_compiling()``) or the input is
a tensor subclass (fake tensors, functional tensors), so tracing sees one opaque node as
before. CUDA-graph capture works either way (the launcher only allocates and launches).
"""

from __future__ import annotations

import torch

from quantkit.kernels import gemm, moe, quant
from quantkit.kernels.gemm_checks import check_combine_weights, check_grouped_args


# ---------------------------------------------------------------------------------------------- GEMMs


@torch.library.custom_op("quantkit::scaled_mm", mutates_args=())
def _scaled_mm_op(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return gemm.scaled_mm(a, w, a_scale, w_scale, bias, activation, out_dtype)


@_scaled_mm_op.register_fake
def _(a, w, a_scale, w_scale, bias, activation, out_dtype):
    M, N, _ = gemm.check_scaled_mm_args(a, w, a_scale, w_scale, bias, activation, out_dtype)
    return a.new_empty((M, N), dtype=out_dtype)


@torch.library.custom_op("quantkit::gated_scaled_mm", mutates_args=())
def _gated_scaled_mm_op(
    a: torch.Tensor,
    w_gate_up: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    activation: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return gemm.gated_scaled_mm(a, w_gate_up, a_scale, w_scale, activation, out_dtype)


@_gated_scaled_mm_op.register_fake
def _(a, w_gate_up, a_scale, w_scale, activation, out_dtype):
    M, N, _ = gemm.check_scaled_mm_args(a, w_gate_up, a_scale, w_scale, None, activation, out_dtype, gated=True)
    return a.new_empty((M, N), dtype=out_dtype)


@torch.library.custom_op("quantkit::grouped_scaled_mm", mutates_args=())
def _grouped_scaled_mm_op(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    experts: torch.Tensor,
    row_div: int,
    activation: str,
    gated: bool,
    out_dtype: torch.dtype,
    row_scale: torch.Tensor | None,
    plan_rows: torch.Tensor | None,
    plan_block_expert: torch.Tensor | None,
    plan_used: torch.Tensor | None,
    plan_block_m: int,
) -> torch.Tensor:
    plan = None if plan_rows is None else moe.RoutePlan(plan_rows, plan_block_expert, plan_used, plan_block_m)
    return moe.grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div, activation, gated, out_dtype, row_scale,
                                 plan)


@_grouped_scaled_mm_op.register_fake
def _(a, w, a_scale, w_scale, experts, row_div, activation, gated, out_dtype, row_scale, *plan):
    pairs, n_out, _ = check_grouped_args(a, w, a_scale, w_scale, experts, row_div, activation, out_dtype, gated,
                                         row_scale=row_scale)
    return a.new_empty((pairs, n_out), dtype=out_dtype)


@torch.library.custom_op("quantkit::moe_route_plan", mutates_args=())
def _moe_route_plan_op(experts: torch.Tensor, num_experts: int, slot_order: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = moe.plan_for(experts, num_experts, slot_order)
    return plan.rows, plan.block_expert, plan.used, plan.slots


@_moe_route_plan_op.register_fake
def _(experts, num_experts, slot_order):
    block_m = moe.block_m_for(experts.numel(), num_experts, slot_order)
    capacity = moe.plan_capacity(experts.numel(), num_experts, block_m)
    return (experts.new_empty((capacity,), dtype=torch.int32), experts.new_empty((capacity // block_m,), dtype=torch.int32),
            experts.new_empty((1,), dtype=torch.int32), experts.new_empty((experts.numel(),), dtype=torch.int32))


@torch.library.custom_op("quantkit::moe_gather_slots", mutates_args=())
def _moe_gather_slots_op(a: torch.Tensor, a_scale: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor,
                         used: torch.Tensor, block_m: int, row_div: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    return moe.gather_slots(a, a_scale, moe.RoutePlan(rows, block_expert, used, block_m), row_div, num_experts)


@_moe_gather_slots_op.register_fake
def _(a, a_scale, rows, block_expert, used, block_m, row_div, num_experts):
    capacity = rows.shape[0]
    return a.new_empty((capacity, a.shape[1])), a_scale.new_empty((capacity,), dtype=torch.float32)


@torch.library.custom_op("quantkit::grouped_slot_mm", mutates_args=())
def _grouped_slot_mm_op(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                        rows: torch.Tensor, block_expert: torch.Tensor, used: torch.Tensor, block_m: int,
                        activation: str, gated: bool, out_dtype: torch.dtype) -> torch.Tensor:
    return moe.grouped_slot_mm(a, w, a_scale, w_scale, moe.RoutePlan(rows, block_expert, used, block_m), activation,
                               gated, out_dtype)


@_grouped_slot_mm_op.register_fake
def _(a, w, a_scale, w_scale, rows, block_expert, used, block_m, activation, gated, out_dtype):
    return a.new_empty((a.shape[0], w.shape[1] // 2 if gated else w.shape[1]), dtype=out_dtype)


@torch.library.custom_op("quantkit::moe_combine", mutates_args=())
def _moe_combine_op(y: torch.Tensor, slots: torch.Tensor, tokens: int, k: int, weights: torch.Tensor | None
                    ) -> torch.Tensor:
    return moe.combine(y, slots, tokens, k, weights)


@_moe_combine_op.register_fake
def _(y, slots, tokens, k, weights):
    check_combine_weights(weights, tokens, k)
    return y.new_empty((tokens, y.shape[1]))


# ---------------------------------------------------------------------------------------------- quantization


@torch.library.custom_op("quantkit::quantize_per_token", mutates_args=())
def _quantize_per_token_op(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return quant.quantize_per_token(x, dtype)


@_quantize_per_token_op.register_fake
def _(x, dtype):
    quant.check_activation_input(x)
    quant.check_quant_dtype(dtype)
    M, K = x.shape
    return x.new_empty((M, K), dtype=dtype), x.new_empty((M,), dtype=torch.float32)


@torch.library.custom_op("quantkit::quantize_per_tensor", mutates_args=())
def _quantize_per_tensor_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return quant.quantize_per_tensor(x, scale, dtype)


@_quantize_per_tensor_op.register_fake
def _(x, scale, dtype):
    quant.check_activation_input(x)
    quant.check_quant_dtype(dtype)
    quant.check_per_tensor_scale(scale, x)
    return x.new_empty(x.shape, dtype=dtype)


# Two ops rather than one with an optional output: custom ops cannot return Optional tensors.
@torch.library.custom_op("quantkit::rms_norm_quant_per_token", mutates_args=())
def _rms_norm_quant_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale, _ = quant.rms_norm_quant_per_token(x, weight, eps, dtype, None, offset)
    return q, scale


@_rms_norm_quant_op.register_fake
def _(x, weight, eps, dtype, offset):
    quant.check_rms_norm_args(x, weight, None, eps=eps, offset=offset)
    quant.check_quant_dtype(dtype)
    M, K = x.shape
    return x.new_empty((M, K), dtype=dtype), x.new_empty((M,), dtype=torch.float32)


@torch.library.custom_op("quantkit::add_rms_norm_quant_per_token", mutates_args=())
def _add_rms_norm_quant_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, scale, new_residual = quant.rms_norm_quant_per_token(x, weight, eps, dtype, residual, offset)
    return q, scale, new_residual


@_add_rms_norm_quant_op.register_fake
def _(x, residual, weight, eps, dtype, offset):
    quant.check_rms_norm_args(x, weight, residual, eps=eps, offset=offset)
    quant.check_quant_dtype(dtype)
    M, K = x.shape
    return (
        x.new_empty((M, K), dtype=dtype),
        x.new_empty((M,), dtype=torch.float32),
        x.new_empty((M, K), dtype=x.dtype),
    )


# ---------------------------------------------------------------------------------------------- entry points
# Same signatures as reference.py's twins; ops.py dispatches here for backend="triton".

# Benchmarks set this to False to measure the registered-op path eagerly too.
DIRECT_EAGER_LAUNCH = True


def direct_launch(x: torch.Tensor, name: str = "x") -> bool:
    """True when a call may bypass the registered op: eager, on a plain tensor (see module docs).
    Raises TypeError for a non-tensor, which the op's dispatcher would refuse less clearly."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return DIRECT_EAGER_LAUNCH and type(x) is torch.Tensor and not torch.compiler.is_compiling()


def scaled_mm(a, w, a_scale, w_scale, bias=None, activation="none", out_dtype=torch.bfloat16):
    if direct_launch(a, "a"):
        return gemm.scaled_mm(a, w, a_scale, w_scale, bias, activation, out_dtype)
    return _scaled_mm_op(a, w, a_scale, w_scale, bias, activation, out_dtype)


def gated_scaled_mm(a, w_gate_up, a_scale, w_scale, activation="silu", out_dtype=torch.bfloat16):
    if direct_launch(a, "a"):
        return gemm.gated_scaled_mm(a, w_gate_up, a_scale, w_scale, activation, out_dtype)
    return _gated_scaled_mm_op(a, w_gate_up, a_scale, w_scale, activation, out_dtype)


def grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div=1, activation="none", gated=False,
                      out_dtype=torch.bfloat16, row_scale=None, plan=None):
    if direct_launch(a, "a"):
        return moe.grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div, activation, gated, out_dtype,
                                     row_scale, plan)
    rows, blocks, used, block_m = plan[:4] if plan is not None else (None, None, None, 0)
    return _grouped_scaled_mm_op(a, w, a_scale, w_scale, experts, row_div, activation, gated, out_dtype, row_scale,
                                 rows, blocks, used, block_m)


def moe_route_plan(experts, num_experts, slot_order=False):
    if direct_launch(experts, "experts"):
        return moe.plan_for(experts, num_experts, slot_order)
    rows, blocks, used, slots = _moe_route_plan_op(experts, num_experts, slot_order)
    return moe.RoutePlan(rows, blocks, used, moe.block_m_for(experts.numel(), num_experts, slot_order), slots)


def moe_gather_slots(a, a_scale, plan, row_div, num_experts):
    if direct_launch(a, "a"):
        return moe.gather_slots(a, a_scale, plan, row_div, num_experts)
    return _moe_gather_slots_op(a, a_scale, plan.rows, plan.block_expert, plan.used, plan.block_m, row_div,
                                num_experts)


def grouped_slot_mm(a, w, a_scale, w_scale, plan, activation="none", gated=False, out_dtype=torch.bfloat16):
    if direct_launch(a, "a"):
        return moe.grouped_slot_mm(a, w, a_scale, w_scale, plan, activation, gated, out_dtype)
    return _grouped_slot_mm_op(a, w, a_scale, w_scale, plan.rows, plan.block_expert, plan.used, plan.block_m,
                               activation, gated, out_dtype)


def moe_combine(y, slots, tokens, k, weights=None):
    if direct_launch(y, "y"):
        return moe.combine(y, slots, tokens, k, weights)
    return _moe_combine_op(y, slots, tokens, k, weights)


def quantize_per_token(x, dtype):
    if direct_launch(x):
        return quant.quantize_per_token(x, dtype)
    return _quantize_per_token_op(x, dtype)


def quantize_per_tensor(x, scale, dtype):
    if direct_launch(x):
        return quant.quantize_per_tensor(x, scale, dtype)
    return _quantize_per_tensor_op(x, scale, dtype)


def rms_norm_quant_per_token(x, weight, eps, dtype, residual=None, offset=0.0):
    if direct_launch(x):
        return quant.rms_norm_quant_per_token(x, weight, eps, dtype, residual, offset)
    quant.check_eps(eps)  # before float() would take "1e-6" or True
    quant.check_offset(offset)
    if residual is None:
        q, scale = _rms_norm_quant_op(x, weight, float(eps), dtype, float(offset))
        return q, scale, None
    return _add_rms_norm_quant_op(x, residual, weight, float(eps), dtype, float(offset))
