"""Split-KV decode attention over a static KV cache (flash-decoding), one launch per step.

Phase 1 splits each sequence's cache into chunks, one program per (batch x kv head, chunk), all
query heads of a GQA group at once so each key/value is read from memory once; it writes a
partial output and its log-sum-exp. Phase 2 combines the chunks, inside the same launch: the last
program of a group to finish (an atomic arrival counter) does it, so a decode step is one kernel,
not two. The grid depends only on shapes and the cache capacity (or the caller's ``max_seqlen``),
never on the lengths' values, so it captures in a CUDA graph.

How the K/V tiles reach the program is a ``DecodeConfig`` choice (session 4 variants, timed
against SDPA by ``benchmarks/attention_s4.py`` (in git history; ``attention_s5.py`` supersedes it)):

- ``loads="pointer"``: masked pointer loads (cp.async, software-pipelined by Triton);
  ``k_rows`` loads K as (BLOCK_N, D) rows and transposes it in the dot instead of gathering a
  (D, BLOCK_N) tile; ``evict_first`` marks K/V lines first for L2 eviction (read once).
- ``loads="tma"``: whole blocks through host-built tensor descriptors over the cache viewed as
  rows of D (the copy engine moves a tile per instruction); the one partial block at a
  sequence's end goes through masked pointer loads, so a TMA load never crosses the length.
  Falls back to pointer loads when the cache's strides do not allow the row view.
- ``prefetch_first``: the first block of a split is loaded before the sequence length is read
  (bounded by the host-side key limit, so it never leaves the cache), so the first memory wave
  does not wait for the ``cache_seqlens`` load; keys past the length are masked out of the scores
  and zeroed in V (they may hold anything). Not with a sliding window (its start needs the length).

Where the work goes is the ``schedule`` choice (session 5, ``benchmarks/attention_s5.py``):

- ``"split"`` (default): a (batch x kv head, split) grid whose split count is planned on the host
  from the capacity (or ``max_seqlen``): ``decode_split_plan``; with ``split_by_fill`` (default)
  each sequence's splits share its *filled* blocks evenly, on the device, so a cache filled to a
  fraction of the capacity (generate's captured decode) still uses every split.
- ``"flat"``: a fixed grid of one program per resident slot (SMs x ``programs_per_sm``); on the
  device, each program reads all lengths, lays the filled blocks of every (batch, kv head) end to
  end and takes an equal share (to one block), so all SMs stream whatever the shape (batch 8 x 8
  kv heads = 64 sequences over 132 SMs) and a mostly empty cache still spreads over all of them.
  Ranges cross sequence boundaries: one partial per (program, sequence), combined by the last
  part to arrive (same counters). TMA loads only in practice (its pointer loop is not pipelined).

Measured (H100, session 5): the flat schedule lost 0.8-1.2 % at batch 8, 32k (HBM-bound at
~3.05 TB/s with 128 of 132 SMs already; 254 vs 206 registers) and 5-30 % at short caches (fixed
cost ~2-4 us); it stays selectable. Session 4: TMA with 128-key tiles, one program per SM, is the
head_dim-128 default. On the 64-key pointer kernel: evict_first changed < 0.5 %, K as rows
< 0.5 % (+1.7 % at batch 8, 1k), 8 warps lost 0.6-17 %, prefetch_first lost up to 8 % (gained
2 % at batch 1, 1k; cause not measured). They stay selectable for A/B runs.

Under programmatic dependent launch (``launch.PDL``) both kernels wait for the kernel before them
(the KV-cache write) before their first load.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from quantkit.kernels import launch
from quantkit.kernels.dependent_launch import wait_for_the_kernel_before
from quantkit.kernels.launch import num_sms, on_its_gpu
from quantkit.kernels.reference_attention import check_decode_inputs

# bf16 arithmetic is wrong in Triton's CPU interpreter: upcast after loading when interpreted.
# (Shared with the prefill kernels in attention.py.)
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634
# Running max starts finite so that fully masked rows give exp2(-inf - m) = 0, never NaN.
_M_INIT = tl.constexpr(-1.0e30)

# How a split program's result reaches the output (``_decode_split_kernel``'s EPILOGUE).
EPILOGUE_FINAL = 0  # one split: the program's result is the output
EPILOGUE_FUSED = 1  # partials, and the group's last program to finish combines them
EPILOGUE_PARTIAL = 2  # partials only; ``_decode_combine_kernel`` combines (second launch)

LOADS = ("pointer", "tma")
# "split": grid (batch x kv head, splits of a host-planned length). "flat": one program per
# resident slot (SMs x programs_per_sm), each streaming an equal share of all the blocks that the
# lengths fill, laid end to end over (batch, kv head) (see ``_decode_flat_kernel``).
SCHEDULES = ("split", "flat")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling and load path of the split kernel. ``programs_per_sm`` feeds the split plan (how
    many programs run at once per SM: set by shared memory, BLOCK_N x D x 2 tensors x stages).
    ``split_by_fill``: the split grid is planned for the capacity (or ``max_seqlen``), but each
    sequence's splits share its filled blocks evenly, on the device (not with ``prefetch_first``,
    which loads a split's first block before the length is known). ``schedule`` / ``min_blocks``:
    see the module docstring ("flat": programs get at least ``min_blocks`` blocks)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 2
    loads: str = "pointer"
    k_rows: bool = False
    evict_first: bool = False
    prefetch_first: bool = False
    schedule: str = "split"
    min_blocks: int = 2
    split_by_fill: bool = True

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n={self.block_n} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1 or self.programs_per_sm < 1:
            raise ValueError(f"bad launch shape: num_warps={self.num_warps}, num_stages={self.num_stages}, "
                             f"programs_per_sm={self.programs_per_sm}")
        if self.loads not in LOADS:
            raise ValueError(f"loads={self.loads!r}; choose one of {LOADS}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; choose one of {SCHEDULES}")
        if self.min_blocks < 1:
            raise ValueError(f"min_blocks={self.min_blocks} must be >= 1")
        if self.schedule == "flat" and self.prefetch_first:
            raise ValueError("prefetch_first applies to schedule='split' only")

    @classmethod
    def of(cls, value: DecodeConfig | tuple[int, int, int, int]) -> DecodeConfig:
        """A config, or the older (BLOCK_N, num_warps, num_stages, programs_per_sm) tuple."""
        if isinstance(value, DecodeConfig):
            return value
        if len(value) != 4:
            raise ValueError(f"block_config {value!r}: want (BLOCK_N, num_warps, num_stages, programs_per_sm)")
        return cls(*(int(x) for x in value))

    def astuple(self) -> tuple[int, int, int, int]:
        return self.block_n, self.num_warps, self.num_stages, self.programs_per_sm


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
def _load_kv_block(k_base, v_base, stride_ks, stride_vs, key_pos, offs_d, valid,
                   K_ROWS: tl.constexpr, EVICTION: tl.constexpr, UPCAST: tl.constexpr):
    """K as (D, BLOCK_N) (or (BLOCK_N, D) rows when K_ROWS) and V as (BLOCK_N, D); invalid keys 0."""
    rows = key_pos.to(tl.int64)
    if K_ROWS:
        k = tl.load(k_base + rows[:, None] * stride_ks + offs_d[None, :], mask=valid[:, None], other=0.0,
                    eviction_policy=EVICTION)
    else:
        k = tl.load(k_base + rows[None, :] * stride_ks + offs_d[:, None], mask=valid[None, :], other=0.0,
                    eviction_policy=EVICTION)
    v = tl.load(v_base + rows[:, None] * stride_vs + offs_d[None, :], mask=valid[:, None], other=0.0,
                eviction_policy=EVICTION)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _attend_block(q, k, v, m_i, l_i, acc, qk_scale, valid, K_ROWS: tl.constexpr, MASKED: tl.constexpr):
    """Fold one block of keys into the running (m, l, acc) of the online softmax (log2 domain)."""
    if K_ROWS:
        s = tl.dot(q, tl.trans(k)) * qk_scale
    else:
        s = tl.dot(q, k) * qk_scale
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_span(q, m_i, l_i, acc, qk_scale, k_base, v_base, stride_ks, stride_vs, K_desc, V_desc, k_row, v_row,
                 lo, hi, offs_n, offs_d, BLOCK_N: tl.constexpr, TMA: tl.constexpr, K_ROWS: tl.constexpr,
                 EVICTION: tl.constexpr, UPCAST: tl.constexpr):
    """Fold the keys [lo, hi) of one (batch, kv head) sequence into the running softmax state.

    TMA: whole blocks through the descriptors (rows ``k_row + key``, no masks), then at most one
    partial block through masked pointer loads (K as rows). Otherwise masked pointer loads only.
    """
    if TMA:
        full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for start_n in range(lo, full_hi, BLOCK_N):
            k = K_desc.load([k_row + start_n, 0])
            v = V_desc.load([v_row + start_n, 0])
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, qk_scale, offs_n, True, False)
        if full_hi < hi:
            key_pos = full_hi + offs_n
            valid = key_pos < hi
            k, v = _load_kv_block(k_base, v_base, stride_ks, stride_vs, key_pos, offs_d, valid, True, EVICTION, UPCAST)
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, qk_scale, valid, True, True)
    else:
        for start_n in range(lo, hi, BLOCK_N):
            key_pos = start_n + offs_n
            valid = key_pos < hi
            k, v = _load_kv_block(k_base, v_base, stride_ks, stride_vs, key_pos, offs_d, valid, K_ROWS, EVICTION,
                                  UPCAST)
            m_i, l_i, acc = _attend_block(q, k, v, m_i, l_i, acc, qk_scale, valid, K_ROWS, True)
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    Q, K, V, K_desc, V_desc, cache_seqlens, O, O_part, LSE_part, counters,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    k_rows_per_batch, k_rows_per_head, v_rows_per_batch, v_rows_per_head,
    n_kv_heads, group_size, key_limit, split_len, n_splits, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, EPILOGUE: tl.constexpr,
    GROUP_P2: tl.constexpr, BLOCK_SPLITS: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    TMA: tl.constexpr, K_ROWS: tl.constexpr, EVICTION: tl.constexpr, PREFETCH_FIRST: tl.constexpr,
    SPLIT_BY_FILL: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_the_kernel_before(PDL)
    pid_bk = tl.program_id(0)
    split = tl.program_id(1)
    batch = pid_bk // n_kv_heads
    kv_head = pid_bk % n_kv_heads
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
    if PREFETCH_FIRST:
        # Issued before the length is known: bounded by the host-side limit (inside the cache).
        first_pos = split * split_len + offs_n
        k_first, v_first = _load_kv_block(k_base, v_base, stride_ks, stride_vs, first_pos, offs_d,
                                          first_pos < key_limit, K_ROWS, EVICTION, UPCAST)
    # Clamp to the capacity: a bad length can never read outside the cache.
    n_keys = tl.minimum(tl.load(cache_seqlens + batch), key_limit)
    # With a window the splits tile only the visible span [n_keys - window, n_keys).
    if HAS_WINDOW:
        first_key = tl.maximum(n_keys - window, 0)
    else:
        first_key = 0
    if SPLIT_BY_FILL:
        # The grid's n_splits share this sequence's *filled* blocks evenly (device side): a
        # cache filled to 1/8 of the capacity the grid was planned for still uses every split.
        fill_blocks = (n_keys - first_key + BLOCK_N - 1) // BLOCK_N
        split_keys = (fill_blocks + n_splits - 1) // n_splits * BLOCK_N
        lo = first_key + split * split_keys
        hi = tl.minimum(lo + split_keys, n_keys)
    else:
        lo = first_key + split * split_len
        hi = tl.minimum(lo + split_len, n_keys)

    head = kv_head * group_size + offs_g
    head_ok = offs_g < group_size
    q_ptrs = Q + batch.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    start = lo
    if PREFETCH_FIRST:
        valid = first_pos < hi
        v_first = tl.where(valid[:, None], v_first, 0.0)  # keys past the length may hold NaN
        m_i, l_i, acc = _attend_block(q, k_first, v_first, m_i, l_i, acc, qk_scale, valid, K_ROWS, True)
        start = lo + BLOCK_N
    k_row = batch * k_rows_per_batch + kv_head * k_rows_per_head
    v_row = batch * v_rows_per_batch + kv_head * v_rows_per_head
    m_i, l_i, acc = _attend_span(q, m_i, l_i, acc, qk_scale, k_base, v_base, stride_ks, stride_vs, K_desc, V_desc,
                                 k_row, v_row, start, hi, offs_n, offs_d, BLOCK_N, TMA, K_ROWS, EVICTION, UPCAST)

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
def _combine_parts_loop(
    O_part, LSE_part, O, stride_ob, stride_oh, batch, kv_head, group_size, row0, n_parts,
    HEAD_DIM: tl.constexpr, GROUP_P2: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
):
    """Combine ``n_parts`` partials (rows ``row0[g] + part``) of one GQA group into O: a runtime
    loop over chunks of SPLIT_CHUNK parts (bounded registers and code size at any count); two
    passes (max, then weighted sum), in part order: the result does not depend on which program
    combines."""
    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    g_ok = offs_g < group_size
    m = tl.full([GROUP_P2], float("-inf"), tl.float32)
    for start in range(0, n_parts, SPLIT_CHUNK):
        part = start + offs_c
        ok = g_ok[:, None] & (part[None, :] < n_parts)
        lse = tl.load(LSE_part + row0[:, None] + part[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
        m = tl.maximum(m, tl.max(lse, 1))
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all: all weights 0
    total = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], dtype=tl.float32)
    for start in range(0, n_parts, SPLIT_CHUNK):
        part = start + offs_c
        ok = g_ok[:, None] & (part[None, :] < n_parts)
        rows = row0[:, None] + part[None, :]
        weight = tl.exp2(tl.load(LSE_part + rows, mask=ok, other=float("-inf"), cache_modifier=".cg") - m[:, None])
        vals = tl.load(O_part + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0,
                       cache_modifier=".cg")
        total += tl.sum(weight, 1)
        acc += tl.sum(vals * weight[:, :, None], 1)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    head = kv_head * group_size + offs_g
    o_ptrs = O + batch.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_flat_kernel(
    Q, K, V, K_desc, V_desc, cache_seqlens, O, O_part, LSE_part, counters,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    k_rows_per_batch, k_rows_per_head, v_rows_per_batch, v_rows_per_head,
    batch_size, n_kv_heads, group_size, key_limit, qk_scale, window, n_programs, max_parts,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, GROUP_P2: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    TMA: tl.constexpr, EVICTION: tl.constexpr, MIN_BLOCKS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Balanced persistent decode: the BLOCK_N-key blocks that the *current* lengths fill (every
    (batch, kv head) sequence's visible keys, at least one block each, so an empty sequence still
    gets its zero output) are laid end to end in (batch, kv head) order and cut into
    P = min(n_programs, cdiv(total, MIN_BLOCKS)) equal ranges (to one block), one per program;
    programs past P do nothing. A range can span parts of several sequences: one partial per
    (program, sequence) it touches, at slot (program - first program of that sequence); the last
    part of a sequence to arrive combines (the fused epilogue's counter), a sequence inside one
    program's range is written directly. The cut depends only on the lengths (device side), so
    the grid is fixed (CUDA graphs) and a mostly empty cache still spreads over all SMs; the
    result does not depend on timing (fixed cut, combine in part order)."""
    wait_for_the_kernel_before(PDL)
    pid = tl.program_id(0)
    offs_b = tl.arange(0, BLOCK_B)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    b_ok = offs_b < batch_size
    n_all = tl.minimum(tl.load(cache_seqlens + offs_b, mask=b_ok, other=0), key_limit)
    n_all = tl.maximum(n_all, 0)
    if HAS_WINDOW:
        visible = tl.minimum(n_all, window)
    else:
        visible = n_all
    seq_blocks = tl.where(b_ok, tl.maximum((visible + BLOCK_N - 1) // BLOCK_N, 1), 0).to(tl.int64)
    batch_blocks = seq_blocks * n_kv_heads
    batch_end = tl.cumsum(batch_blocks, 0)
    total = tl.sum(batch_blocks, 0)
    n_prog = tl.minimum(n_programs, (total + MIN_BLOCKS - 1) // MIN_BLOCKS)
    pos = pid * total // n_prog
    end = (pid + 1) * total // n_prog
    if pid >= n_prog:
        end = pos
    head_ok = offs_g < group_size
    while pos < end:
        # The sequence holding block ``pos``: its batch (first batch ending past pos), kv head.
        batch = tl.sum(((batch_end <= pos) & b_ok).to(tl.int32), 0)
        at_b = offs_b == batch
        b_start = tl.sum(tl.where(at_b, batch_end - batch_blocks, 0), 0)
        nb = tl.sum(tl.where(at_b, seq_blocks, 0), 0)
        n_keys = tl.sum(tl.where(at_b, n_all, 0), 0)
        n_vis = tl.sum(tl.where(at_b, visible, 0), 0)
        kv_head = ((pos - b_start) // nb).to(tl.int32)
        seq_start = b_start + kv_head * nb
        seq_end = seq_start + nb
        seg_end = tl.minimum(end, seq_end)
        first_key = n_keys - n_vis
        lo = (first_key + (pos - seq_start) * BLOCK_N).to(tl.int32)
        hi = tl.minimum(first_key + (seg_end - seq_start) * BLOCK_N, n_keys).to(tl.int32)

        head = kv_head * group_size + offs_g
        q_ptrs = Q + batch.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_base = K + batch.to(tl.int64) * stride_kb + kv_head * stride_kh
        v_base = V + batch.to(tl.int64) * stride_vb + kv_head * stride_vh
        m_i = tl.full([BLOCK_G], _M_INIT, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        k_row = batch * k_rows_per_batch + kv_head * k_rows_per_head
        v_row = batch * v_rows_per_batch + kv_head * v_rows_per_head
        m_i, l_i, acc = _attend_span(q, m_i, l_i, acc, qk_scale, k_base, v_base, stride_ks, stride_vs, K_desc, V_desc,
                                     k_row, v_row, lo, hi, offs_n, offs_d, BLOCK_N, TMA, True, EVICTION, UPCAST)

        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        # Programs covering this sequence: the last program starting at or before its first and
        # last block (every program's range is non-empty: n_prog <= total).
        p_first = ((seq_start + 1) * n_prog - 1) // total
        p_last = (seq_end * n_prog - 1) // total
        n_parts = (p_last - p_first + 1).to(tl.int32)
        if n_parts == 1:
            o_ptrs = O + batch.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=head_ok[:, None])
        else:
            lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
            row = (batch * n_kv_heads * group_size + head).to(tl.int64) * max_parts + (pid - p_first)
            tl.store(O_part + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
            tl.store(LSE_part + row, lse, mask=head_ok)
            # Same release/acquire handshake as the split kernel's fused epilogue.
            tl.debug_barrier()
            seq = batch * n_kv_heads + kv_head
            arrived = tl.atomic_add(counters + seq, 1, sem="acq_rel", scope="gpu")
            if arrived == n_parts - 1:
                offs_gp = tl.arange(0, GROUP_P2)
                row0 = (batch * n_kv_heads * group_size + kv_head * group_size + offs_gp).to(tl.int64) * max_parts
                _combine_parts_loop(O_part, LSE_part, O, stride_ob, stride_oh, batch, kv_head, group_size, row0,
                                    n_parts, HEAD_DIM, GROUP_P2, SPLIT_CHUNK)
                tl.atomic_xchg(counters + seq, 0, sem="relaxed", scope="gpu")
        pos = seg_end


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
        sm_count = num_sms(device.index if device.index is not None else torch.cuda.current_device())
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


# head_dim 128 (Llama-3-8B shapes): 128-key TMA tiles, 3 stages (136 KiB of shared memory, one
# program per SM). Of 14 variants timed against SDPA on an H100 (2026-11-23, NOTES-attention.md,
# session 4) the only one >= 1.0x at every point of batch 1 and 8, 1k-32k: 1.001-1.314x; the pointer
# kernel before it (64, 4, 3, 2) was 0.989-0.990x at batch 8, 16k-32k. head_dim 64 and 256: untimed.
# Session 5 (same H100 type, run 2): split_by_fill (on by default) costs 0-2 % at full caches
# (1.207 vs 1.233x SDPA at batch 8, 1k; <= 0.3 % at 16k-32k) and runs a 4k-of-32k cache 2.96x
# faster at batch 1 (1.307 vs 0.442x SDPA), 6 % at batch 8; the flat schedule, 2 stages, 8 warps
# and 256-key tiles all lost at batch 8, 32k (0.984-0.998x vs 1.002 / 0.997-0.998x).
DEFAULT_DECODE_D128 = DecodeConfig(128, 4, 3, 1, loads="tma")


def _decode_config(head_dim: int, element_size: int = 2) -> DecodeConfig:
    """The split kernel's config for a head_dim (and the cache's element size)."""
    if _INTERPRETED:
        return DecodeConfig(64, 4, 1, 2)
    if element_size == 4:
        # fp32 caches: the 16-bit configs overflow shared memory (278 KB asked at head_dim 64 on
        # an H100, which has 227 KB); 16-key blocks in 2 stages (1 at head_dim 256) fit.
        return DecodeConfig(16, 4, 2 if head_dim <= 128 else 1, 1)
    if head_dim == 256:
        return DecodeConfig(32, 4, 2, 2)
    if head_dim == 128:
        return DEFAULT_DECODE_D128
    return DecodeConfig(64, 4, 3, 2)


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
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Inside a capture torch.zeros only records its memset: eager launches afterwards would
            # read uninitialized counters.
            raise RuntimeError(
                f"decode attention needs {groups} combine counters, more than allocated before this CUDA "
                "graph capture; run one eager decode step with the same batch size before capturing")
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = torch.zeros(max(groups, 4096), dtype=torch.int32, device=device)
        _GROUP_COUNTERS[device] = counters
    return counters


def cache_rows(cache: torch.Tensor) -> tuple[int, int] | None:
    """(rows per batch, rows per kv head) when the (B, Hkv, capacity, D) cache can be read as one
    2-D row array (row = stride(2) elements, 16-byte aligned, as a TMA descriptor needs); None
    otherwise (the caller falls back to pointer loads)."""
    batch, n_heads, capacity, _ = cache.shape
    stride_b, stride_h, stride_s = cache.stride(0), cache.stride(1), cache.stride(2)
    if stride_s <= 0 or (stride_s * cache.element_size()) % 16 or cache.data_ptr() % 16:
        return None
    per_batch = stride_b // stride_s if batch > 1 else 0
    per_head = stride_h // stride_s if n_heads > 1 else 0
    if (batch > 1 and stride_b % stride_s) or (n_heads > 1 and stride_h % stride_s) or min(per_batch, per_head) < 0:
        return None
    if (batch - 1) * per_batch + (n_heads - 1) * per_head + capacity >= 2**31:
        return None  # descriptor coordinates are int32
    return per_batch, per_head


def _row_descriptor(cache: torch.Tensor, rows: tuple[int, int], block_n: int) -> TensorDescriptor:
    per_batch, per_head = rows
    batch, n_heads, capacity, head_dim = cache.shape
    n_rows = (batch - 1) * per_batch + (n_heads - 1) * per_head + capacity
    # A tensor over the cache's storage but not a view of it: a view keeps its base tensor alive
    # (``_base``), so a cached descriptor would pin the caller's cache object and its weak
    # reference would never fire (a whole static KV cache held after ``generate`` returned).
    rows_2d = torch.empty(0, dtype=cache.dtype, device=cache.device).set_(
        cache.untyped_storage(), cache.storage_offset(), (n_rows, head_dim), (cache.stride(2), 1))
    return TensorDescriptor(rows_2d, [n_rows, head_dim], [cache.stride(2), 1], [block_n, head_dim])


# Eager calls build a TMA descriptor per cache (~5 us each on the host) plus the row view check:
# cached per cache *object* (a static cache's layer tensors persist across decode steps). The
# entry's key holds the tensor's address, shapes, strides and dtype, so an in-place ``set_`` or
# resize misses it; a weak reference drops the entry (and with it the descriptor's view, which
# would otherwise keep the storage alive) when the caller frees the cache. Bounded: cleared when full.
_DESCRIPTORS: dict = {}
_MAX_DESCRIPTORS = 1024


def _cache_descriptor(cache: torch.Tensor, block_n: int):
    """((rows per batch, rows per head), TensorDescriptor) for TMA over ``cache``, or None when the
    row view does not exist."""
    key = (id(cache), block_n)
    layout = (cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.dtype, cache.device)
    hit = _DESCRIPTORS.get(key)
    if hit is not None and hit[0]() is cache and hit[1] == layout:
        return hit[2]
    rows = cache_rows(cache)
    value = None if rows is None else (rows, _row_descriptor(cache, rows, block_n))
    if len(_DESCRIPTORS) >= _MAX_DESCRIPTORS:
        _DESCRIPTORS.clear()
    try:
        ref = weakref.ref(cache, lambda _, key=key: _DESCRIPTORS.pop(key, None))
    except TypeError:  # not weak-referenceable (a tensor subclass): no caching
        return value
    _DESCRIPTORS[key] = (ref, layout, value)
    return value


def _descriptors(config: DecodeConfig, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """(tma, k_desc, v_desc, k_rows, v_rows): TMA descriptors when asked for and possible, else the
    caches themselves (pointer loads) and zero row strides."""
    if config.loads == "tma":
        k_hit = _cache_descriptor(k_cache, config.block_n)
        v_hit = _cache_descriptor(v_cache, config.block_n) if k_hit is not None else None
        if k_hit is not None and v_hit is not None:
            return True, k_hit[1], v_hit[1], k_hit[0], v_hit[0]
    return False, k_cache, v_cache, (0, 0), (0, 0)


@on_its_gpu
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
    window: int | None = None,
    max_seqlen: int | None = None,
    block_config: DecodeConfig | tuple[int, int, int, int] | None = None,
    n_splits: int | None = None,
    fuse_combine: bool = True,
) -> torch.Tensor:
    """Launch split-KV decode; see ``reference_attention.decode_attention`` for the math.

    ``max_seqlen`` (host-side bound on ``cache_seqlens``) both checks for cache overflow and
    sizes the splits; without it the grid covers the whole capacity (CUDA-graph friendly).
    ``block_config`` (a ``DecodeConfig``, or the tuple (BLOCK_N, num_warps, num_stages,
    programs_per_sm) of pointer loads) overrides the tuning and ``n_splits`` the split plan
    (benchmarks and tests). One launch: the splits' partials are combined by the last program of
    each group to finish (``fuse_combine=False``: by a second kernel, as first built; kept for A/B
    timing).
    """
    check_decode_inputs(q, k_cache, v_cache, cache_seqlens, window, max_seqlen)
    if q.numel() == 0:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    batch, n_q_heads, head_dim = q.shape
    n_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    group = n_q_heads // n_kv_heads
    max_keys = max_seqlen if max_seqlen is not None else capacity
    span = min(max_keys, window) if window is not None else max_keys
    config = DecodeConfig.of(block_config) if block_config is not None else _decode_config(head_dim, k_cache.element_size())
    block_n = config.block_n
    # The flat schedule cuts the filled blocks on the device. Its pointer-load loop is not
    # software-pipelined by Triton (nested in the segment loop; TMA loads are): a TMA config over
    # a cache without the row view runs the split schedule's pointer kernel instead.
    flat = config.schedule == "flat" and n_splits is None
    if flat and config.loads == "tma" and not _descriptors(config, k_cache, v_cache)[0]:
        flat = False
    if flat:
        pass
    elif n_splits is None:
        split_len, n_splits = decode_split_plan(batch, n_kv_heads, span, q.device, block_n, config.programs_per_sm)
    else:
        n_blocks = triton.cdiv(max(span, 1), block_n)
        split_len = triton.cdiv(n_blocks, max(1, min(n_splits, n_blocks))) * block_n
        n_splits = triton.cdiv(max(span, 1), split_len)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if flat:
        return _decode_flat(q, k_cache, v_cache, cache_seqlens, scale, window, max_keys, config, out)
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
    tma, k_desc, v_desc, k_rows, v_rows = _descriptors(config, k_cache, v_cache)
    pdl = launch.pdl_enabled()
    _decode_split_kernel[(batch * n_kv_heads, n_splits)](
        q, k_cache, v_cache, k_desc, v_desc, cache_seqlens, out, o_part, lse_part, counters,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        *k_rows, *v_rows,
        n_kv_heads, group, max_keys, split_len, n_splits, float(scale) * LOG2E,
        window if window is not None else 0,
        HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        HAS_WINDOW=window is not None, UPCAST=_INTERPRETED, EPILOGUE=epilogue,
        GROUP_P2=group_p2, BLOCK_SPLITS=block_splits, SPLIT_CHUNK=split_chunk,
        TMA=tma, K_ROWS=tma or config.k_rows, EVICTION="evict_first" if config.evict_first else "",
        PREFETCH_FIRST=config.prefetch_first and window is None,
        SPLIT_BY_FILL=config.split_by_fill and not (config.prefetch_first and window is None),
        PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, **(launch.pdl_options(pdl) or {}),
    )
    if epilogue == EPILOGUE_PARTIAL:
        _decode_combine_kernel[(batch * n_q_heads,)](
            o_part, lse_part, out, out.stride(0), out.stride(1), n_q_heads, n_splits,
            HEAD_DIM=head_dim, SPLIT_CHUNK=16, num_warps=4,
        )
    return out


def flat_programs(device: torch.device, programs_per_sm: int) -> int:
    """Grid of the flat schedule: one program per resident slot (a few under the interpreter,
    so that ranges cross sequence boundaries in the tests)."""
    if device.type == "cuda":
        return programs_per_sm * num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 5


def _decode_flat(q, k_cache, v_cache, cache_seqlens, scale, window, max_keys, config, out):
    """Launch ``_decode_flat_kernel`` (schedule="flat"): fixed grid, device-side balanced cut."""
    batch, n_q_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[1]
    group = n_q_heads // n_kv_heads
    block_n = config.block_n
    n_programs = flat_programs(q.device, config.programs_per_sm)
    # Parts per sequence <= ceil(P / n_kv_heads) + 1: a batch's kv heads have equal lengths, so one
    # sequence holds at most 1 / n_kv_heads of all blocks.
    max_parts = triton.cdiv(n_programs, n_kv_heads) + 1
    rows = batch * n_q_heads * max_parts
    workspace = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=q.device)
    o_part, lse_part = workspace[: rows * head_dim], workspace[rows * head_dim :]
    counters = _group_counters(q.device, batch * n_kv_heads)
    group_p2 = triton.next_power_of_2(group)
    split_chunk = max(1, min(triton.next_power_of_2(max_parts), COMBINE_CHUNK_FLOATS // (group_p2 * head_dim)))
    split_chunk = 1 << (split_chunk.bit_length() - 1)  # a power of two
    tma, k_desc, v_desc, k_rows, v_rows = _descriptors(config, k_cache, v_cache)
    pdl = launch.pdl_enabled()
    _decode_flat_kernel[(n_programs,)](
        q, k_cache, v_cache, k_desc, v_desc, cache_seqlens, out, o_part, lse_part, counters,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        *k_rows, *v_rows,
        batch, n_kv_heads, group, max_keys, float(scale) * LOG2E, window if window is not None else 0,
        n_programs, max_parts,
        HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_B=triton.next_power_of_2(batch), HAS_WINDOW=window is not None, UPCAST=_INTERPRETED,
        GROUP_P2=group_p2, SPLIT_CHUNK=split_chunk, TMA=tma,
        EVICTION="evict_first" if config.evict_first else "", MIN_BLOCKS=config.min_blocks,
        PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, **(launch.pdl_options(pdl) or {}),
    )
    return out
