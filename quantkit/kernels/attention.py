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

Decode (``decode_attention``, split-KV flash-decoding in one launch) lives in
``attention_decode.py``; its public names are re-exported here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels.attention_decode import (
    _GROUP_COUNTERS,
    _INTERPRETED,
    _M_INIT,
    _RETIRED_COUNTERS,
    COMBINE_CHUNK_FLOATS,
    EPILOGUE_FINAL,
    EPILOGUE_FUSED,
    EPILOGUE_PARTIAL,
    FUSED_COMBINE_MAX_FLOATS,
    LOG2E,
    DecodeConfig,
    _decode_config,
    _group_counters,
    decode_attention,
    decode_epilogue,
    decode_split_plan,
)
from quantkit.kernels.call_cache import SignatureCache, contiguous_strides
from quantkit.kernels.launch import CachedLaunch, aligned, cdiv, int_spec, on_its_gpu
from quantkit.kernels.reference_attention import check_prefill_inputs

# Decode names stay importable from here (callers and tests predate the split).
__all__ = [
    "flash_attention", "decode_attention", "decode_split_plan", "decode_epilogue", "DecodeConfig",
    "EPILOGUE_FINAL", "EPILOGUE_FUSED", "EPILOGUE_PARTIAL", "FUSED_COMBINE_MAX_FLOATS", "COMBINE_CHUNK_FLOATS",
    "LOG2E", "_decode_config", "_group_counters", "_GROUP_COUNTERS", "_RETIRED_COUNTERS", "_prefill_config",
]


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


def _prefill_config(head_dim: int, element_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a head_dim on Hopper-class GPUs."""
    if _INTERPRETED:
        # The interpreter's cost is per program: few, big blocks.
        return 64, 64, 4, 1
    if element_size == 4:
        # fp32 tiles are twice the size: the 16-bit configs' 3 stages of 128-wide K and V tiles
        # would ask for 448 KB of shared memory at head_dim 128 (the H100 has 227 KB).
        return (64, 32, 4, 2) if head_dim <= 128 else (64, 16, 4, 2)
    if head_dim == 64:
        return 128, 64, 4, 3
    if head_dim == 128:
        return 128, 128, 8, 3  # best of a 6-config sweep on an H100 (benchmarks/NOTES-attention.md)
    return 64, 32, 4, 2  # head_dim 256: keep q, k, v tiles inside shared memory


_FLASH_PREFILL = CachedLaunch(_flash_prefill_kernel)
# Validated batched calls without block_config (call_cache.SignatureCache): grid, integer
# arguments, constexprs and the launch key follow from q/k/v's shapes, strides, dtypes, device
# and the window; only the pointers' alignment is read per call.
_CALLS = SignatureCache()


@on_its_gpu
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
    varlen = cu_seqlens_q is not None
    if not varlen and cu_seqlens_k is None and block_config is None:
        # type(window): a float window equal to a valid int one must still be refused.
        signature = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype,
                     q.device, k.device, v.device, type(window), window)
        call = _CALLS.get(signature)
        if call is None:
            call = _CALLS.add(signature, _prefill_call(q, k, v, window, None, None, None, None))
    else:
        call = _prefill_call(q, k, v, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_config)
    # Sizes as separate ints: torch parses them ~1.5 us faster than a torch.Size (session 6).
    out = torch.empty(*q.shape, dtype=q.dtype, device=q.device)
    grid, ints, constexprs, num_warps, num_stages, key = call
    if grid is not None:
        cu_q, cu_k = (cu_seqlens_q, cu_seqlens_k) if varlen else (q, q)  # never read when not IS_VARLEN
        _FLASH_PREFILL((key, aligned(q, k, v, out, cu_q, cu_k)), grid,
                       (q, k, v, out, cu_q, cu_k, *ints, float(scale) * LOG2E, window if window is not None else 0),
                       constexprs, num_warps, num_stages)
    return out


def _prefill_call(q, k, v, window, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, block_config) -> tuple:
    """Validate; (grid or None for empty inputs, integer arguments, constexprs, num_warps, num_stages)."""
    check_prefill_inputs(q, k, v, window, cu_seqlens_q, cu_seqlens_k)
    varlen = cu_seqlens_q is not None
    # The output is allocated contiguous, in q's shape.
    out_strides = contiguous_strides(q.shape)
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
        o_strides = (0, out_strides[1], out_strides[0])
    else:
        batch, n_q_heads, seqlen_q, head_dim = q.shape
        n_kv_heads, seqlen_k = k.shape[1], k.shape[2]
        q_strides = (q.stride(0), q.stride(1), q.stride(2))
        k_strides = (k.stride(0), k.stride(1), k.stride(2))
        v_strides = (v.stride(0), v.stride(1), v.stride(2))
        o_strides = out_strides[:3]
    block_m, block_n, num_warps, num_stages = block_config or _prefill_config(head_dim, q.element_size())
    if q.numel() == 0:
        return None, (), {}, num_warps, num_stages, None
    grid = (batch * n_q_heads, cdiv(seqlen_q, block_m))
    # Every integer argument in signature order; the float scale (not specialized) goes per call.
    ints = (*q_strides, *k_strides, *v_strides, *o_strides, seqlen_q, seqlen_k, n_q_heads, n_q_heads // n_kv_heads)
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, IS_VARLEN=varlen,
                      HAS_WINDOW=window is not None, UPCAST=_INTERPRETED)
    # What triton specializes the binary on besides pointer alignment: dtypes, each integer's
    # int_spec (not its value: a new sequence length must not add a cache entry; the window is
    # the last argument), constexprs.
    key = (q.dtype, k.dtype, v.dtype, None if cu_seqlens_q is None else (cu_seqlens_q.dtype, cu_seqlens_k.dtype),
           tuple(int_spec(i) for i in (*ints, window if window is not None else 0)), *constexprs.values(),
           num_warps, num_stages)
    return grid, ints, constexprs, num_warps, num_stages, key

