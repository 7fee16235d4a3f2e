"""Rotary position embedding applied to q and k in one launch (rotate-half, HF Llama/Gemma).

For each position the rotation needs cos/sin once; one program takes a block of positions of
one sequence, loads their cos/sin halves once and walks over every q head and then every k
head, so cos/sin are read from memory once instead of once per head. The math, per head and
position, with ``x = [x1, x2]`` split at ``D / 2`` and HF's cos/sin (both halves stored):

    out1 = x1 * cos[:D/2] - x2 * sin[:D/2]
    out2 = x2 * cos[D/2:] + x1 * sin[D/2:]

written to round as HF's eager ``q * cos + rotate_half(q) * sin`` rounds: each product, then the
sum, to the input dtype (each computed in float32, as PyTorch's 16-bit elementwise kernels do).
The roundings are done on the float32 bits (``_round_to_grid``), not by a float32 -> 16-bit ->
float32 round trip: on an H100 with triton 3.6 the round-trip version was not bit-equal to HF
(``benchmarks/results/rope_check_h100.json``, 0 of 6 shapes), consistent with the compiler
dropping the round trips and contracting into FMAs. Bit operations cannot be folded away, and
the kernel is compiled without FMA contraction, so float32 inputs also round as torch does: the
same H100 check then gave HF's bits in 9 of 9 cases (bf16, fp16, fp32; prefill and decode
shapes; ``rope_check_s4_h100.json``).
Inputs may be strided views (HF's (B, H, S, D) after a transpose); outputs are new contiguous
tensors. Under programmatic dependent launch (``launch.PDL``) the kernel waits for the one
before it before its first load.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from quantkit.kernels import launch
from quantkit.kernels.call_cache import SignatureCache, contiguous_strides
from quantkit.kernels.dependent_launch import wait_for_the_kernel_before
from quantkit.kernels.launch import CachedLaunch, aligned, cdiv, int_spec, next_power_of_2, num_sms, on_its_gpu
from quantkit.kernels.quant import round_half_even, round_to_bf16_grid
from quantkit.kernels.reference_attention import check_rope_inputs

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_to_fp16_grid(x):
    """Round fp32 to the nearest float16 value (ties to even), still as fp32, through its bits.

    Normal range: drop 13 of the 23 mantissa bits with round-half-even. Below 2**-14 float16 is
    subnormal with a fixed spacing of 2**-24: scale, round to an integer, scale back (exact).
    """
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 13) & 1
    normal = ((bits + 0xFFF + lsb) & -8192).to(tl.float32, bitcast=True)
    subnormal = round_half_even(x * 16777216.0) * 5.9604644775390625e-08
    subnormal = tl.where(x < 0, -tl.abs(subnormal), subnormal)
    return tl.where(tl.abs(x) < 6.103515625e-05, subnormal, normal)


@triton.jit
def _round_to_grid(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE's nearest value (still fp32): the later cast to DTYPE is exact."""
    if DTYPE == tl.bfloat16:
        return round_to_bf16_grid(x)
    elif DTYPE == tl.float16:
        return _round_to_fp16_grid(x)
    else:
        return x


