"""Causal flash attention (prefill) and split-KV decode attention over a static KV cache.

Prefill (``flash_attention``): one program per (query block, batch x query head). Scores live
only in registers; the softmax is online (running max ``m`` and denominator ``l`` in the log2
domain, so the exponentials are ``exp2``). The key range of a query block is cut into three
pieces so that only the blocks that straddle a mask edge pay for the mask:

    [lo, full_lo)       masked   keys near the lower edge of a sliding window
    [full_lo, full_hi)  unmasked every key visible to every query of the block
    [full_hi, hi)       masked   the causal diagonal (and the end of the keys)

Two input layouts: batched q (B, Hq, S, D) as HF and SDPA hold it (any strides, head_dim
contiguous), or packed sequences without padding, q (T, Hq, D) with ``cu_seqlens``. Programs are
launched heaviest-first (the last query blocks see the most keys), which balances causal work.

Decode (``decode_attention``): flash-decoding. Phase 1 splits each sequence's cache into
chunks, one program per (batch x kv head, chunk), all query heads of a GQA group at once so each
key/value is read from memory once; it writes a partial output and its log-sum-exp. Phase 2
combines the chunks, inside the same launch: the last program of a group to finish (an atomic
arrival counter) does it, so a decode step is one kernel, not two. The grid depends only on
shapes and the cache capacity (or the caller's ``max_seqlen``), never on the lengths' values, so
it captures in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from quantkit.kernels.reference_attention import check_decode_inputs, check_prefill_inputs

# bf16 arithmetic is wrong in Triton's CPU interpreter: upcast after loading when interpreted.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
# Running max starts finite so that fully masked rows give exp2(-inf - m) = 0, never NaN.
_M_INIT = tl.constexpr(-1.0e30)


# ---------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------


@triton.jit
def _attend_key_range(
    acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m_pos, offs_n, offs_d,
    lo, hi, n_keys, qk_scale, window,
    MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
):
    """Fold keys [lo, hi) into the running (acc, l, m); blocks start at lo, step BLOCK_N."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    for start_n in range(lo, hi, BLOCK_N):
        key_pos = start_n + offs_n
        k_ptrs = k_base + key_pos[None, :] * stride_ks + offs_d[:, None]
        v_ptrs = v_base + key_pos[:, None] * stride_vs + offs_d[None, :]
        if MASKED:
            in_range = key_pos < n_keys
            k = tl.load(k_ptrs, mask=in_range[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k) * qk_scale
        if MASKED:
            visible = (key_pos[None, :] <= offs_m_pos[:, None]) & (key_pos[None, :] < n_keys)
            if HAS_WINDOW:
                visible = visible & (key_pos[None, :] > offs_m_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_prefill_kernel(
    Q, K, V, O, cu_seqlens_q, cu_seqlens_k,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    seqlen_q, seqlen_k, n_q_heads, group_size, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    # Heaviest (last) query blocks first: LPT order balances the causal triangle.
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    batch = pid_bh // n_q_heads
    head = pid_bh % n_q_heads
    kv_head = head // group_size
    if IS_VARLEN:
        q_start = tl.load(cu_seqlens_q + batch)
        n_queries = tl.load(cu_seqlens_q + batch + 1) - q_start
        k_start = tl.load(cu_seqlens_k + batch)
        n_keys = tl.load(cu_seqlens_k + batch + 1) - k_start
        q_off = q_start.to(tl.int64) * stride_qs
        k_off = k_start.to(tl.int64) * stride_ks
        v_off = k_start.to(tl.int64) * stride_vs
    else:
        n_queries = seqlen_q
        n_keys = seqlen_k
        q_off = batch.to(tl.int64) * stride_qb
        k_off = batch.to(tl.int64) * stride_kb
        v_off = batch.to(tl.int64) * stride_vb
    start_m = pid_m * BLOCK_M
    if start_m < n_queries:
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < n_queries
        q_ptrs = Q + q_off + head * stride_qh + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = K + k_off + kv_head * stride_kh
        v_base = V + v_off + kv_head * stride_vh

        # Absolute positions of this block's queries (bottom-right aligned causal mask).
        shift = n_keys - n_queries
        offs_m_pos = offs_m + shift
        first_pos = start_m + shift
        last_pos = tl.minimum(start_m + BLOCK_M, n_queries) - 1 + shift
        hi = tl.minimum(n_keys, last_pos + 1)
        full_hi = tl.maximum(tl.minimum(first_pos + 1, n_keys), 0) // BLOCK_N * BLOCK_N
        if HAS_WINDOW:
            lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
            full_hi = tl.maximum(full_hi, lo)
            full_lo = tl.minimum(tl.maximum(full_lo, lo), full_hi)
        else:
            lo = 0
            full_lo = 0

        m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if HAS_WINDOW:
            acc, l_i, m_i = _attend_key_range(
                acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m_pos, offs_n, offs_d,
                lo, full_lo, n_keys, qk_scale, window, True, HAS_WINDOW, UPCAST,
            )
        acc, l_i, m_i = _attend_key_range(
            acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m_pos, offs_n, offs_d,
            full_lo, full_hi, n_keys, qk_scale, window, False, HAS_WINDOW, UPCAST,
        )
        acc, l_i, m_i = _attend_key_range(
            acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, offs_m_pos, offs_n, offs_d,
            full_hi, hi, n_keys, qk_scale, window, True, HAS_WINDOW, UPCAST,
        )
        # Rows that saw no key (only when keys < queries in a packed batch) output zeros.
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if IS_VARLEN:
            o_off = q_start.to(tl.int64) * stride_os
        else:
            o_off = batch.to(tl.int64) * stride_ob
        o_ptrs = O + o_off + head * stride_oh + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])


def _prefill_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a head_dim on Hopper-class GPUs."""
    if _INTERPRETED:
        # The interpreter's cost is per program: few, big blocks.
        return 64, 64, 4, 1
    if head_dim == 64:
        return 128, 64, 4, 3
    if head_dim == 128:
        return 128, 128, 8, 3  # best of a 6-config sweep on an H100 (benchmarks/NOTES-attention.md)
    return 64, 32, 4, 2  # head_dim 256: keep q, k, v tiles inside shared memory


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    block_config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Launch causal flash attention; see ``reference_attention.flash_attention`` for the math.

    Packed inputs need ``max_seqlen_q`` (a host-side bound on the longest query run) to size the
    grid without reading ``cu_seqlens`` off the GPU. ``block_config`` overrides the tile choice.
    """
    check_prefill_inputs(q, k, v, window, cu_seqlens_q, cu_seqlens_k)
    varlen = cu_seqlens_q is not None
    if varlen:
        if max_seqlen_q is None or max_seqlen_q < 1:
            raise ValueError("packed attention needs max_seqlen_q >= 1 (the longest query sequence)")
        batch = cu_seqlens_q.numel() - 1
        n_q_heads, head_dim = q.shape[1], q.shape[2]
        n_kv_heads = k.shape[1]
        seqlen_q, seqlen_k = max_seqlen_q, 0
        # (T, H, D): no batch stride; sequences start at cu_seqlens offsets.
        q_strides = (0, q.stride(1), q.stride(0))
        k_strides = (0, k.stride(1), k.stride(0))
        v_strides = (0, v.stride(1), v.stride(0))
    else:
        batch, n_q_heads, seqlen_q, head_dim = q.shape
        n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
        q_strides = (q.stride(0), q.stride(1), q.stride(2))
        k_strides = (k.stride(0), k.stride(1), k.stride(2))
        v_strides = (v.stride(0), v.stride(1), v.stride(2))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    o_strides = (0, out.stride(1), out.stride(0)) if varlen else (out.stride(0), out.stride(1), out.stride(2))
    if q.numel() == 0:
        return out
    block_m, block_n, num_warps, num_stages = block_config or _prefill_config(head_dim)
    grid = (batch * n_q_heads, triton.cdiv(seqlen_q, block_m))
    dummy = cu_seqlens_q if varlen else q  # never read when not IS_VARLEN
    _flash_prefill_kernel[grid](
        q, k, v, out, dummy, cu_seqlens_k if varlen else dummy,
        *q_strides, *k_strides, *v_strides, *o_strides,
        seqlen_q, seqlen_k, n_q_heads, n_q_heads // n_kv_heads, float(scale) * LOG2E,
        window if window is not None else 0,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        IS_VARLEN=varlen, HAS_WINDOW=window is not None, UPCAST=_INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------

# How a split program's result reaches the output (``_decode_split_kernel``'s EPILOGUE).
EPILOGUE_FINAL = 0  # one split: the program's result is the output
EPILOGUE_FUSED = 1  # partials, and the group's last program to finish combines them
EPILOGUE_PARTIAL = 2  # partials only; ``_decode_combine_kernel`` combines (second launch)


@triton.jit
def _combine_group_partials(
    O_part, LSE_part, O, stride_ob, stride_oh, batch, kv_head, n_kv_heads, group_size, n_splits,
    HEAD_DIM: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """Combine the n_splits partials of one GQA group's query heads into O (fused epilogue).

    The partials were written by other programs of this launch: ``.cg`` loads read them from L2,
    never from a stale L1 line. Splits are read in chunks of SPLIT_CHUNK (bounded registers);
    the chunks are unrolled so their loads are in flight together.
    """
    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < group_size
    head = kv_head * group_size + offs_g
    row0 = (batch * n_kv_heads * group_size + head).to(tl.int64) * n_splits
    offs_s = tl.arange(0, BLOCK_SPLITS)
    lse_all = tl.load(LSE_part + row0[:, None] + offs_s[None, :],
                      mask=g_ok[:, None] & (offs_s[None, :] < n_splits), other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse_all, 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a sequence with no keys: all weights 0
    total = tl.sum(tl.exp2(lse_all - m[:, None]), 1)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], dtype=tl.float32)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    for chunk in tl.static_range(0, BLOCK_SPLITS, SPLIT_CHUNK):
        split = chunk + offs_c
        ok = g_ok[:, None] & (split[None, :] < n_splits)
        rows = row0[:, None] + split[None, :]
        weight = tl.exp2(tl.load(LSE_part + rows, mask=ok, other=float("-inf"), cache_modifier=".cg") - m[:, None])
        part = tl.load(O_part + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0,
                       cache_modifier=".cg")
        acc += tl.sum(part * weight[:, :, None], 1)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    o_ptrs = O + batch.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_split_kernel(
    Q, K, V, cache_seqlens, O, O_part, LSE_part, counters,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    n_kv_heads, group_size, key_limit, split_len, n_splits, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, EPILOGUE: tl.constexpr,
    GROUP_P2: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    pid_bk = tl.program_id(0)
    split = tl.program_id(1)
    batch = pid_bk // n_kv_heads
    kv_head = pid_bk % n_kv_heads
    # Clamp to the capacity: a bad length can never read outside the cache.
    n_keys = tl.minimum(tl.load(cache_seqlens + batch), key_limit)
    # With a window the splits tile only the visible span [n_keys - window, n_keys).
    if HAS_WINDOW:
        first_key = tl.maximum(n_keys - window, 0)
    else:
        first_key = 0
    lo = first_key + split * split_len
    hi = tl.minimum(lo + split_len, n_keys)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * group_size + offs_g
    head_ok = offs_g < group_size
    q_ptrs = Q + batch.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_G], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        key_pos = start_n + offs_n
        in_range = key_pos < hi
        k = tl.load(k_base + key_pos[None, :].to(tl.int64) * stride_ks + offs_d[:, None], mask=in_range[None, :], other=0.0)
        v = tl.load(v_base + key_pos[:, None].to(tl.int64) * stride_vs + offs_d[None, :], mask=in_range[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k) * qk_scale
        s = tl.where(in_range[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # An empty split (or a sequence with no keys) has l = 0: output zeros, lse = -inf (weight 0).
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if EPILOGUE == 0:
        o_ptrs = O + batch.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=head_ok[:, None])
    else:
        # Partials are (B, Hq, n_splits, D) fp32 and (B, Hq, n_splits) log2-sum-exp.
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row = (batch * n_kv_heads * group_size + head).to(tl.int64) * n_splits + split
        tl.store(O_part + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
        tl.store(LSE_part + row, lse, mask=head_ok)
        if EPILOGUE == 1:
            # Flash-decoding without a second launch: every program of a (batch, kv head) group
            # bumps the group's counter after its partials are out; the one that sees
            # n_splits - 1 was last and combines. The barrier puts all of this program's stores
            # before the (acq_rel, gpu-scope) atomic; the last program resets the counter, so the
            # counters are all zero between launches (CUDA-graph replays included).
            tl.debug_barrier()
            arrived = tl.atomic_add(counters + pid_bk, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                _combine_group_partials(
                    O_part, LSE_part, O, stride_ob, stride_oh, batch, kv_head, n_kv_heads, group_size, n_splits,
                    HEAD_DIM, GROUP_P2, BLOCK_SPLITS, SPLIT_CHUNK,
                )
                tl.atomic_xchg(counters + pid_bk, 0, sem="relaxed", scope="gpu")


@triton.jit
def _decode_combine_kernel(
    O_part, LSE_part, O, stride_ob, stride_oh, n_q_heads, n_splits,
    HEAD_DIM: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """Second-launch combine, one program per (batch, query head); splits in chunks with an
    online rescale, so the registers stay bounded at any split count."""
    pid = tl.program_id(0)
    batch = pid // n_q_heads
    head = pid % n_q_heads
    offs_c = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    row0 = pid.to(tl.int64) * n_splits
    m = tl.max(tl.full([SPLIT_CHUNK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([SPLIT_CHUNK], dtype=tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for start in range(0, n_splits, SPLIT_CHUNK):
        split = start + offs_c
        ok = split < n_splits
        lse = tl.load(LSE_part + row0 + split, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no keys so far: all weights 0
        alpha = tl.exp2(m - m_safe)
        weight = tl.exp2(lse - m_safe)
        part = tl.load(O_part + (row0 + split)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(part * weight[:, None], 0)
        total = total * alpha + tl.sum(weight, 0)
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(O + batch.to(tl.int64) * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=256)
def decode_split_plan(
    batch: int, n_kv_heads: int, max_keys: int, device: torch.device, block_n: int, programs_per_sm: int = 2
) -> tuple[int, int]:
    """(split_len, n_splits) for ``batch * n_kv_heads`` sequences of up to ``max_keys`` keys.

    The kernel is bandwidth-bound and its programs are equal in size, so what counts is how many
    *waves* of ``programs_per_sm * SMs`` concurrent programs the grid takes, times the blocks
    each program streams. The first version asked for ~one wave's worth of programs per
    sequence and rounded up: at batch 8 x 8 kv heads that is 5 splits = 320 programs for 264
    slots, a second wave of 56 programs with most of the chip idle. Here the split count
    minimizes waves x blocks-per-split (then prefers fewer splits: less phase-2 work), e.g.
    4 splits = 256 programs in one wave at batch 8; batch 1 keeps 32 splits. Cached: the search
    is a Python loop of up to ~70 steps, paid on every eager call otherwise.
    """
    if device.type == "cuda":
        sm_count = _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())
        slots = programs_per_sm * sm_count
    else:
        slots = 4  # interpreter: a few splits, so that the combine path is exercised
    sequences = batch * n_kv_heads
    n_blocks = triton.cdiv(max(max_keys, 1), block_n)
    best = None
    # More splits than one full wave per sequence never helps; cap the search there.
    for wanted in range(1, min(n_blocks, triton.cdiv(slots, sequences) * 2) + 1):
        blocks_per_split = triton.cdiv(n_blocks, wanted)
        n_splits = triton.cdiv(n_blocks, blocks_per_split)
        cost = triton.cdiv(sequences * n_splits, slots) * blocks_per_split
        if best is None or cost < best[0]:
            best = (cost, n_splits, blocks_per_split)
    _, n_splits, blocks_per_split = best
    return blocks_per_split * block_n, n_splits


def _decode_config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, num_warps, num_stages, programs_per_sm)."""
    if _INTERPRETED:
        return 64, 4, 1, 2
    if head_dim == 256:
        return 32, 4, 2, 2
    return 64, 4, 3, 2


# The fused combine runs in one program per GQA group, so it pays only while a group's partials
# are small: 4 heads x 32 splits x d=128 (batch 1, Llama-3-8B shapes) = 16k floats. Beyond that
# (MQA with 32 heads and hundreds of splits) the combine kernel's one program per query head is
# faster, and the fused epilogue's unrolled chunks would grow without bound (a d=256 MQA case
# with 256 splits did not finish compiling in 3 minutes on an H100, 2026-11-23).
FUSED_COMBINE_MAX_FLOATS = 16384
COMBINE_CHUNK_FLOATS = 4096  # per unrolled chunk: 32 fp32 registers per thread at 4 warps


def decode_epilogue(n_splits: int, group: int, head_dim: int, fuse_combine: bool = True) -> tuple[int, int]:
    """(EPILOGUE, SPLIT_CHUNK) for a launch: one split writes the output; few partials per group
    are combined in the same launch, in at most FUSED_COMBINE_MAX_FLOATS / COMBINE_CHUNK_FLOATS
    unrolled chunks (4); otherwise a second kernel combines them."""
    if n_splits == 1:
        return EPILOGUE_FINAL, 1
    group_p2, block_splits = triton.next_power_of_2(group), triton.next_power_of_2(n_splits)
    if not fuse_combine or group_p2 * block_splits * head_dim > FUSED_COMBINE_MAX_FLOATS:
        return EPILOGUE_PARTIAL, 1
    per_split = group_p2 * head_dim
    chunk = max(1, 1 << (COMBINE_CHUNK_FLOATS // per_split).bit_length() >> 1)  # a power of two
    return EPILOGUE_FUSED, min(block_splits, chunk)


# Per-device arrival counters of the fused epilogue, one int32 per (batch, kv head) group; zero
# between launches (the last program of a group resets its counter). A grown buffer replaces the
# old one, which stays referenced: a CUDA graph captured earlier still points at it. Two decode
# launches running at once on different streams of one device would share counters: not supported.
_GROUP_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def _group_counters(device: torch.device, groups: int) -> torch.Tensor:
    counters = _GROUP_COUNTERS.get(device)
    if counters is None or counters.numel() < groups:
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = torch.zeros(max(groups, 4096), dtype=torch.int32, device=device)
        _GROUP_COUNTERS[device] = counters
    return counters


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
    max_seqlen: int | None = None,
    block_config: tuple[int, int, int, int] | None = None,
    n_splits: int | None = None,
    fuse_combine: bool = True,
) -> torch.Tensor:
    """Launch split-KV decode; see ``reference_attention.decode_attention`` for the math.

    ``max_seqlen`` (host-side bound on ``cache_seqlens``) both checks for cache overflow and
    sizes the splits; without it the grid covers the whole capacity (CUDA-graph friendly).
    ``block_config`` = (BLOCK_N, num_warps, num_stages, programs_per_sm) overrides the tuning and
    ``n_splits`` the split plan (benchmarks and tests). One launch: the splits' partials are
    combined by the last program of each group to finish (``fuse_combine=False``: by a second
    kernel, as first built; kept for A/B timing).
    """
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, window, max_seqlen)
    batch, n_q_heads, head_dim = q.shape
    n_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    block_n, num_warps, num_stages, programs_per_sm = block_config or _decode_config(head_dim)
    max_keys = max_seqlen if max_seqlen is not None else capacity
    span = min(max_keys, window) if window is not None else max_keys
    if n_splits is None:
        split_len, n_splits = decode_split_plan(batch, n_kv_heads, span, q.device, block_n, programs_per_sm)
    else:
        n_blocks = triton.cdiv(max(span, 1), block_n)
        split_len = triton.cdiv(n_blocks, max(1, min(n_splits, n_blocks))) * block_n
        n_splits = triton.cdiv(max(span, 1), split_len)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.numel() == 0:
        return out
    epilogue, split_chunk = decode_epilogue(n_splits, group, head_dim, fuse_combine)
    if epilogue == EPILOGUE_FINAL:
        o_part = lse_part = out  # never touched
        counters = cache_seqlens
    else:
        # One allocation for both partial buffers: (B, Hq, n_splits, D) then (B, Hq, n_splits).
        rows = batch * n_q_heads * n_splits
        workspace = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=q.device)
        o_part, lse_part = workspace[: rows * head_dim], workspace[rows * head_dim :]
        fused = epilogue == EPILOGUE_FUSED
        counters = _group_counters(q.device, batch * n_kv_heads) if fused else cache_seqlens
    # Constexprs of the fused combine only; fixed otherwise (no extra compiled variants).
    fused_shape = (triton.next_power_of_2(group), triton.next_power_of_2(n_splits), split_chunk)
    group_p2, block_splits, split_chunk = fused_shape if epilogue == EPILOGUE_FUSED else (1, 1, 1)
    _decode_split_kernel[(batch * n_kv_heads, n_splits)](
        q, k_cache, v_cache, cache_seqlens, out, o_part, lse_part, counters,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        n_kv_heads, group, max_keys, split_len, n_splits, float(scale) * LOG2E,
        window if window is not None else 0,
        HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HAS_WINDOW=window is not None, UPCAST=_INTERPRETED, EPILOGUE=epilogue,
        GROUP_P2=group_p2, BLOCK_SPLITS=block_splits, SPLIT_CHUNK=split_chunk,
        num_warps=num_warps, num_stages=num_stages,
    )
    if epilogue == EPILOGUE_PARTIAL:
        _decode_combine_kernel[(batch * n_q_heads,)](
            o_part, lse_part, out, out.stride(0), out.stride(1), n_q_heads, n_splits,
            HEAD_DIM=head_dim, SPLIT_CHUNK=16, num_warps=4,
        )
    return out
