"""Writing a step's keys and values into a static KV cache: both tensors in one launch.

    k_cache[b, h, positions[s], :D] = k[b, h, s, :]      (and the same for v)

for k, v (B, Hkv, S, D) and caches (B, Hkv, capacity, Dc >= D) (``generate.StaticKVCache`` keeps
its buffers at the attention kernels' padded head size). The torch twin,
``reference_attention.write_kv_cache``, is two ``index_copy_`` calls: two launches per layer and
step, 64 of the ~410 in a Llama-3-8B decode step (0.15 ms of 3.17 on an H200,
benchmarks/results/decode_profile_s44_h200.json). One program per (block of positions, batch x
kv head) copies its rows of k and then of v. A position outside [0, capacity) writes nothing,
where the twin raises (``index_copy_``): callers check lengths on the host
(``generate.check_lengths``).

Under programmatic dependent launch (``launch.PDL``) the kernel waits for the one before it (RoPE,
which writes k) before its first load, and the attention kernel after it waits for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels import launch
from quantkit.kernels.call_cache import SignatureCache
from quantkit.kernels.dependent_launch import wait_for_the_kernel_before
from quantkit.kernels.launch import INTERPRETED, CachedLaunch, aligned, cdiv, int_spec, next_power_of_2, on_its_gpu
from quantkit.kernels.reference_attention import check_kv_cache_write_inputs


@triton.jit
def _copy_rows(SRC, DST, src_off, dst_off, stride_ss, stride_ds, offs_s, slots, row_ok, offs_d, d_ok):
    rows = tl.load(SRC + src_off + offs_s[:, None] * stride_ss + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :])
    tl.store(DST + dst_off + slots[:, None] * stride_ds + offs_d[None, :], rows, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _kv_cache_write_kernel(
    K, V, K_CACHE, V_CACHE, POSITIONS,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs, stride_p,
    n_heads, seqlen, head_dim, capacity,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_the_kernel_before(PDL)
    # Position blocks on grid axis 0 (up to 2**31 - 1 programs; axis 1 stops at 65535).
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    batch = (tl.program_id(1) // n_heads).to(tl.int64)
    head = (tl.program_id(1) % n_heads).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < seqlen
    slots = tl.load(POSITIONS + offs_s * stride_p, mask=s_ok, other=0)
    row_ok = s_ok & (slots >= 0) & (slots < capacity)
    d_ok = offs_d < head_dim
    _copy_rows(K, K_CACHE, batch * stride_kb + head * stride_kh, batch * stride_kcb + head * stride_kch,
               stride_ks, stride_kcs, offs_s, slots, row_ok, offs_d, d_ok)
    _copy_rows(V, V_CACHE, batch * stride_vb + head * stride_vh, batch * stride_vcb + head * stride_vch,
               stride_vs, stride_vcs, offs_s, slots, row_ok, offs_d, d_ok)


_WRITE = CachedLaunch(_kv_cache_write_kernel)
# Validated calls: grid, integer arguments, constexprs and key follow from the shapes, strides,
# dtypes and devices; only the pointers' alignment and the PDL setting are read per call.
_CALLS = SignatureCache()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


@on_its_gpu
def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   positions: torch.Tensor) -> None:
    """Write k and v into the caches at slots ``positions`` in one launch; see the module doc."""
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    signature = (k.shape, k.stride(), v.shape, v.stride(), k_cache.shape, k_cache.stride(), v_cache.shape,
                 v_cache.stride(), positions.shape, positions.stride(), k.dtype, v.dtype, k_cache.dtype,
                 v_cache.dtype, positions.dtype, k.device, v.device, k_cache.device, v_cache.device, positions.device)
    call = _CALLS.get(signature)
    if call is None:
        call = _CALLS.add(signature, _write_call(k, v, k_cache, v_cache, positions))
    grid, ints, constexprs, key = call
    if grid is None:
        return
    pdl = launch.pdl_enabled()
    _WRITE((key, pdl, aligned(k, v, k_cache, v_cache, positions)), grid, (k, v, k_cache, v_cache, positions, *ints),
           {**constexprs, "PDL": pdl}, 4, 1, options=launch.pdl_options(pdl))


def _write_call(k, v, k_cache, v_cache, positions) -> tuple:
    """(grid or None when there is nothing to write, integer arguments, constexprs, launch key)."""
    check_kv_cache_write_inputs(k, v, k_cache, v_cache, positions)
    batch, n_heads, seqlen, head_dim = k.shape
    if k.numel() == 0:
        return None, (), {}, None
    launch.check_runnable(k, "k")
    block_d = next_power_of_2(head_dim)
    # Rows of one (batch, head) per program: 2048 elements of k and of v (64 rows under the
    # interpreter, where cost is per program); a decode step (S = 1) is one row per program.
    block_s = min(64 if INTERPRETED else max(1, 2048 // block_d), next_power_of_2(seqlen))
    ints = (*k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], positions.stride(0),
            n_heads, seqlen, head_dim, k_cache.shape[2])
    grid = (cdiv(seqlen, block_s), batch * n_heads)
    constexprs = {"BLOCK_S": block_s, "BLOCK_D": block_d}
    key = (k.dtype, positions.dtype, tuple(int_spec(i) for i in ints), block_s, block_d)
    return grid, ints, constexprs, key