@triton.jit
def _rotate_heads(
    X, OUT, x_off, o_off, stride_xh, stride_xs, stride_oh, stride_os, head_lo, head_hi,
    offs_s, offs_h, s_ok, cos1, cos2, sin1, sin2, HALF: tl.constexpr,
):
    for head in range(head_lo, head_hi):
        x_ptrs = X + x_off + head * stride_xh + offs_s[:, None] * stride_xs + offs_h[None, :]
        x1 = tl.load(x_ptrs, mask=s_ok[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(x_ptrs + HALF, mask=s_ok[:, None], other=0.0).to(tl.float32)
        o_ptrs = OUT + o_off + head * stride_oh + offs_s[:, None] * stride_os + offs_h[None, :]
        dtype = OUT.dtype.element_ty
        # Round each product, then the sum, to the output dtype, as HF's eager ops do.
        x1c = _round_to_grid(x1 * cos1, dtype)
        x2s = _round_to_grid(x2 * sin1, dtype)
        x2c = _round_to_grid(x2 * cos2, dtype)
        x1s = _round_to_grid(x1 * sin2, dtype)
        tl.store(o_ptrs, _round_to_grid(x1c - x2s, dtype).to(dtype), mask=s_ok[:, None])
        tl.store(o_ptrs + HALF, _round_to_grid(x2c + x1s, dtype).to(dtype), mask=s_ok[:, None])


@triton.jit
def _rope_kernel(
    Q, K, COS, SIN, Q_OUT, K_OUT,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_cb, stride_cs, stride_sb, stride_ss,
    stride_qob, stride_qoh, stride_qos,
    stride_kob, stride_koh, stride_kos,
    seqlen, n_q_heads, n_kv_heads, heads_per_program,
    HALF: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_the_kernel_before(PDL)
    batch = tl.program_id(0).to(tl.int64)
    # Heads [first, last) of the q heads followed by the k heads; empty ranges loop zero times.
    first = tl.program_id(2) * heads_per_program
    last = tl.minimum(first + heads_per_program, n_q_heads + n_kv_heads)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_h = tl.arange(0, HALF)
    s_ok = offs_s < seqlen
    cos_ptrs = COS + batch * stride_cb + offs_s[:, None] * stride_cs + offs_h[None, :]
    sin_ptrs = SIN + batch * stride_sb + offs_s[:, None] * stride_ss + offs_h[None, :]
    # cos/sin upcast at once: also avoids bf16 arithmetic in the CPU interpreter.
    cos1 = tl.load(cos_ptrs, mask=s_ok[:, None], other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptrs + HALF, mask=s_ok[:, None], other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptrs, mask=s_ok[:, None], other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptrs + HALF, mask=s_ok[:, None], other=0.0).to(tl.float32)
    _rotate_heads(Q, Q_OUT, batch * stride_qb, batch * stride_qob, stride_qh, stride_qs, stride_qoh, stride_qos,
                  tl.minimum(first, n_q_heads), tl.minimum(last, n_q_heads),
                  offs_s, offs_h, s_ok, cos1, cos2, sin1, sin2, HALF)
    _rotate_heads(K, K_OUT, batch * stride_kb, batch * stride_kob, stride_kh, stride_ks, stride_koh, stride_kos,
                  tl.maximum(first - n_q_heads, 0), tl.maximum(last - n_q_heads, 0),
                  offs_s, offs_h, s_ok, cos1, cos2, sin1, sin2, HALF)


def _heads_per_program(q: torch.Tensor, n_heads: int, position_programs: int) -> int:
    """Every head in one program (cos/sin loaded once) unless that leaves SMs idle (decode:
    batch x 1 position): then split the heads until there are ~2 programs per SM."""
    if not q.is_cuda:
        return n_heads
    target = 2 * num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
    groups = max(1, min(n_heads, target // position_programs))
    return cdiv(n_heads, groups)


_ROPE = CachedLaunch(_rope_kernel)
# No FMA contraction: each product is rounded on its own, as in torch's eager ops.
_OPTIONS = {"enable_fp_fusion": False}
# Validated calls (call_cache.SignatureCache): the grid, every integer argument, the constexprs
# and the launch key follow from the inputs' shapes, strides, dtypes and device (the outputs are
# allocated contiguous); only the pointers' alignment is read per call.
_CALLS = SignatureCache()


@on_its_gpu
def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               heads_per_program: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch RoPE on q and k; see ``reference_attention.apply_rope`` for the math.

    ``heads_per_program`` (tests) overrides the launch's split of the q + k heads over programs.
    """
    signature = (q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.shape, sin.stride(),
                 q.dtype, k.dtype, cos.dtype, sin.dtype, q.device, k.device, cos.device, sin.device, heads_per_program)
    call = _CALLS.get(signature)
    if call is None:
        call = _CALLS.add(signature, _rope_call(q, k, cos, sin, heads_per_program))
    # Sizes as separate ints: torch parses them ~1.5 us faster than a torch.Size (session 6).
    q_out = torch.empty(*q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(*k.shape, dtype=k.dtype, device=k.device)
    grid, ints, constexprs, key = call
    if grid is not None:
        # 4 warps; 3 stages is triton's default (the launch passed none before the cache).
        pdl = launch.pdl_enabled()
        _ROPE((key, pdl, aligned(q, k, cos, sin, q_out, k_out)), grid, (q, k, cos, sin, q_out, k_out, *ints),
              {**constexprs, "PDL": pdl}, 4, 3, options=launch.pdl_options(pdl, _OPTIONS))
    return q_out, k_out


def _rope_call(q, k, cos, sin, heads_per_program: int | None) -> tuple:
    """(grid or None for empty inputs, integer arguments, constexprs, launch key) of a validated call."""
    check_rope_inputs(q, k, cos, sin)
    batch, n_q_heads, seqlen, head_dim = q.shape
    n_kv_heads = k.shape[1]
    if q.numel() == 0:
        return None, (), {}, None
    block_s = min(64 if _INTERPRETED else 16, next_power_of_2(seqlen))
    position_programs = batch * cdiv(seqlen, block_s)
    n_heads = n_q_heads + n_kv_heads
    if heads_per_program is None:
        heads_per_program = _heads_per_program(q, n_heads, position_programs)
    if heads_per_program < 1:
        raise ValueError(f"heads_per_program={heads_per_program}; pass a positive number of heads")
    cos_batch_stride = 0 if cos.shape[0] == 1 else cos.stride(0)
    sin_batch_stride = 0 if sin.shape[0] == 1 else sin.stride(0)
    q_out_strides, k_out_strides = contiguous_strides(q.shape), contiguous_strides(k.shape)
    ints = (q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            cos_batch_stride, cos.stride(1), sin_batch_stride, sin.stride(1),
            *q_out_strides[:3], *k_out_strides[:3],
            seqlen, n_q_heads, n_kv_heads, heads_per_program)
    grid = (batch, cdiv(seqlen, block_s), cdiv(n_heads, heads_per_program))
    constexprs = {"HALF": head_dim // 2, "BLOCK_S": block_s}
    # What triton specializes the binary on besides pointer alignment: dtypes, each integer's
    # int_spec (not its value: a new sequence length must not add a cache entry), constexprs.
    key = (q.dtype, k.dtype, cos.dtype, sin.dtype, tuple(int_spec(i) for i in ints), head_dim // 2, block_s)
    return grid, ints, constexprs, key
