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

At prefill sizes the weight tiles come by TMA (``_grouped_tma_kernel``: the stacked weight
described as one (E * rows, K) matrix; ``default_config`` says when); the gathered activation
rows are loaded by address in both kernels (Hopper's TMA has no row gather). At 128-row blocks a
layer instead keeps its rows in the plan's slot order between its two GEMMs (``gather_slots``,
``grouped_slot_mm``, ``combine``: the "slot order" section below).

``reference.grouped_scaled_mm`` is the torch twin and the test oracle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from quantkit.kernels.call_cache import SignatureCache
from quantkit.kernels.gemm_checks import ACTIVATION_CODES, check_combine_weights, check_grouped_args, tma_ready
from quantkit.kernels.gemm_epilogue import apply_activation, dot_accumulate, tile_mainloop
from quantkit.kernels.launch import (INTERPRETED, CachedLaunch, aligned, cdiv, check_runnable, int_spec,
                                     next_power_of_2, num_sms, on_its_gpu)
from quantkit.kernels.quant import cast_for_store


class RoutePlan(NamedTuple):
    rows: torch.Tensor  # (capacity,) int32: the pair each padded slot computes, -1 for padding
    # (capacity / block_m,) int32: each block's expert; num_experts for the run of the pairs that
    # no expert takes (their rows are written as zeros).
    block_expert: torch.Tensor
    used: torch.Tensor  # (1,) int32: the slots the routing fills (blocks past it return)
    block_m: int
    slots: torch.Tensor | None = None  # (P,) int32: each pair's slot (rows' inverse; the slot-order path's)


def block_m_for(pairs: int, experts: int, slot_order: bool = False) -> int:
    """Rows per block: about the pairs an expert gets on average (a decode step routes a handful
    of tokens to each of its experts, a prefill hundreds), 16 to 128. 128-row blocks from 192 pairs
    an expert (the Triton kernels, runs s33c/d: the pair-order 128-row kernels read 0.82-1.05x the
    64-row ones at 128 pairs), from 96 for a layer that runs them in slot order on the Gluon kernel
    (``slot_order``, where ``gemm_gluon.available()``; run s35g, H200: the layer 1.08-1.11x the
    64-row path at 96 pairs, 0.94-0.96x at 64)."""
    average = pairs / max(experts, 1)
    rows128 = 192
    if slot_order and average >= 96:
        from quantkit.kernels import gemm_gluon

        rows128 = 96 if gemm_gluon.available() else 192
    return 16 if average <= 16 else 32 if average < 32 else 64 if average < rows128 else 128


def plan_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Slots a plan holds: every pair, and a partial block for each expert's run and the unrouted run."""
    return cdiv(pairs + (num_experts + 1) * (block_m - 1), block_m) * block_m


