"""@triton.jit pieces shared by the tiled (gemm.py) and persistent TMA (gemm_tma.py) GEMM kernels
and the GEMV (gemv.py): the tensor-core dot with its FP8 accumulation mode, the grouped tile
order, the fused dequant + bias + activation epilogue on the fp32 accumulator (and its masked
store, gated form included), and the combine of K-split partial tiles through a workspace
(``split_arrive`` / ``split_sum``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from quantkit.kernels.quant import cast_for_store


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    """fp32 activation; codes follow reference.ACTIVATIONS (none, relu, silu, gelu, gelu_tanh)."""
    if ACTIVATION == 1:
        x = tl.where(x < 0.0, 0.0, x)  # relu(NaN) = NaN, as in torch (tl.maximum drops NaN)
    elif ACTIVATION == 2:
        x = x * tl.sigmoid(x)
    elif ACTIVATION == 3:
        x = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACTIVATION == 4:
        # tanh(y) = 2 * sigmoid(2y) - 1: no libdevice tanh (absent under the interpreter), and
        # sigmoid saturates cleanly to 0/1 for large |y| instead of producing inf/inf.
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = 0.5 * x * (2.0 * tl.sigmoid(2.0 * inner))
    return x


@triton.jit
def dot_accumulate(a, b, acc, IS_INT8: tl.constexpr, FP8_FAST_ACCUM: tl.constexpr, FP8_PROMOTE_K: tl.constexpr):
    """acc += a @ b on tensor cores: exact int32 for INT8, fp32 for FP8.

    FP8 on Hopper: wgmma accumulates FP8 products with reduced precision (about 22 mantissa bits)
    inside one chain of instructions. FP8_FAST_ACCUM keeps Triton's default (no promotion, the
    mode of cuBLAS's use_fast_accum=True and of vLLM's CUTLASS FP8 kernels); otherwise the
    partial sum is promoted into a full fp32 accumulator every FP8_PROMOTE_K products, as cuBLAS
    does without fast accumulation, at the price of a second accumulator tile in registers.
    Measured on an H100 (K=14336, bf16 output): 2.7e-3 relative error fast vs 1.7e-3 promoted,
    both far below FP8 W8A8's own quantization error (~3e-2).
    """
    if IS_INT8:
        return tl.dot(a, b, acc, out_dtype=tl.int32)
    elif FP8_FAST_ACCUM:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, max_num_imprecise_acc=FP8_PROMOTE_K)


@triton.jit
def tile_mainloop(a_ptrs, w_ptrs, up_offset, offs_k, K, k_begin, k_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, IS_INT8: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                  FP8_FAST_ACCUM: tl.constexpr, FP8_PROMOTE_K: tl.constexpr, UP_IN_A: tl.constexpr):
    """The K loop of one (BLOCK_M, BLOCK_N) product tile over [k_begin, k_end): ``a_ptrs`` a
    (BLOCK_M, BLOCK_K) K-contiguous tile of the first operand's rows, ``w_ptrs`` a (BLOCK_K, BLOCK_N)
    K-contiguous tile of the second's. Usually the first is the activation and the second the
    (N, K) weight; swapped (``UP_IN_A``, the tiled kernel's SWAP_AB) the weight comes first. The
    gated form also accumulates the up half, ``up_offset`` elements further in the weight's
    operand. Returns (acc, acc_up); acc_up is an unused stand-in (compiled away) unless GATED."""
    if IS_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc
    up_ptrs = (a_ptrs if UP_IN_A else w_ptrs) + up_offset
    for k_start in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - k_start
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = dot_accumulate(a, w, acc, IS_INT8, FP8_FAST_ACCUM, FP8_PROMOTE_K)
        if GATED:
            # The up tile stands in for the weight's operand: same shape, same K mask.
            if EVEN_K:
                up = tl.load(up_ptrs)
            elif UP_IN_A:
                up = tl.load(up_ptrs, mask=k_mask[None, :], other=0.0)
            else:
                up = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
            if UP_IN_A:
                acc_up = dot_accumulate(up, w, acc_up, IS_INT8, FP8_FAST_ACCUM, FP8_PROMOTE_K)
            else:
                acc_up = dot_accumulate(a, up, acc_up, IS_INT8, FP8_FAST_ACCUM, FP8_PROMOTE_K)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a tile in grouped order: GROUP_M row-tiles walk the N tiles together, so
    the weight tiles they share are still in L2 when the next row-tile needs them."""
    pids_per_group = GROUP_M * num_pid_n
    group_id = tile_id // pids_per_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % pids_per_group) % group_size_m)
    pid_n = (tile_id % pids_per_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def dequant_epilogue(
    acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, bias_ptr,
    A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
):
    """fp32 ``act(acc * a_scale[:, None] * w_scale[None, :] + bias)``, in the reference's order."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    if A_PER_TOKEN:
        a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    else:
        a_scale = tl.load(a_scale_ptr)
    if W_PER_CHANNEL:
        w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    else:
        w_scale = tl.load(w_scale_ptr)
    out = acc.to(tl.float32) * a_scale * w_scale
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return apply_activation(out, ACTIVATION)


@triton.jit
def store_tile(acc, acc_up, offs_m, offs_n, M, N, out_ptr, stride_om, a_scale_ptr, w_scale_ptr, bias_ptr,
               A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
               ACTIVATION: tl.constexpr, GATED: tl.constexpr, RAW_ACC: tl.constexpr, INTERPRETED: tl.constexpr):
    """The fused epilogue of one output tile and its masked store (``acc_up``: gated form only, the
    up half's accumulator; its column scales are ``w_scale[N + n]``). Shared by the tiled GEMM and
    the GEMV."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if RAW_ACC:
        # Test hook: the int32 accumulator itself, to compare exactly with an integer matmul.
        tl.store(out_ptrs, acc, mask=out_mask)
    else:
        out = dequant_epilogue(acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, bias_ptr,
                               A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS, ACTIVATION)
        if GATED:
            if A_PER_TOKEN:
                a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
            else:
                a_scale = tl.load(a_scale_ptr)
            if W_PER_CHANNEL:
                w_scale_up = tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
            else:
                w_scale_up = tl.load(w_scale_ptr)
            out = out * (acc_up.to(tl.float32) * a_scale * w_scale_up)
        tl.store(out_ptrs, cast_for_store(out, out_ptr.dtype.element_ty, INTERPRETED), mask=out_mask)


# ----------------------------------------------------------------------------------------------
# K-split combine, shared by the tiled kernel's SPLIT_K and the persistent kernel's split tail:
# every K-slice of an output tile stores its int32 / fp32 partial tile in its own workspace slot
# and counts itself in the tile's arrival counter; the slice that arrives last sums the slots in
# slice order 0..SPLITS-1 (the same order whichever slice finished last: deterministic, and exact
# for INT8), runs the epilogue and resets the counter to 0 for the next launch. No program waits
# on another, so nothing depends on all slices being resident at once; a launch is CUDA-graph
# capturable once the workspace exists (nothing is allocated or zeroed per launch).
# ----------------------------------------------------------------------------------------------


@triton.jit
def split_arrive(counter_ptr, SPLITS: tl.constexpr):
    """Count this slice in its tile's arrival counter, after its partial tile was stored; True in
    the slice that arrives last (which then owns the combine)."""
    # Release: the CTA barrier orders every thread's partial-tile stores before the one atomic
    # (acq_rel, gpu scope); its acquire side orders the last arriver's loads of the other slots
    # after it.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == SPLITS - 1


@triton.jit
def split_sum(slots_ptr, offsets, mask, SLOT_ELEMS: tl.constexpr, SPLITS: tl.constexpr):
    """Sum of the partial tiles at ``slots_ptr + s * SLOT_ELEMS + offsets``, s = 0..SPLITS-1 in
    order (``mask``: the elements the slices stored; None for all)."""
    # .cg: from L2 (the point of coherence), never a stale L1 line.
    total = tl.load(slots_ptr + offsets, mask=mask, cache_modifier=".cg")
    for s in tl.static_range(1, SPLITS):
        total += tl.load(slots_ptr + s * SLOT_ELEMS + offsets, mask=mask, cache_modifier=".cg")
    return total
