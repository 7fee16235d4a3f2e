"""Grouped W8A8 GEMM of a mixture of experts: every expert's GEMM in one launch, routed on the GPU.

One launch multiplies each (token, slot) pair by the weight of the expert it was routed to, with
the scaled GEMM's fused epilogue (dequantization, activation, or the gated ``act(gate) * up``).
The routing is planned on the device (``route_plan``): the pairs are sorted by expert, and each
expert's run is padded to a multiple of BLOCK_M, so that a block of rows never straddles two
experts. The grid covers the most blocks any routing can need (one partial block per expert on
top of the pairs), and blocks past the routing's end return at once: nothing waits on the host,
so a step that runs it is capturable in a CUDA graph, and there is one launch per GEMM instead of
one per expert. Rows are gathered from the activation (row ``pair // row_div``: the first GEMM
reads each token once for its k slots) and the output is written in pair order, so the combine
needs no unsort.

``reference.grouped_scaled_mm`` is the torch twin and the test oracle.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from quantkit.kernels.gemm_checks import ACTIVATION_CODES, check_grouped_args
from quantkit.kernels.gemm_epilogue import apply_activation, dot_accumulate
from quantkit.kernels.launch import INTERPRETED, cdiv, check_runnable
from quantkit.kernels.quant import cast_for_store


class RoutePlan(NamedTuple):
    rows: torch.Tensor  # (capacity,) int32: the pair each padded slot computes, -1 for padding
    block_expert: torch.Tensor  # (capacity / block_m,) int32: each block's expert
    used: torch.Tensor  # (1,) int32: the slots the routing fills (blocks past it return)
    block_m: int


def block_m_for(pairs: int, experts: int) -> int:
    """Rows per block: about the pairs an expert gets on average (a decode step routes a handful
    of tokens to each of its experts, a prefill hundreds), 16 to 64."""
    average = pairs / max(experts, 1)
    return 16 if average <= 16 else 32 if average <= 32 else 64


def route_plan(experts: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    """The padded, expert-sorted slot layout of ``experts`` (P,) (values >= num_experts: no
    expert, as expert parallelism's sentinel), in device ops of fixed shapes (no host sync)."""
    pairs = experts.numel()
    device = experts.device
    expert = experts.reshape(-1).long().clamp(0, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, expert, torch.ones_like(expert))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(expert, stable=True)
    sorted_expert = expert[order]
    first = counts.cumsum(0) - counts  # each expert's first position in the sorted order
    rank = torch.arange(pairs, device=device) - first[sorted_expert]
    capacity = cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    routed = sorted_expert < num_experts
    slot = torch.where(routed, (ends - padded)[sorted_expert.clamp_max(num_experts - 1)] + rank, capacity)
    rows = torch.full((capacity + 1,), -1, dtype=torch.int32, device=device)
    rows.scatter_(0, slot, order.int())  # unrouted pairs all land in the spare last slot
    starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_max(num_experts - 1).int()
    return RoutePlan(rows[:capacity], block_expert, ends[-1:].int(), block_m)


@triton.jit
def _grouped_kernel(
    a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, rows_ptr, block_expert_ptr, used_ptr,
    N, K, ROW_DIV,
    stride_am, stride_we, stride_wn, stride_se, stride_om,
    IS_INT8: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    out_rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = out_rows >= 0
    # Padding rows read row 0 (unmasked, vectorized loads) and are not stored.
    a_rows = tl.where(valid, out_rows // ROW_DIV, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_w = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + rows_w.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    if GATED:
        w_up_ptrs = w_ptrs + N * stride_wn
    if IS_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc
    for k_start in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - k_start
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = dot_accumulate(a, w, acc, IS_INT8, True, 0)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_up_ptrs)
            else:
                w_up = tl.load(w_up_ptrs, mask=k_mask[:, None], other=0.0)
            acc_up = dot_accumulate(a, w_up, acc_up, IS_INT8, True, 0)
            w_up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # The epilogue in the reference's order: dequantize, activate; gated, times the up half.
    if A_PER_TOKEN:
        a_scale = tl.load(a_scale_ptr + a_rows)[:, None]
    else:
        a_scale = tl.load(a_scale_ptr)
    scales = w_scale_ptr + expert * stride_se
    out = apply_activation(acc.to(tl.float32) * a_scale * tl.load(scales + rows_w)[None, :], ACTIVATION)
    if GATED:
        out = out * (acc_up.to(tl.float32) * a_scale * tl.load(scales + N + rows_w)[None, :])
    out_ptrs = out_ptr + tl.where(valid, out_rows, 0).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = valid[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptrs, cast_for_store(out, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


def default_config(pairs: int, experts: int, K: int, gated: bool = False) -> dict:
    """Tile sizes and launch shape for ``pairs`` routed over ``experts`` (K: the reduction). From
    the sweep in benchmarks/moe_kernels.py (H200, Qwen3-30B-A3B's shapes): 16-row blocks while an
    expert gets a few dozen pairs, 64-row blocks of 128 columns above, the gated form with 8 warps
    and 4 stages."""
    block_m = block_m_for(pairs, experts)
    if INTERPRETED:  # large blocks under the interpreter: each program is Python
        return dict(block_m=block_m, block_n=64, block_k=64, num_warps=4, num_stages=1)
    large = block_m == 64
    return dict(block_m=block_m, block_n=128, block_k=128 if K >= 128 else 64,
                num_warps=8 if large and gated else 4, num_stages=4 if large and gated else 3)


# The plan of the last routing seen: an MoE layer's two GEMMs route the same pairs (one tensor),
# so the second reuses the first's plan. Held by a weak reference and the tensor's version
# counter: another tensor, or the same one written since, plans again.
_LAST_PLAN: list = [None]


def _plan(experts: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    last = _LAST_PLAN[0]
    key = (experts._version, num_experts, block_m, experts.device)
    if last is not None and last[0]() is experts and last[1] == key:
        return last[2]
    plan = route_plan(experts, num_experts, block_m)
    _LAST_PLAN[0] = (weakref.ref(experts), key, plan)
    return plan


def grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div=1, activation="none", gated=False,
                      out_dtype=torch.bfloat16, config: dict | None = None):
    """(P, N) rows in pair order: ``act(a[p // row_div] @ w[experts[p]].T * scales)`` (gated: the
    [gate; up] halves of w's rows, ``act(gate) * up``); 0 for a pair of no expert. See
    ``reference.grouped_scaled_mm`` for the shapes. ``config``: ``default_config``'s keys, to
    override (benchmarks)."""
    pairs, n_out, K = check_grouped_args(a, w, a_scale, w_scale, experts, row_div, activation, out_dtype, gated)
    check_runnable(a, "a")
    num_experts = w.shape[0]
    out = torch.zeros(pairs, n_out, dtype=out_dtype, device=a.device)
    if pairs == 0:
        return out
    config = {**default_config(pairs, num_experts, K, gated), **(config or {})}
    plan = _plan(experts, num_experts, config["block_m"])
    block_n, block_k = config["block_n"], config["block_k"]
    grid = (plan.rows.numel() // plan.block_m, cdiv(n_out, block_n))
    _grouped_kernel[grid](
        a, w, out, a_scale, w_scale, plan.rows, plan.block_expert, plan.used,
        n_out, K, row_div,
        a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), out.stride(0),
        IS_INT8=a.dtype == torch.int8, A_PER_TOKEN=a_scale.numel() > 1, ACTIVATION=ACTIVATION_CODES[activation],
        GATED=gated, EVEN_K=K % block_k == 0, INTERPRETED=INTERPRETED,
        BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out