def route_plan(experts: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    """The padded, expert-grouped slot layout of ``experts`` (P,) (values >= num_experts: no
    expert, as expert parallelism's sentinel), in four launches of fixed shapes (no host sync).

    Each pair takes the next free place in its expert's run (an atomic counter), so the order of
    the pairs within a run varies from call to call; no result does: a pair's output row depends
    on its own input row and its expert's weight only."""
    pairs = experts.numel()
    device = experts.device
    experts = experts.reshape(-1)
    runs = num_experts + 1  # the experts', and one of the pairs routed to none
    capacity = plan_capacity(pairs, num_experts, block_m)
    counts = torch.zeros(runs, dtype=torch.int32, device=device)
    rank = torch.empty(pairs, dtype=torch.int32, device=device)
    rows = torch.full((capacity,), -1, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    used = torch.empty(1, dtype=torch.int32, device=device)
    slots = torch.empty(pairs, dtype=torch.int32, device=device)
    ends = torch.empty(runs, dtype=torch.int32, device=device)
    chunk = 1024
    ints = (pairs, num_experts)
    _RANK(("rank", experts.dtype, _spec(ints), aligned(experts, counts, rank)), (cdiv(pairs, chunk),),
          (experts, counts, rank, *ints), dict(BLOCK=chunk), 4, 3)
    experts_block = next_power_of_2(runs)
    ints = (pairs, num_experts, capacity // block_m)
    constexprs = dict(BLOCK_M=block_m, BLOCK=chunk, EXPERTS=experts_block, SEARCH_STEPS=experts_block.bit_length())
    pointers = (experts, counts, rank, ends, rows, block_expert, used, slots)
    _PLACE(("place", experts.dtype, _spec(ints), *constexprs.values(), aligned(*pointers)),
           (cdiv(max(pairs, capacity // block_m), chunk),), (*pointers, *ints), constexprs, 4, 3)
    return RoutePlan(rows, block_expert, used, block_m, slots)


def _spec(ints: tuple) -> tuple:
    """The key part of a launch's integer arguments: what triton specializes each on."""
    return tuple(int_spec(i) for i in ints)


# The pair count and the block count change with every batch: not specialized (one binary).
@triton.jit(do_not_specialize=["pairs"])
def _rank_kernel(experts_ptr, counts_ptr, rank_ptr, pairs, num_experts, BLOCK: tl.constexpr):
    """Each pair's place in its run (its expert's, or the last for no expert): the run's counter
    before the pair took it."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < pairs
    run = _run_of(tl.load(experts_ptr + offs, mask=mask, other=0), num_experts)
    rank = tl.atomic_add(counts_ptr + run, 1, mask=mask)
    tl.store(rank_ptr + offs, rank, mask=mask)


@triton.jit
def _run_of(expert, num_experts):
    expert = expert.to(tl.int32)
    return tl.where((expert >= 0) & (expert < num_experts), expert, num_experts)


@triton.jit(do_not_specialize=["pairs", "num_blocks"])
def _place_kernel(experts_ptr, counts_ptr, rank_ptr, ends_ptr, rows_ptr, block_expert_ptr, used_ptr, slots_ptr,
                  pairs, num_experts, num_blocks, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                  EXPERTS: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """From the counts: each expert's run end (runs padded to BLOCK_M), each pair's slot, each
    block's expert and the slots used. Every program takes its chunk of pairs and of blocks."""
    runs = num_experts + 1
    e = tl.arange(0, EXPERTS)
    counts = tl.load(counts_ptr + e, mask=e < runs, other=0)
    ends = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    # Every program stores the same ends, then reads them back by index (its own stores are
    # visible to its threads after the barrier).
    tl.store(ends_ptr + e, ends, mask=e < runs)
    tl.debug_barrier()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < pairs
    run = _run_of(tl.load(experts_ptr + offs, mask=mask, other=0), num_experts)
    count = tl.load(counts_ptr + run, mask=mask, other=0)
    start = tl.load(ends_ptr + run, mask=mask, other=0) - (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    rank = tl.load(rank_ptr + offs, mask=mask, other=0)
    tl.store(rows_ptr + start + rank, offs, mask=mask)
    tl.store(slots_ptr + offs, start + rank, mask=mask)
    # This program's chunk of blocks: each block's expert is the number of runs that end at or
    # before its first slot (a binary search over the ends).
    block_start = offs * BLOCK_M
    lo = tl.zeros((BLOCK,), dtype=tl.int32)
    hi = tl.zeros((BLOCK,), dtype=tl.int32) + runs
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        end = tl.load(ends_ptr + mid, mask=active, other=0)
        lo = tl.where(active & (end <= block_start), mid + 1, lo)
        hi = tl.where(active & (end > block_start), mid, hi)
    tl.store(block_expert_ptr + offs, tl.minimum(lo, num_experts), mask=offs < num_blocks)
    if tl.program_id(0) == 0:
        tl.store(used_ptr, tl.max(ends, 0))


@triton.jit
def _dequant_rows(acc, acc_up, expert, out_rows, offs_n, N, ROW_DIV, a_scale_ptr, w_scale_ptr, row_scale_ptr,
                  stride_se, A_PER_TOKEN: tl.constexpr, ROW_SCALE: tl.constexpr, ACTIVATION: tl.constexpr,
                  GATED: tl.constexpr):
    """The grouped kernels' epilogue in fp32, in the reference's order: dequantize, activate;
    gated, times the dequantized up half; times each pair's routing weight (ROW_SCALE). Padding
    rows (``out_rows`` -1) read row 0's scales and are not stored."""
    valid = out_rows >= 0
    a_rows = tl.where(valid, out_rows // ROW_DIV, 0)
    rows_w = offs_n % N
    if A_PER_TOKEN:
        a_scale = tl.load(a_scale_ptr + a_rows)[:, None]
    else:
        a_scale = tl.load(a_scale_ptr)
    scales = w_scale_ptr + expert.to(tl.int64) * stride_se
    out = apply_activation(acc.to(tl.float32) * a_scale * tl.load(scales + rows_w)[None, :], ACTIVATION)
    if GATED:
        out = out * (acc_up.to(tl.float32) * a_scale * tl.load(scales + N + rows_w)[None, :])
    if ROW_SCALE:
        out = out * tl.load(row_scale_ptr + tl.where(valid, out_rows, 0))[:, None]
    return out


@triton.jit
def _block_rows(rows_ptr, out_ptr, pid_m, offs_n, N, stride_om, BLOCK_M: tl.constexpr):
    """Block ``pid_m``'s output rows (the pair of each slot, -1 for padding), the addresses of its
    tile in the output (padding rows point at row 0) and the store mask (no padding row, no column
    past N)."""
    out_rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = out_rows >= 0
    out_ptrs = out_ptr + tl.where(valid, out_rows, 0).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    return out_rows, out_ptrs, valid[:, None] & (offs_n < N)[None, :]


@triton.jit
def _tma_tile(a_ptr, out_rows, a_row, w_desc, w_row, N, K, ROW_DIV, stride_am, IS_INT8: tl.constexpr,
              GATED: tl.constexpr, EVEN_K: tl.constexpr, SLOT_ORDER: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K loop of the TMA kernels' tile: the gathered activation rows of ``out_rows``' pairs
    (padding rows read row 0) loaded by address, the weight's rows from ``w_row`` (and the up half
    N rows below, gated) by TMA, which zero-fills the K tail. SLOT_ORDER: ``a_ptr`` is a descriptor
    of the activation rows in slot order (``gather_slots``), the tile's rows from ``a_row``, also
    by TMA. Returns (acc, acc_up)."""
    offs_k = tl.arange(0, BLOCK_K)
    if not SLOT_ORDER:
        a_rows = tl.where(out_rows >= 0, out_rows // ROW_DIV, 0)
        a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    if IS_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc
    for ki in range(tl.cdiv(K, BLOCK_K)):
        if SLOT_ORDER:
            a = a_ptr.load([a_row, ki * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs + ki * BLOCK_K)
        else:
            a = tl.load(a_ptrs + ki * BLOCK_K, mask=(offs_k < K - ki * BLOCK_K)[None, :], other=0.0)
        acc = dot_accumulate(a, w_desc.load([w_row, ki * BLOCK_K]).T, acc, IS_INT8, True, 0)
        if GATED:
            acc_up = dot_accumulate(a, w_desc.load([w_row + N, ki * BLOCK_K]).T, acc_up, IS_INT8, True, 0)
    return acc, acc_up


@triton.jit
def _grouped_kernel(
    a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, row_scale_ptr, rows_ptr, block_expert_ptr, used_ptr,
    N, K, ROW_DIV, num_experts,
    stride_am, stride_we, stride_wn, stride_se, stride_om,
    IS_INT8: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    ROW_SCALE: tl.constexpr,
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
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_rows, out_ptrs, mask = _block_rows(rows_ptr, out_ptr, pid_m, offs_n, N, stride_om, BLOCK_M)
    if expert == num_experts:  # the pairs routed to no expert: rows of zeros
        tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=mask)
        return
    # Padding rows read row 0 (unmasked, vectorized loads) and are not stored.
    a_rows = tl.where(out_rows >= 0, out_rows // ROW_DIV, 0)
    rows_w = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + rows_w.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc, acc_up = tile_mainloop(a_ptrs, w_ptrs, N * stride_wn, offs_k, K, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                IS_INT8, GATED, EVEN_K, True, 0, False)
    out = _dequant_rows(acc, acc_up, expert, out_rows, offs_n, N, ROW_DIV, a_scale_ptr, w_scale_ptr, row_scale_ptr,
                        stride_se, A_PER_TOKEN, ROW_SCALE, ACTIVATION, GATED)
    tl.store(out_ptrs, cast_for_store(out, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _grouped_tma_kernel(
    a_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, row_scale_ptr, rows_ptr, block_expert_ptr, used_ptr,
    N, K, ROW_DIV, num_experts, rows_per_expert, num_blocks_m,
    stride_am, stride_se, stride_om,
    IS_INT8: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    N_FASTEST: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``_grouped_kernel`` with the weight tiles moved by TMA: ``w_desc`` describes the stacked
    weight as one (E * rows_per_expert, K) matrix, and a tile of expert e starts at row
    e * rows_per_expert. A tile reaching past an expert's N rows reads the next rows (the up half,
    or the next expert) or zeros past the end; those columns are never stored. The K tail is
    zero-filled by the copy engine. The gathered activation rows are still loaded by address."""
    if N_FASTEST:  # a block's row tile stays, the weight's column tiles walk
        pid_n = tl.program_id(0) % tl.cdiv(N, BLOCK_N)
        pid_m = tl.program_id(0) // tl.cdiv(N, BLOCK_N)
    else:
        pid_m = tl.program_id(0) % num_blocks_m
        pid_n = tl.program_id(0) // num_blocks_m
    if pid_m * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_rows, out_ptrs, mask = _block_rows(rows_ptr, out_ptr, pid_m, offs_n, N, stride_om, BLOCK_M)
    if expert == num_experts:  # the pairs routed to no expert: rows of zeros
        tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=mask)
        return
    acc, acc_up = _tma_tile(a_ptr, out_rows, pid_m * BLOCK_M, w_desc, expert * rows_per_expert + pid_n * BLOCK_N,
                            N, K, ROW_DIV, stride_am, IS_INT8, GATED, EVEN_K, False, BLOCK_M, BLOCK_N, BLOCK_K)
    out = _dequant_rows(acc, acc_up, expert, out_rows, offs_n, N, ROW_DIV, a_scale_ptr, w_scale_ptr, row_scale_ptr,
                        stride_se, A_PER_TOKEN, ROW_SCALE, ACTIVATION, GATED)
    tl.store(out_ptrs, cast_for_store(out, out_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _grouped_persistent_kernel(
    a_ptr, w_desc, out_ptr, a_scale_ptr, w_scale_ptr, row_scale_ptr, rows_ptr, block_expert_ptr, used_ptr,
    N, K, ROW_DIV, num_experts, rows_per_expert,
    stride_am, stride_se, stride_om,
    IS_INT8: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    EVEN_K: tl.constexpr,
    SLOT_ORDER: tl.constexpr,
    INTERPRETED: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``_grouped_tma_kernel`` on a persistent grid: NUM_PROGRAMS programs walk the routing's
    tiles (a block's column tiles in turn), the tile loop and the K loop flattened into one
    software pipeline, so the next tile's loads are in flight during this tile's epilogue. The
    run of the pairs of no expert is computed against TMA's zero fill past the last expert, and
    stored as zeros. SLOT_ORDER (``grouped_slot_mm``): the activation rows, their scales and the
    output rows are the plan's slots (a by TMA too), every row of a tile stored."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.load(used_ptr) // BLOCK_M * n_tiles
    # The epilogue's tile from its own counter: with the loops flattened, the pipeliner may
    # already be loading the next tile (as in gemm_tma's persistent kernel). Its output addresses
    # are computed after the dequantization: computed first (``_block_rows``), with the same
    # instructions in another order, ptxas gave the loop more registers and the kernel ran 7-17 %
    # slower (H200, run s33b; benchmarks/NOTES-moe.md).
    offs_r = tl.arange(0, BLOCK_M)
    tile_c = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m = tile // n_tiles
        expert = tl.load(block_expert_ptr + pid_m)
        if SLOT_ORDER:
            rows = pid_m * BLOCK_M + offs_r
        else:
            rows = tl.load(rows_ptr + pid_m * BLOCK_M + offs_r)
        w_row = expert * rows_per_expert + (tile % n_tiles) * BLOCK_N
        acc, acc_up = _tma_tile(a_ptr, rows, pid_m * BLOCK_M, w_desc, w_row, N, K, ROW_DIV, stride_am, IS_INT8,
                                GATED, EVEN_K, SLOT_ORDER, BLOCK_M, BLOCK_N, BLOCK_K)
        tile_c += NUM_PROGRAMS
        pid_m = tile_c // n_tiles
        expert_c = tl.load(block_expert_ptr + pid_m)
        if SLOT_ORDER:
            out_rows = pid_m * BLOCK_M + offs_r
        else:
            out_rows = tl.load(rows_ptr + pid_m * BLOCK_M + offs_r)
        valid = out_rows >= 0
        offs_n = (tile_c % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        out = _dequant_rows(acc, acc_up, tl.minimum(expert_c, num_experts - 1), out_rows, offs_n, N, ROW_DIV,
                            a_scale_ptr, w_scale_ptr, row_scale_ptr, stride_se, A_PER_TOKEN, ROW_SCALE, ACTIVATION,
                            GATED)
        out = tl.where(expert_c == num_experts, 0.0, out)
        out_ptrs = out_ptr + tl.where(valid, out_rows, 0).to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, cast_for_store(out, out_ptr.dtype.element_ty, INTERPRETED),
                 mask=valid[:, None] & (offs_n < N)[None, :])


# Eager launches skip triton's binding pass (launch.CachedLaunch): at a few tokens an MoE layer's
# plan and GEMMs are host-bound. The TMA kernel (prefill sizes) keeps triton's own launcher.
_RANK = CachedLaunch(_rank_kernel)
_PLACE = CachedLaunch(_place_kernel)
_GROUPED = CachedLaunch(_grouped_kernel)


def tma_eligible(w: torch.Tensor) -> bool:
    """The weight can go through a TMA descriptor: a 16-byte aligned base (its rows are: the checks
    take K in multiples of 16 one-byte elements)."""
    return w.data_ptr() % 16 == 0 and w.shape[-1] % 16 == 0


# The kernels' flags: a config passed to grouped_scaled_mm runs the address-loaded kernel unless
# it says otherwise (the defaults' own flags are not merged into it).
KERNEL_FLAGS = dict(tma=False, persistent=False, n_fastest=False)


def default_config(pairs: int, experts: int, K: int, gated: bool = False, out_dtype: torch.dtype = torch.bfloat16,
                   interpreted: bool = INTERPRETED) -> dict:
    """Tile sizes, launch shape and kernel for ``pairs`` routed over ``experts`` (K: the
    reduction). From the sweeps and same-run comparisons of benchmarks/moe_kernels.py and
    moe_tma_sweep.py (H200, Qwen3-30B-A3B's shapes, benchmarks/NOTES-moe.md):
    - 16- and 32-row blocks of address-loaded tiles while an expert gets a few dozen pairs, 64-row
      blocks from 32 pairs an expert, 128-row ones from 192 (runs s33c/d: at 192 pairs an expert
      the 128-row defaults were 0.98-1.15x the 64-row ones, at 256 1.04-1.22x, at 128 0.82-1.05x;
      from 96 where the Gluon kernel runs a layer's slot-order path, ``block_m_for``);
    - in 64-row blocks the plain form (the down projection) takes its weight tiles by TMA, 256
      columns wide (1.3-1.4x the address-loaded 128-wide tiles at 1024-2048 tokens); the gated form
      keeps address-loaded 2 x 128-wide tiles (TMA gained nothing measurable);
    - 128-row blocks run the persistent TMA kernel, both forms (1.1-1.5x session 31's kernels at
      8192 tokens). A 4-byte output needs a larger staging buffer in shared memory: 3 stages for
      the gated form, 128-wide tiles for the plain one (``tests/kernels/test_moe.py`` compiles each
      default for sm_90 and checks its shared memory against the 227 KB an SM gives a block).
    ``interpreted``: the interpreter's large blocks (each program is Python)."""
    block_m = block_m_for(pairs, experts)
    block_k = 128 if K >= 128 else 64
    if interpreted:
        return dict(block_m=block_m, block_n=64, block_k=64, num_warps=4, num_stages=1, tma=block_m >= 64,
                    n_fastest=True, persistent=block_m == 128)
    wide_out = out_dtype.itemsize > 2
    if block_m == 128:
        return dict(KERNEL_FLAGS, block_m=block_m, block_n=128 if gated or wide_out else 256, block_k=block_k,
                    num_warps=8, num_stages=3 if gated and wide_out else 4, tma=True, persistent=True)
    if not gated and block_m == 64:
        return dict(KERNEL_FLAGS, block_m=block_m, block_n=256, block_k=block_k, num_warps=8, num_stages=4, tma=True,
                    n_fastest=True)
    large = block_m == 64
    return dict(KERNEL_FLAGS, block_m=block_m, block_n=128, block_k=block_k, num_warps=8 if large and gated else 4,
                num_stages=4 if large and gated else 3)


def fallback_config(config: dict) -> dict:
    """The address-loaded kernel's tiles for a TMA config whose weight TMA cannot take."""
    return {**config, "tma": False, "block_n": 128, "num_warps": 8 if config["block_m"] >= 128 else 4,
            "num_stages": 3}


@on_its_gpu
def plan_for(experts: torch.Tensor, num_experts: int, slot_order: bool = False) -> RoutePlan:
    """The routing plan the grouped GEMMs' default tiles use for ``experts``: an MoE layer makes it
    once and passes it to both of its GEMMs. ``slot_order``: the layer runs 128-row plans in slot
    order where the Gluon kernel can (``block_m_for``); a pair-order GEMM given such a plan with
    fewer than 192 pairs an expert plans again for its own blocks."""
    return route_plan(experts, num_experts, block_m_for(experts.numel(), num_experts, slot_order))


@on_its_gpu
def grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div=1, activation="none", gated=False,
                      out_dtype=torch.bfloat16, row_scale=None, plan: RoutePlan | None = None,
                      config: dict | None = None):
    """(P, N) rows in pair order: ``act(a[p // row_div] @ w[experts[p]].T * scales)`` (gated: the
    [gate; up] halves of w's rows, ``act(gate) * up``), times ``row_scale[p]`` if given; 0 for a
    pair of no expert. See ``reference.grouped_scaled_mm`` for the shapes. ``plan``: the routing
    plan of ``experts`` (``plan_for``), made here if None or planned for other blocks. ``config``:
    ``default_config``'s keys (benchmarks): missing sizes come from the default, missing kernel
    flags are off (``KERNEL_FLAGS``: the address-loaded kernel)."""
    pairs, n_out, K = check_grouped_args(a, w, a_scale, w_scale, experts, row_div, activation, out_dtype, gated,
                                         row_scale=row_scale)
    check_runnable(a, "a")
    num_experts = w.shape[0]
    out = torch.empty(pairs, n_out, dtype=out_dtype, device=a.device)  # every row is written
    if pairs == 0 or n_out == 0:
        return out
    default = default_config(pairs, num_experts, K, gated, out_dtype)
    config = default if config is None else {**default, **KERNEL_FLAGS, **config}
    if config.get("tma") and not tma_eligible(w):
        config = fallback_config(config)
    if plan is None or plan.block_m != config["block_m"]:
        plan = route_plan(experts, num_experts, config["block_m"])
    block_n, block_k = config["block_n"], config["block_k"]
    common = dict(IS_INT8=a.dtype == torch.int8, A_PER_TOKEN=a_scale.numel() > 1, ROW_SCALE=row_scale is not None,
                  ACTIVATION=ACTIVATION_CODES[activation], GATED=gated, EVEN_K=K % block_k == 0,
                  INTERPRETED=INTERPRETED, BLOCK_M=plan.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  num_warps=config["num_warps"], num_stages=config["num_stages"])
    num_blocks_m = plan.rows.numel() // plan.block_m
    if config.get("tma") and config.get("persistent"):
        w_desc = TensorDescriptor.from_tensor(w.view(-1, K), [block_n, block_k])
        programs = 4 if INTERPRETED else num_sms(a.device.index) * config.get("ctas_per_sm", 1)
        tiles = num_blocks_m * cdiv(n_out, block_n)  # the most any routing needs
        _grouped_persistent_kernel[(min(programs, tiles),)](
            a, w_desc, out, a_scale, w_scale, row_scale if row_scale is not None else a_scale, plan.rows,
            plan.block_expert, plan.used, n_out, K, row_div, num_experts, w.shape[1],
            a.stride(0), w_scale.stride(0), out.stride(0), SLOT_ORDER=False, NUM_PROGRAMS=programs, **common)
        return out
    if config.get("tma"):
        w_desc = TensorDescriptor.from_tensor(w.view(-1, K), [block_n, block_k])
        _grouped_tma_kernel[(num_blocks_m * cdiv(n_out, block_n),)](
            a, w_desc, out, a_scale, w_scale, row_scale if row_scale is not None else a_scale, plan.rows,
            plan.block_expert, plan.used, n_out, K, row_div, num_experts, w.shape[1], num_blocks_m,
            a.stride(0), w_scale.stride(0), out.stride(0), N_FASTEST=bool(config.get("n_fastest")), **common)
        return out
    pointers = (a, w, out, a_scale, w_scale, row_scale if row_scale is not None else a_scale, plan.rows,
                plan.block_expert, plan.used)
    ints = (n_out, K, row_div, num_experts, a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), out.stride(0))
    num_warps, num_stages = common.pop("num_warps"), common.pop("num_stages")
    key = (tuple(t.dtype for t in pointers), aligned(*pointers), _spec(ints), *common.values(), num_warps, num_stages)
    _GROUPED(key, (num_blocks_m, cdiv(n_out, block_n)), (*pointers, *ints), common, num_warps, num_stages)
    return out


# ---------------------------------------------------------------------------------------------- slot order
# At prefill sizes (128-row blocks) a layer keeps its rows in the plan's slot order between its
# two GEMMs: ``gather_slots`` puts the quantized tokens there once, both GEMMs read and write whole
# blocks (the activation rows by TMA, as a dense GEMM does; on sm_90 the warp-specialized Gluon
# kernel), and ``combine`` sums each token's k rows from their slots. Runs s35e/f (H200,
# benchmarks/NOTES-moe.md): the Gluon grouped form 1.25-1.45x the pair-order Triton kernels.


@triton.jit
def _gather_slots_kernel(a_ptr, a_scale_ptr, rows_ptr, block_expert_ptr, used_ptr, out_ptr, scale_out_ptr, K,
                         ROW_DIV, num_experts, stride_am, A_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows BLOCK_R slots at a time: slot s of a routed pair p gets row p // ROW_DIV of a and its
    scale; a padding slot, one of the run of no expert or one from used on, zeros (the capacity is
    a multiple of BLOCK_R)."""
    slots = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.load(rows_ptr + slots)
    live = slots < tl.load(used_ptr)
    routed = (pairs >= 0) & (tl.load(block_expert_ptr + slots // BLOCK_M) < num_experts) & live
    src = tl.where(routed, pairs // ROW_DIV, 0).to(tl.int64)
    if A_PER_TOKEN:
        scale = tl.load(a_scale_ptr + src)
    else:
        scale = tl.load(a_scale_ptr) + tl.zeros((BLOCK_R,), dtype=tl.float32)
    tl.store(scale_out_ptr + slots, tl.where(routed, scale, 0.0))
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        mask = routed[:, None] & (cols < K)[None, :]
        row = tl.load(a_ptr + src[:, None] * stride_am + cols[None, :], mask=mask, other=0)
        tl.store(out_ptr + slots.to(tl.int64)[:, None] * K + cols[None, :], row, mask=(cols < K)[None, :])


@on_its_gpu
def gather_slots(a, a_scale, plan: RoutePlan, row_div: int, num_experts: int):
    """(a_slots (C, K), scale_slots (C,) float32), C the plan's capacity: each routed pair's row of
    ``a`` (row ``pair // row_div``) and scale in its slot; zeros in padding slots, in those of the
    pairs of no expert (their GEMM rows come out zero) and from ``used`` on.
    ``reference.gather_slots`` is the twin."""
    capacity = plan.rows.numel()
    K = a.shape[1]
    out = torch.empty(capacity, K, dtype=a.dtype, device=a.device)
    scales = torch.empty(capacity, dtype=torch.float32, device=a.device)
    block_r = min(64 if INTERPRETED else 16, plan.block_m)
    raw = a.view(torch.int8) if a.element_size() == 1 else a  # bytes moved as they are (no fp8 casts)
    pointers = (raw, a_scale, plan.rows, plan.block_expert, plan.used,
                out.view(torch.int8) if a.element_size() == 1 else out, scales)
    ints = (K, row_div, num_experts, raw.stride(0))
    constexprs = dict(A_PER_TOKEN=a_scale.numel() > 1, BLOCK_M=plan.block_m, BLOCK_R=block_r,
                      BLOCK_K=min(next_power_of_2(K), 512))
    _GATHER(("gather", raw.dtype, a_scale.dtype, aligned(*pointers), _spec(ints), *constexprs.values()),
            (cdiv(capacity, block_r),), (*pointers, *ints), constexprs, 4, 3)
    return out, scales


@triton.jit
def _zero_tail_kernel(out_ptr, used_ptr, row_elems, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Zeros in rows [used, capacity) of a (capacity, row_elems) buffer, BLOCK_R rows a program."""
    first = tl.program_id(0) * BLOCK_R
    used = tl.load(used_ptr)
    if first + BLOCK_R <= used:
        return
    rows = first + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    for c0 in range(0, row_elems, BLOCK_C):
        mask = (rows >= used)[:, None] & ((c0 + cols) < row_elems)[None, :]
        ptrs = out_ptr + rows.to(tl.int64)[:, None] * row_elems + (c0 + cols)[None, :]
        tl.store(ptrs, tl.zeros((BLOCK_R, BLOCK_C), dtype=out_ptr.dtype.element_ty), mask=mask)


def _zero_tail(out: torch.Tensor, plan: RoutePlan) -> torch.Tensor:
    """``out`` (capacity, N) with its rows from ``used`` on zeroed: the GEMMs compute the routing's
    blocks only, and nothing past them should hold stale memory (deterministic outputs)."""
    constexprs = dict(BLOCK_R=plan.block_m, BLOCK_C=min(next_power_of_2(max(out.shape[1], 1)), 128))
    _ZERO_TAIL(("zero_tail", out.dtype, aligned(out, plan.used), _spec((out.shape[1],)), *constexprs.values()),
               (out.shape[0] // plan.block_m,), (out, plan.used, out.shape[1]), constexprs, 4, 3)
    return out


@triton.jit
def _combine_kernel(y_ptr, slots_ptr, weights_ptr, out_ptr, H, SLOTS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                    INTERPRETED: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's output columns: the sum in float32 of its SLOTS rows of y, in slot order, each
    times its pair's weight (HAS_WEIGHTS; launched without FMA contraction, as the twin rounds)."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        pair = token * SLOTS + j
        slot = tl.load(slots_ptr + pair).to(tl.int64)
        row = tl.load(y_ptr + slot * H + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            row = row * tl.load(weights_ptr + pair).to(tl.float32)
        acc += row
    tl.store(out_ptr + token.to(tl.int64) * H + cols, cast_for_store(acc, out_ptr.dtype.element_ty, INTERPRETED),
             mask=mask)


@on_its_gpu
def combine(y: torch.Tensor, slots: torch.Tensor, tokens: int, k: int, weights: torch.Tensor | None = None
            ) -> torch.Tensor:
    """(tokens, H): each token's k rows of the slot-ordered ``y`` (C, H) summed in float32 (its
    pairs' slots, ``RoutePlan.slots``, j = 0 .. k-1 in turn), each times its pair's routing weight
    (``weights`` (tokens * k,), any float dtype) if given, cast once to y's dtype.
    ``reference.combine`` is the twin."""
    check_combine_weights(weights, tokens, k)
    H = y.shape[1]
    out = torch.empty(tokens, H, dtype=y.dtype, device=y.device)
    if tokens == 0 or H == 0:
        return out
    pointers = (y, slots, weights if weights is not None else slots, out)
    constexprs = dict(SLOTS=k, HAS_WEIGHTS=weights is not None, INTERPRETED=INTERPRETED,
                      BLOCK_H=min(next_power_of_2(H), 1024))
    _COMBINE(("combine", y.dtype, slots.dtype, pointers[2].dtype, aligned(*pointers), _spec((H,)),
              *constexprs.values()), (tokens, cdiv(H, constexprs["BLOCK_H"])), (*pointers, H), constexprs, 4, 3,
             options=dict(enable_fp_fusion=False))
    return out


_GATHER = CachedLaunch(_gather_slots_kernel)
_ZERO_TAIL = CachedLaunch(_zero_tail_kernel)
_COMBINE = CachedLaunch(_combine_kernel)


def slot_order_takes(plan: RoutePlan, *weights: torch.Tensor) -> bool:
    """The slot-order path serves this plan and these stacked weights: 128-row blocks (prefill
    sizes), and TMA can take each weight and its rows (K a multiple of 16, 16-byte aligned)."""
    return plan.block_m == 128 and all(tma_ready(w) for w in weights)


# Validated slot-order GEMM calls that the Gluon kernel runs, by signature (every tensor's shape,
# strides, dtype and device, the plan's sizes, the flags; call_cache.SignatureCache): a layer's
# eager call repeats two signatures per token count, and a repeat goes straight to the kernel's
# launch (checks, kernel choice and config lookups skipped). Pointer alignment is checked per call.
_SLOT_CALLS = SignatureCache()


@on_its_gpu
def grouped_slot_mm(a, w, a_scale, w_scale, plan: RoutePlan, activation="none", gated=False,
                    out_dtype=torch.bfloat16) -> torch.Tensor:
    """(C, N) in slot order: row s below ``used`` is ``act(a[s] @ w[e].T * a_scale[s] * w_scale[e])``
    (gated: ``act(gate) * up`` of the expert's [gate; up] rows), e the expert of s's block (the run
    of no expert comes out zero: its rows have zero scales); rows from
    ``used`` on are zeros. a (C, K) from ``gather_slots`` (or a slot-ordered GEMM output,
    quantized), a_scale (C,) float32. On sm_90 with Gluon (a 2-byte output): ``gemm_gluon.gluon_grouped_mm``;
    else the persistent Triton kernel in slot order. ``reference.grouped_slot_mm`` is the twin."""
    signature = (a.shape, a.stride(), a.dtype, a.device, w.shape, w.stride(), w.dtype, w.device, a_scale.shape,
                 a_scale.stride(), a_scale.dtype, a_scale.device, w_scale.shape, w_scale.stride(), w_scale.dtype,
                 w_scale.device, plan.rows.shape, plan.block_expert.shape, plan.block_m, activation, gated, out_dtype)
    entry = _SLOT_CALLS.get(signature)
    if entry is not None and a.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0:
        n_out, call = entry
        out = torch.empty(a.shape[0], n_out, dtype=out_dtype, device=a.device)
        call(a, w, out, a_scale, w_scale, plan.block_expert, plan.used)
        return _zero_tail(out, plan)
    capacity, K = a.shape
    num_experts, rows, _ = w.shape
    n_out = rows // 2 if gated else rows
    if a.dtype != w.dtype or w.shape[2] != K or tuple(w_scale.shape) != (num_experts, rows) \
            or not w_scale.is_contiguous() or w_scale.dtype != torch.float32:
        raise ValueError(f"a ({a.dtype}, K={K}) and w ({w.dtype}, {tuple(w.shape)}) must share dtype and K, and "
                         f"w_scale must be a contiguous float32 ({num_experts}, {rows}) tensor, got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    if a_scale.numel() != capacity or a_scale.dtype != torch.float32:
        raise ValueError(f"a_scale must hold one float32 per slot ({capacity}), got {a_scale.dtype} "
                         f"{tuple(a_scale.shape)}: pass gather_slots' scales")
    if not slot_order_takes(plan, w) or capacity != plan.rows.numel():
        raise ValueError(f"the slot-order GEMM needs 128-row blocks, a TMA-ready weight and the plan's "
                         f"{plan.rows.numel()} slots (got {plan.block_m}-row blocks, {capacity} rows); "
                         "use grouped_scaled_mm")
    from quantkit.kernels import gemm_gluon

    out = torch.empty(capacity, n_out, dtype=out_dtype, device=a.device)
    if a.is_cuda and n_out % 8 == 0 and out_dtype in (torch.bfloat16, torch.float16) and gemm_gluon.available():
        config = gemm_gluon.config_named(gemm_gluon.GROUPED_CONFIGS[gated])
        gemm_gluon.gluon_grouped_mm(a, w, a_scale, w_scale, plan.block_expert, plan.used, activation, gated, out=out,
                                    config=config)  # validates the call, then launches
        _SLOT_CALLS.add(signature, (n_out, gemm_gluon.grouped_call(config, capacity, n_out, a.device, activation)))
        return _zero_tail(out, plan)
    config = default_config(192 * num_experts, num_experts, K, gated, out_dtype)  # the 128-row default's tiles
    block_n, block_k = config["block_n"], config["block_k"]
    w_desc = TensorDescriptor.from_tensor(w.view(-1, K), [block_n, block_k])
    a_desc = TensorDescriptor.from_tensor(a, [plan.block_m, block_k])
    programs = 4 if INTERPRETED else num_sms(a.device.index)
    tiles = capacity // plan.block_m * cdiv(n_out, block_n)
    _grouped_persistent_kernel[(min(programs, tiles),)](
        a_desc, w_desc, out, a_scale, w_scale, a_scale, plan.rows, plan.block_expert, plan.used, n_out, K, 1,
        num_experts, rows, K, w_scale.stride(0), out.stride(0), IS_INT8=a.dtype == torch.int8, A_PER_TOKEN=True,
        ROW_SCALE=False, ACTIVATION=ACTIVATION_CODES[activation], GATED=gated, EVEN_K=K % block_k == 0,
        SLOT_ORDER=True, INTERPRETED=INTERPRETED, NUM_PROGRAMS=programs, BLOCK_M=plan.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=config["num_warps"], num_stages=config["num_stages"])
    return _zero_tail(out, plan)
