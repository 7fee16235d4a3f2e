"""Activation quantization kernels: per-token dynamic, static per-tensor, RMSNorm fused with
per-token quantization. Also the rounding helpers the GEMM epilogue shares.

Each kernel has a launcher (validate, allocate, pick the grid) and a torch twin in
``reference.py`` that defines what it computes; ``triton_ops.py`` registers the launchers as
torch.library custom ops.

Numerics match the reference bit for bit where the math allows it: the scale is
``max(amax / qmax, MIN_SCALE)`` and values are *divided* by it, rounded like IEEE division
(Triton's plain ``/`` is an approximate division on NVIDIA GPUs, which would move some values
across a rounding boundary), then rounded half-to-even like ``torch.round``. The dynamic
kernels divide with the row's reciprocal and one FMA correction (``divide_by_scale``), which
gives the correctly rounded quotient in three FMA-unit operations instead of ``div_rn``'s ~10
with a branch: these kernels move 3 bytes per element, and at H100 bandwidth the division was
most of their instruction budget (benchmarks/NOTES-quant.md).

With programmatic dependent launch (``launch.PDL``, sm_90+) the per-token and RMSNorm +
quantization kernels may be scheduled while the kernel before them ends; each waits for it
(``griddepcontrol.wait``) before its first load.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from quantkit.kernels import launch
from quantkit.kernels.call_cache import SignatureCache
from quantkit.kernels.dependent_launch import wait_for_the_kernel_before
from quantkit.kernels.launch import (INTERPRETED, CachedLaunch, aligned, cdiv, check_runnable, int_spec,
                                     next_power_of_2, on_its_gpu)
from quantkit.kernels.quant_checks import (MAX_SINGLE_PASS_K,  # noqa: F401 (re-exported)
                                           check_activation_input, check_per_tensor_scale, check_quant_dtype,
                                           check_rms_norm_args)
# Re-exported: check_eps and check_offset for triton_ops, the constants for callers.
from quantkit.kernels.reference import (FP8_MAX, INT8_MAX, MIN_SCALE, check_eps, check_offset,  # noqa: F401
                                        qmax_of)

# Chunk width of the static quantizer (and of the per-token kernel's short-row configs).
CHUNK_K = 4096
# Chunk width of the per-token kernel's two passes over rows past MAX_SINGLE_PASS_K (measured,
# NOTES-quant.md).
PER_TOKEN_CHUNK_K = 8192
# Per-token quantization keeps rows up to this K in float32 registers, warps from the block size;
# longer ones up to MAX_SINGLE_PASS_K 16-bit on 8 warps (per_token_launch_config).
SINGLE_PASS_PER_TOKEN_K = 8192
# tl.load / tl.store eviction policies of the ``evict`` launch option: what is read again (the
# first read of a chunked row, the norm weight) asks L1/L2 to keep it; the rest goes first.
KEEP_POLICY, STREAM_POLICY = "evict_last", "evict_first"


def is_interpreted() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1, read at import:
    the kernels are defined for one mode or the other)."""
    return INTERPRETED


def tl_dtype_of(dtype: torch.dtype):
    return {
        torch.float32: tl.float32,
        torch.float16: tl.float16,
        torch.bfloat16: tl.bfloat16,
        torch.int8: tl.int8,
        torch.float8_e4m3fn: tl.float8e4nv,
    }[dtype]


# ----------------------------------------------------------------------------------------------
# Shared @triton.jit helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def round_half_even(x):
    """Round fp32 to the nearest integer, ties to even, for |x| < 2**22.

    Adding and removing 1.5 * 2**23 pushes the fraction bits out of the fp32 mantissa, so the
    hardware's round-to-nearest-even addition does the rounding. libdevice's rint would do the
    same on the GPU but does not exist under the interpreter; this works on both.
    """
    return (x + 12582912.0) - 12582912.0


@triton.jit
def round_to_e4m3_grid(x):
    """Round fp32 (already clamped to +-448) onto the float8_e4m3fn grid, ties to even.

    Only needed under the interpreter, whose fp32 -> fp8 cast truncates: after this the cast is
    exact. e4m3 has 3 mantissa bits and its smallest normal exponent is -6, so the spacing of the
    grid around x is 2**(max(exponent(x), -6) - 3); scaling by powers of two is exact.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    ulp_exponent = tl.maximum(exponent, -6) - 3
    to_units = ((127 - ulp_exponent) << 23).to(tl.float32, bitcast=True)
    from_units = ((127 + ulp_exponent) << 23).to(tl.float32, bitcast=True)
    rounded = round_half_even(x * to_units) * from_units
    # (x + c) - c yields +0 for small negative x and for -0; torch keeps the sign (-0), so keep
    # it too (from the sign bit: -0 < 0 is false).
    return tl.where(bits < 0, -tl.abs(rounded), rounded)


@triton.jit
def round_to_bf16_grid(x):
    """Round fp32 to the nearest bfloat16 value (ties to even), still as fp32.

    The interpreter's fp32 -> bf16 cast truncates; pre-rounding makes it exact. The GPU's cast
    already rounds to nearest even; RoPE uses this on the GPU too, because bit operations cannot
    be folded away by the compiler the way a cast round trip can.
    """
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 16) & 1
    bits = (bits + 0x7FFF + lsb) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_for_store(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even on the GPU and under the interpreter alike."""
    if INTERPRETED and DTYPE == tl.bfloat16:
        x = round_to_bf16_grid(x)
    return x.to(DTYPE)


@triton.jit
def int8_clamp(scaled):
    """An fp32 quotient saturated to the reference's [INT8_MIN, INT8_MAX], NaN to 0 as in the twin:
    int8 has no NaN, and the GPU's max.f32 alone drops it (-128). Under a static scale the code is
    all that is left of the NaN. (A dynamic row holding a NaN gets a NaN scale, so its output is NaN
    whatever its codes; quantize_with_row_scale leaves them unspecified: its bitcast rounding of the
    GPU's canonical NaN, 0x7fffffff, gives -1.)"""
    return tl.where(scaled == scaled, tl.minimum(tl.maximum(scaled, -128.0), 127.0), 0.0)


@triton.jit
def quantize_with_scale(x, scale, IS_FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x / scale -> saturated, rounded int8 or float8_e4m3fn: an activation, so INT8 saturates to
    [-128, 127] and a NaN quotient is code 0 (the reference's ``cast_to_quantized(..., activation=True)``).
    FP8 on the GPU: the fp32 -> e4m3 conversion saturates to +-448 and keeps NaN, as torch's clamp and
    cast do (a tl.minimum / tl.maximum clamp would turn NaN into -448); the interpreter's cast
    truncates (and makes NaN a finite code), so there the value is clamped and put on the e4m3 grid
    first."""
    scaled = tl.math.div_rn(x, scale)
    if IS_FP8:
        return fp8_code(scaled, INTERPRETED)
    else:
        return round_half_even(int8_clamp(scaled)).to(tl.int8)


@triton.jit
def fp8_code(scaled, INTERPRETED: tl.constexpr):
    """An fp32 quotient as its saturated float8_e4m3fn code (see quantize_with_scale)."""
    if INTERPRETED:
        scaled = round_to_e4m3_grid(tl.minimum(tl.maximum(scaled, -448.0), 448.0))
    return scaled.to(tl.float8e4nv)


@triton.jit
def nan_maximum(a, b):
    """Elementwise max that keeps NaN, like torch's ``maximum`` (``tl.maximum`` drops it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def row_amax(x, axis: tl.constexpr):
    """max over ``axis`` that keeps NaN, like torch's ``amax``: a row holding a NaN (or an inf
    that the norm turned into one) gets a NaN scale, so the NaN reaches the GEMM's output
    instead of being hidden behind finite values."""
    return tl.reduce(x, axis, nan_maximum)


@triton.jit
def sum_and_nan_max(sum_a, max_a, sum_b, max_b):
    """The combine of one reduction that gives a row's sum (``tl.sum``'s) and its ``row_amax``."""
    return sum_a + sum_b, nan_maximum(max_a, max_b)


@triton.jit
def scale_from_amax(amax, QMAX: tl.constexpr, MIN_SCALE_C: tl.constexpr):
    """The reference's ``scale_from_amax``: ``max(amax / qmax, MIN_SCALE)`` with IEEE division
    (NaN stays NaN, as in torch's ``clamp_min``)."""
    return nan_maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE_C)


@triton.jit
def divide_by_scale(x, scale, inv_scale):
    """``x / scale`` rounded to nearest like IEEE division, given ``inv_scale = div_rn(1, scale)``.

    One multiply gives a quotient within about an ulp; the remainder ``x - scale * quotient`` is
    exact in an FMA, and one more FMA rounds ``quotient + remainder / scale`` correctly
    (Markstein's correction; it is the fast path of the GPU's own ``div.rn.f32`` minus its
    range check and branch, which only matter for quotients near the ends of the float32 range,
    far from the |x / scale| <= 448 used here). Checked bit for bit against IEEE division in the
    tests (near-tie and near-midpoint quotients included) and on the GPU.
    """
    quotient = x * inv_scale
    # The remainder is formed negated, scale * quotient - x, and multiplied by -inv_scale: for
    # x = -0 the product is then -0 and the final sum -0 + -0 keeps the sign that IEEE division
    # gives (x - scale * quotient is +0, and +0 + -0 = +0: another float8 bit pattern).
    # Negations are written as products with -1: Triton's unary minus is 0 - x, which is not a
    # negation at +0 and costs an FADD per element (on triton 3.6 it also pushed the whole-row
    # INT8 kernel to 110-201 registers); x * -1 folds into the FMA's operand modifier.
    negated_remainder = tl.fma(scale, quotient, x * -1.0)
    return tl.fma(negated_remainder, inv_scale * -1.0, quotient)


@triton.jit
def quantize_with_row_scale(x, scale, inv_scale, IS_FP8: tl.constexpr, FAST_DIVIDE: tl.constexpr,
                            INTERPRETED: tl.constexpr):
    """Quantize x with the scale derived from its own row's amax (|x| <= amax).

    Bit-equal to ``quantize_with_scale``. Because ``scale >= amax / qmax`` up to one rounding,
    ``|x / scale| <= qmax * (1 + 2**-23)``, which rounds onto the grid's end: no clamp needed.
    INT8: adding 1.5 * 2**23 rounds half-to-even and leaves the integer in the low bits of the
    float's pattern (0x4B400000 ends in a zero byte), so its low byte is already the int8.
    FP8: the GPU's fp32 -> e4m3 conversion rounds to nearest even and saturates.
    """
    if not FAST_DIVIDE:
        q = quantize_with_scale(x, scale, IS_FP8, INTERPRETED)
    elif IS_FP8:
        scaled = divide_by_scale(x, scale, inv_scale)
        if INTERPRETED:
            scaled = round_to_e4m3_grid(scaled)
        q = scaled.to(tl.float8e4nv)
    else:
        q = (divide_by_scale(x, scale, inv_scale) + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)
    return q


@triton.jit
def inverse_rms(sum_sq, K, eps):
    """``1 / sqrt(sum_sq / K + eps)`` with IEEE division and square root (the twin's rounding)."""
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(sum_sq, K + 0.0) + eps))


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, q_ptr, scale_ptr,
    M, K, stride_xm, stride_qm,
    QMAX: tl.constexpr, MIN_SCALE_C: tl.constexpr, IS_FP8: tl.constexpr,
    BLOCK_K: tl.constexpr, ROWS: tl.constexpr, SINGLE_PASS: tl.constexpr, KEEP_INPUT_DTYPE: tl.constexpr,
    FAST_DIVIDE: tl.constexpr, STAGES: tl.constexpr, KEEP: tl.constexpr, STREAM: tl.constexpr,
    INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_the_kernel_before(PDL)
    # ROWS rows per program: more bytes in flight per program for short rows.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    x_rows = x_ptr + rows[:, None] * stride_xm
    q_rows = q_ptr + rows[:, None] * stride_qm
    cols = tl.arange(0, BLOCK_K)[None, :]
    if SINGLE_PASS:
        mask = row_mask[:, None] & (cols < K)
        x_in = tl.load(x_rows + cols, mask=mask, other=0.0, eviction_policy=STREAM)
        if KEEP_INPUT_DTYPE and not INTERPRETED:
            # The row stays 16-bit in registers until it is quantized (half the registers per
            # row); only |x|, exact in float32, goes into the reduction (on triton 3.6 the
            # NaN-keeping max of two bf16 values is a float32, which a bf16 reduction rejects).
            amax = row_amax(tl.abs(x_in).to(tl.float32), 1)
        else:
            amax = row_amax(tl.abs(x_in.to(tl.float32)), 1)
        scale = scale_from_amax(amax, QMAX, MIN_SCALE_C)
        inv_scale = tl.math.div_rn(1.0, scale)
        q = quantize_with_row_scale(x_in.to(tl.float32), scale[:, None], inv_scale[:, None], IS_FP8, FAST_DIVIDE,
                                    INTERPRETED)
        tl.store(q_rows + cols, q, mask=mask, eviction_policy=STREAM)
    else:
        running_amax = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
        # STAGES > 1 software-pipelines the chunk loads (asynchronous copies through shared
        # memory): more of the row in flight per program.
        for start in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            mask = row_mask[:, None] & (start + cols < K)
            x = tl.load(x_rows + start + cols, mask=mask, other=0.0, eviction_policy=KEEP)
            running_amax = nan_maximum(running_amax, tl.abs(x.to(tl.float32)))
        amax = row_amax(running_amax, 1)
        scale = scale_from_amax(amax, QMAX, MIN_SCALE_C)
        inv_scale = tl.math.div_rn(1.0, scale)
        # Second pass over the row: it was read a moment ago, so it comes from L2, not memory.
        for start in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            mask = row_mask[:, None] & (start + cols < K)
            x = tl.load(x_rows + start + cols, mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
            q = quantize_with_row_scale(x, scale[:, None], inv_scale[:, None], IS_FP8, FAST_DIVIDE, INTERPRETED)
            tl.store(q_rows + start + cols, q, mask=mask, eviction_policy=STREAM)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


# A static scale in [2**-60, 2**60] takes the reciprocal path of quantize_with_static_scale; any
# other (a calibration's MIN_SCALE is 1e-12 ~ 2**-40) and a zero, negative, infinite or NaN one
# take IEEE division.
STATIC_SCALE_MIN = tl.constexpr(2.0**-60)
STATIC_SCALE_MAX = tl.constexpr(2.0**60)


@triton.jit
def quantize_with_static_scale(x, scale, inv_scale, IS_FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    """``quantize_with_scale`` bit for bit, for a scale in [STATIC_SCALE_MIN, STATIC_SCALE_MAX]
    with ``inv_scale = div_rn(1, scale)``: the quotient by divide_by_scale, three FMA-unit ops
    instead of div_rn's ~10 and a branch.

    Unlike a row's own scale, a static one does not bound |x / scale|. The correction is exact
    (its remainder representable) wherever the quotient can change the result, |x / scale| >= 2**-11
    (the grids' first rounding boundary is 2**-10 for e4m3, 0.5 for int8), up to 2**20. Past 2**20,
    and for an infinite or NaN x, the plain product x * inv_scale is kept: it saturates to the
    same end of the grid, or stays NaN. Below 2**-11 either form rounds to a zero of x's sign.
    FP8: the code as quantize_with_scale makes it (fp8_code). INT8: clamped, then rounded by the
    1.5 * 2**23 addition, whose float pattern holds the integer in its low byte
    (quantize_with_row_scale's trick). (With the same INT8 tail as quantize_with_scale's, LLVM
    merged the two paths' tails after the branch on the scale, and the INT8 kernel read 5-7 %
    slower at 16384x4096 and K = 14336 on the H200: session 42, benchmarks/NOTES-quant.md.)
    """
    quotient = x * inv_scale
    scaled = tl.where(tl.abs(quotient) <= 1048576.0, divide_by_scale(x, scale, inv_scale), quotient)  # 2**20
    if IS_FP8:
        return fp8_code(scaled, INTERPRETED)
    else:
        return (int8_clamp(scaled) + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def _quantize_per_tensor_kernel(
    x_ptr, q_ptr, scale_ptr,
    numel, K, stride_xm, stride_qm,
    IS_FP8: tl.constexpr, BLOCK_K: tl.constexpr, FLAT: tl.constexpr, INTERPRETED: tl.constexpr,
):
    if FLAT:
        # Rows packed back to back in x and q (stride K): blocks of the flattened tensor, no
        # masked lanes at the end of every row.
        offsets = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = offsets < numel
        x_ptrs = x_ptr + offsets
        q_ptrs = q_ptr + offsets
    else:
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = cols < K
        x_ptrs = x_ptr + row * stride_xm + cols
        q_ptrs = q_ptr + row * stride_qm + cols
    scale = tl.load(scale_ptr)
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if (scale >= STATIC_SCALE_MIN) & (scale <= STATIC_SCALE_MAX):
        q = quantize_with_static_scale(x, scale, tl.math.div_rn(1.0, scale), IS_FP8, INTERPRETED)
    else:
        q = quantize_with_scale(x, scale, IS_FP8, INTERPRETED)
    tl.store(q_ptrs, q, mask=mask)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, residual_ptr, new_residual_ptr, weight_ptr, q_ptr, scale_ptr,
    M, K, stride_xm, stride_rm, stride_nrm, stride_qm, eps, offset,
    QMAX: tl.constexpr, MIN_SCALE_C: tl.constexpr, IS_FP8: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr, FAST_DIVIDE: tl.constexpr,
    KEEP: tl.constexpr, STREAM: tl.constexpr, INTERPRETED: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_the_kernel_before(PDL)
    # KEEP / STREAM: cache eviction hints (or ""): the weight is read by every row, the rest once.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK_K)
    col_mask = cols < K
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0, eviction_policy=STREAM)
    if HAS_RESIDUAL:
        summed = x.to(tl.float32) + tl.load(
            residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0, eviction_policy=STREAM
        ).to(tl.float32)
        # The residual stream stays in the activation dtype (as in the model), and the norm
        # reads the rounded sum, exactly as the unfused model would.
        summed = cast_for_store(summed, x_ptr.dtype.element_ty, INTERPRETED)
        tl.store(new_residual_ptr + rows[:, None] * stride_nrm + cols[None, :], summed, mask=mask,
                 eviction_policy=STREAM)
        x = summed
    x = x.to(tl.float32)
    # normed = (x * (offset + w)) * rstd, in that order (the twin's): rstd > 0 and rounding is
    # monotone, so max|normed| == max|x * (offset + w)| * rstd exactly (the chunked kernel and
    # the one-pass reduction below rely on it).
    if HAS_RESIDUAL:
        rstd = inverse_rms(tl.sum(x * x, axis=1), K, eps)
        # One load of the weight serves ROWS rows.
        weight = offset + tl.load(weight_ptr + cols, mask=col_mask, other=0.0, eviction_policy=KEEP).to(tl.float32)
        weighted = x * weight[None, :]
        amax = row_amax(tl.abs(weighted), 1) * rstd
    else:
        # Both row reductions in one pass: x and the weight are dead once it starts, and only the
        # weighted row stays in registers through it. Fewer registers, more rows in flight per
        # SM: 1.03-1.09x on an H200 (benchmarks/NOTES-quant.md, session 43). With a residual the
        # same order was 1-5 % slower, and the weighted row formed before two reductions 1.2-1.3x
        # slower at K = 14336.
        weight = offset + tl.load(weight_ptr + cols, mask=col_mask, other=0.0, eviction_policy=KEEP).to(tl.float32)
        weighted = x * weight[None, :]
        if INTERPRETED:
            # The interpreter runs a tuple reduction as a sequential loop, tl.sum as np.sum. On the
            # GPU the tuple reduction has tl.sum's tree (bit-equal on the H200), which np.sum models
            # better than the loop.
            sum_sq, amax = tl.sum(x * x, axis=1), row_amax(tl.abs(weighted), 1)
        else:
            sum_sq, amax = tl.reduce((x * x, tl.abs(weighted)), 1, sum_and_nan_max)
        rstd = inverse_rms(sum_sq, K, eps)
        amax = amax * rstd
    scale = scale_from_amax(amax, QMAX, MIN_SCALE_C)
    inv_scale = tl.math.div_rn(1.0, scale)
    q = quantize_with_row_scale(weighted * rstd[:, None], scale[:, None], inv_scale[:, None], IS_FP8, FAST_DIVIDE,
                                INTERPRETED)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], q, mask=mask, eviction_policy=STREAM)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _rms_norm_quant_chunked_kernel(
    x_ptr, residual_ptr, new_residual_ptr, weight_ptr, q_ptr, scale_ptr,
    M, K, stride_xm, stride_rm, stride_nrm, stride_qm, eps, offset,
    QMAX: tl.constexpr, MIN_SCALE_C: tl.constexpr, IS_FP8: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr, TWO_PASS: tl.constexpr, FAST_DIVIDE: tl.constexpr,
    STAGES: tl.constexpr, KEEP: tl.constexpr, STREAM: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Long rows in BLOCK_K chunks: a row in registers (the whole-row kernel) caps the programs
    per SM at one or two; chunks keep many rows in flight and the later reads hit L2.

    Two passes (TWO_PASS): pass 1 sums squares and takes max|x * (offset + w)| together (the
    scale is that max times rstd, exactly: see ``_rms_norm_quant_kernel``); pass 2 quantizes.
    Three passes (the earlier design, kept for comparison): sum of squares, max|normed|,
    quantize; bit-equal to two passes. With a residual, pass 1 writes the new residual and the
    later passes read it back (one input instead of two, and correct when ``out_residual``
    aliases ``x`` or ``residual``).
    """
    wait_for_the_kernel_before(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    r_row = residual_ptr + row * stride_rm
    if HAS_RESIDUAL:
        normed_src = new_residual_ptr + row * stride_nrm
    else:
        normed_src = x_row
    sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    running_amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        mask = start + cols < K
        if HAS_RESIDUAL:
            # x and residual are read once; the new residual is read again.
            x = tl.load(x_row + start + cols, mask=mask, other=0.0, eviction_policy=STREAM)
            x = cast_for_store(x.to(tl.float32) + tl.load(r_row + start + cols, mask=mask, other=0.0,
                                                          eviction_policy=STREAM).to(tl.float32),
                               x_ptr.dtype.element_ty, INTERPRETED)
            tl.store(normed_src + start + cols, x, mask=mask, eviction_policy=KEEP)
        else:
            x = tl.load(x_row + start + cols, mask=mask, other=0.0, eviction_policy=KEEP)
        x = x.to(tl.float32)
        sum_sq += x * x
        if TWO_PASS:
            # The weight is re-read by every row: ask the caches to keep it.
            weight = offset + tl.load(weight_ptr + start + cols, mask=mask, other=0.0,
                                      eviction_policy="evict_last").to(tl.float32)
            running_amax = nan_maximum(running_amax, tl.abs(x * weight))
    rstd = inverse_rms(tl.sum(sum_sq, axis=0), K, eps)
    if HAS_RESIDUAL:
        # The next passes read the new residual that other threads of this program stored.
        tl.debug_barrier()
    if TWO_PASS:
        amax = row_amax(running_amax, 0) * rstd
    else:
        for start in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            mask = start + cols < K
            x = tl.load(normed_src + start + cols, mask=mask, other=0.0, eviction_policy=KEEP).to(tl.float32)
            weight = offset + tl.load(weight_ptr + start + cols, mask=mask, other=0.0,
                                      eviction_policy="evict_last").to(tl.float32)
            running_amax = nan_maximum(running_amax, tl.abs((x * weight) * rstd))
        amax = row_amax(running_amax, 0)
    scale = scale_from_amax(amax, QMAX, MIN_SCALE_C)
    inv_scale = tl.math.div_rn(1.0, scale)
    for start in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        mask = start + cols < K
        x = tl.load(normed_src + start + cols, mask=mask, other=0.0, eviction_policy=STREAM).to(tl.float32)
        weight = offset + tl.load(weight_ptr + start + cols, mask=mask, other=0.0,
                                  eviction_policy="evict_last").to(tl.float32)
        q = quantize_with_row_scale((x * weight) * rstd, scale, inv_scale, IS_FP8, FAST_DIVIDE, INTERPRETED)
        tl.store(q_ptr + row * stride_qm + start + cols, q, mask=mask, eviction_policy=STREAM)
    tl.store(scale_ptr + row, scale)


_PER_TOKEN = CachedLaunch(_quantize_per_token_kernel)
_PER_TENSOR = CachedLaunch(_quantize_per_tensor_kernel)
_RMS_NORM_QUANT = CachedLaunch(_rms_norm_quant_kernel)
_RMS_NORM_QUANT_CHUNKED = CachedLaunch(_rms_norm_quant_chunked_kernel)


# ----------------------------------------------------------------------------------------------
# Validation: quant_checks.py (shared with the torch backend and the ops' fake implementations)
# ----------------------------------------------------------------------------------------------


def _check_runnable(x: torch.Tensor) -> None:
    check_runnable(x, "x")


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _row_warps(block_k: int) -> int:
    # Enough threads that each holds ~16 elements of the row (wide loads, no register spill).
    return max(1, min(16, block_k // 512))


def _norm_row_warps(block_k: int, has_residual: bool) -> int:
    # Measured on an H100 (2026-11-23, NOTES-quant.md): K=4096 rows on 4 warps (3-8 % ahead of
    # 8); K=14336 rows on 8 warps without a residual (2-3 % ahead of 16, 1.7x ahead of 32) and
    # on 16 with one (96-100 % of the copy bandwidth; 32 warps 10-13 % behind).
    return max(1, min(16 if has_residual else 8, block_k // 1024))


def _output(out, shape, dtype, device, name):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"{name} is {tuple(out.shape)} {out.dtype}; expected a contiguous {tuple(shape)} {dtype} on {device}")
    return out


def per_token_launch_config(K: int) -> dict:
    """Launch parameters of the per-token kernel for rows of K elements (tuned on an H100 and an H200).

    Every row up to MAX_SINGLE_PASS_K elements stays in registers (one read). Up to 8192 with
    warps from the block size. Longer rows on 8 warps, 16-bit in registers until quantized, no
    eviction hints: H200, session 43 (``benchmarks/gpu_checks_s43.py --per-token``,
    results/gpu_checks_s43_per_token_b_h200.json, 7 rotated rounds), K = 14336: 1.15x / 1.13x
    (INT8 / FP8) at M = 4096 and 1.11x / 1.09x at M = 16384 over the two passes of 8192-wide chunks
    on 16 warps that had been the default since the H100 measurements of session 4 (there the
    two were within 2.4 %); with eviction hints the whole row gained only 1.10x and 1.00-1.01x.
    Past MAX_SINGLE_PASS_K the row goes in those two passes.

    Keys (``config=`` of ``quantize_per_token`` overrides any of them): ``single_pass`` (whole
    row in registers), ``chunk_k``, ``rows`` per program, ``keep_input_dtype`` (16-bit row in
    registers), ``num_warps`` (None: from the block size), ``fast_divide`` (reciprocal + FMA
    correction instead of IEEE division; same bits), ``stages`` (software pipelining of the
    chunk loops; 1 = none), ``evict`` (cache eviction hints), ``max_registers`` (a cap on the
    registers per thread, None: ptxas's choice).
    """
    whole_row = {"single_pass": True, "chunk_k": CHUNK_K, "rows": 1, "keep_input_dtype": False, "num_warps": None,
                 "fast_divide": True, "stages": 1, "evict": False, "max_registers": None}
    if K <= SINGLE_PASS_PER_TOKEN_K:
        return whole_row
    if K <= MAX_SINGLE_PASS_K:
        return {**whole_row, "keep_input_dtype": True, "num_warps": 8}
    return {**whole_row, "single_pass": False, "chunk_k": PER_TOKEN_CHUNK_K, "num_warps": 16, "evict": True}


def rms_norm_launch_config(K: int, has_residual: bool = False) -> dict:
    """Launch parameters of the fused RMSNorm + per-token kernel (tuned on an H100).

    The whole row stays in registers (one read of each input; warps from ``_norm_row_warps``:
    4 at K=4096, 8 at K=14336, 16 with a residual). H100, 2026-11-23 (NOTES-quant.md): with the
    cheaper division it beat every chunked variant at K=14336, without a residual (2.49-2.52
    TB/s at M=4096, 2.72-2.77 at M=16384; best chunked 2.16-2.21 / 2.42-2.46) and with one
    (2.87-2.88 / 3.00).
    ``chunk_k`` > 0 selects the chunked kernel (``passes`` 2 or 3, ``stages``); ``rows`` applies
    to the whole-row one; ``num_warps`` (None: from the block size), ``fast_divide`` and
    ``evict`` (cache eviction hints) to both.

    Eviction hints (the row and the output streamed, the weight kept) without a residual only:
    H200, 2026-11-29 (session 38, ``benchmarks/quant_s4.py --round 3``, results/quant_s38{a,b}_h200.json),
    M = 4096: 1.06-1.09x at K = 4096 (where the kernel had read 75-78 % of a same-size copy) and
    1.01-1.03x at K = 14336; with a residual they cost 3-9 %. Two rows per program or 2 / 8 warps
    were no faster.

    ``max_registers`` (None: ptxas's choice) caps the registers per thread. Rows over 8192 elements
    without a residual take 80: three 8-warp programs per SM instead of two. H200, session 43
    (``benchmarks/gpu_checks_s43.py``, results/gpu_checks_s43b_h200.json): 1.03-1.05x at K = 14336,
    M = 4096 and 16384; 64 registers 1.2-1.6x slower, 72 and 96 2-7 % slower than 80.
    """
    return {"rows": 1, "num_warps": None, "chunk_k": 0, "passes": 2, "fast_divide": True, "stages": 1,
            "evict": not has_residual, "max_registers": 80 if K > 8192 and not has_residual else None}


def _launch_config(defaults: dict, config: dict | None, name: str) -> dict:
    unknown = set(config or {}) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {name} keys {sorted(unknown)}; known: {sorted(defaults)}")
    cfg = {**defaults, **(config or {})}
    if cfg.get("passes", 2) not in (2, 3):
        raise ValueError(f"passes={cfg['passes']}; the chunked RMSNorm kernel makes 2 or 3 passes")
    if int(cfg["stages"]) < 1:
        raise ValueError(f"stages={cfg['stages']}; use 1 (no pipelining) or more")
    registers = cfg.get("max_registers")
    if registers is not None and (type(registers) is not int or not 24 <= registers <= 255):
        raise ValueError(f"max_registers={registers!r}; use None (ptxas's choice) or an int in 24..255")
    return cfg


def _compile_options(cfg: dict) -> dict | None:
    """The launch config's compile options beyond warps and stages (triton's ``maxnreg``), or None."""
    return {"maxnreg": cfg["max_registers"]} if cfg["max_registers"] else None


def _policies(evict: bool) -> dict:
    return {"KEEP": KEEP_POLICY, "STREAM": STREAM_POLICY} if evict else {"KEEP": "", "STREAM": ""}


_PER_TOKEN_PLANS: dict = {}
_RMS_PLANS: dict = {}
# Validated calls without out=/config= (launch.SignatureCache): (output shapes, device, key
# without the alignment bits, grid, the arguments after the pointers, launch plan).
_PER_TOKEN_CALLS = SignatureCache()
_RMS_CALLS = SignatureCache()


def _rms_norm_plan(K: int, has_residual: bool, dtype: torch.dtype, config: dict | None) -> tuple:
    cfg = _launch_config(rms_norm_launch_config(K, has_residual), config, "RMSNorm config")
    pdl = launch.pdl_enabled()
    constexprs = dict(QMAX=qmax_of(dtype), MIN_SCALE_C=MIN_SCALE, IS_FP8=dtype == torch.float8_e4m3fn,
                      HAS_RESIDUAL=has_residual)
    if cfg["chunk_k"]:
        block_k, launcher, rows = min(cfg["chunk_k"], next_power_of_2(K)), _RMS_NORM_QUANT_CHUNKED, 1
        constexprs.update(BLOCK_K=block_k, TWO_PASS=cfg["passes"] == 2, FAST_DIVIDE=bool(cfg["fast_divide"]),
                          STAGES=int(cfg["stages"]), **_policies(cfg["evict"]), INTERPRETED=INTERPRETED,
                          PDL=pdl)
    else:
        block_k, launcher, rows = next_power_of_2(K), _RMS_NORM_QUANT, cfg["rows"]
        constexprs.update(BLOCK_K=block_k, ROWS=rows, FAST_DIVIDE=bool(cfg["fast_divide"]), **_policies(cfg["evict"]),
                          INTERPRETED=INTERPRETED, PDL=pdl)
    chunked = launcher is _RMS_NORM_QUANT_CHUNKED
    num_warps = cfg["num_warps"] or (_row_warps(block_k) if chunked else _norm_row_warps(block_k * rows, has_residual))
    options = launch.pdl_options(pdl, _compile_options(cfg))
    plan_id = (chunked, K, *constexprs.values(), num_warps, cfg["max_registers"])
    return launcher, rows, constexprs, num_warps, options, plan_id


def _per_token_plan(K: int, x_dtype: torch.dtype, dtype: torch.dtype, config: dict | None) -> tuple:
    cfg = _launch_config(per_token_launch_config(K), config, "per-token config")
    single_pass = cfg["single_pass"]
    if single_pass and K > MAX_SINGLE_PASS_K:
        raise ValueError(f"single_pass with K={K} > {MAX_SINGLE_PASS_K}: the row would not fit in registers")
    block_k = next_power_of_2(K) if single_pass else min(cfg["chunk_k"], next_power_of_2(K))
    rows = cfg["rows"]
    num_warps = cfg["num_warps"] or _row_warps(block_k * rows)
    pdl = launch.pdl_enabled()
    constexprs = dict(QMAX=qmax_of(dtype), MIN_SCALE_C=MIN_SCALE, IS_FP8=dtype == torch.float8_e4m3fn, BLOCK_K=block_k,
                      ROWS=rows, SINGLE_PASS=single_pass, KEEP_INPUT_DTYPE=cfg["keep_input_dtype"],
                      FAST_DIVIDE=bool(cfg["fast_divide"]), STAGES=int(cfg["stages"]), **_policies(cfg["evict"]),
                      INTERPRETED=INTERPRETED, PDL=pdl)
    options = launch.pdl_options(pdl, _compile_options(cfg))
    # Everything the compiled kernel depends on besides the per-call strides, M and alignment.
    plan_id = (x_dtype, K, *constexprs.values(), num_warps, cfg["max_registers"])
    return rows, constexprs, num_warps, options, plan_id


@on_its_gpu
def quantize_per_token(x: torch.Tensor, dtype: torch.dtype, out=None, out_scale=None,
                       config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (q (M, K) dtype, scale (M,) fp32). A row of K <= MAX_SINGLE_PASS_K is read
    once (kept in registers, ``per_token_launch_config``); a longer one in two passes over
    PER_TOKEN_CHUNK_K-wide chunks, the second mostly from L2.

    ``out`` / ``out_scale`` receive the results when given (tests poison them); ``config``
    overrides ``per_token_launch_config`` (benchmarks, tests).
    """
    cacheable = out is None and out_scale is None and config is None
    if cacheable:
        try:
            signature = (x.shape, x.stride(), x.dtype, x.device, dtype, launch.pdl_enabled())
        except AttributeError:  # x is not a tensor: the checks below name it
            signature = None
        call = _PER_TOKEN_CALLS.get(signature)
        if call is not None:
            q_shape, scale_shape, device, key, grid, tail, constexprs, num_warps, options = call
            # Sizes as separate ints: torch parses them ~0.7 us faster than a tuple (session 6).
            q = torch.empty(*q_shape, dtype=dtype, device=device)
            scale = torch.empty(*scale_shape, dtype=torch.float32, device=device)
            _PER_TOKEN((key, aligned(x, q, scale)), grid, (x, q, scale, *tail), constexprs, num_warps, 3,
                       options=options)
            return q, scale
    check_activation_input(x)
    check_quant_dtype(dtype)
    _check_runnable(x)
    M, K = x.shape
    q = _output(out, (M, K), dtype, x.device, "out")
    scale = _output(out_scale, (M,), torch.float32, x.device, "out_scale")
    if M == 0:
        return q, scale
    if K == 0:
        return q, scale.fill_(MIN_SCALE)
    plan_key = (K, x.dtype, dtype, launch.pdl_enabled())
    plan = _PER_TOKEN_PLANS.get(plan_key) if config is None else None
    if plan is None:
        plan = _per_token_plan(K, x.dtype, dtype, config)
        if config is None:
            _PER_TOKEN_PLANS[plan_key] = plan
    rows, constexprs, num_warps, options, plan_id = plan
    x_stride, q_stride = x.stride(0), q.stride(0)
    key = (plan_id, x_stride, q_stride, int_spec(M))
    grid, tail = (cdiv(M, rows),), (M, K, x_stride, q_stride)
    if cacheable:
        _PER_TOKEN_CALLS.add(signature, ((M, K), (M,), x.device, key, grid, tail, constexprs, num_warps, options))
    _PER_TOKEN((key, aligned(x, q, scale)), grid, (x, q, scale, *tail), constexprs, num_warps, 3, options=options)
    return q, scale


@on_its_gpu
def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out=None) -> torch.Tensor:
    """(M, K) float -> (M, K) dtype with one static fp32 scale (1 element)."""
    check_activation_input(x)
    check_quant_dtype(dtype)
    check_per_tensor_scale(scale, x)
    _check_runnable(x)
    M, K = x.shape
    q = _output(out, (M, K), dtype, x.device, "out")
    if M == 0 or K == 0:
        return q
    is_fp8 = dtype == torch.float8_e4m3fn
    flat = x.stride(0) == K and q.stride(0) == K
    block_k = CHUNK_K if flat else min(CHUNK_K, next_power_of_2(K))
    grid = (cdiv(M * K, block_k),) if flat else (M, cdiv(K, block_k))
    num_warps = _row_warps(block_k)
    key = (x.dtype, is_fp8, flat, int_spec(M * K), K, x.stride(0), q.stride(0), block_k, num_warps,
           aligned(x, q, scale))
    _PER_TENSOR(key, grid, (x, q, scale, M * K, K, x.stride(0), q.stride(0)),
                dict(IS_FP8=is_fp8, BLOCK_K=block_k, FLAT=flat, INTERPRETED=INTERPRETED), num_warps, 3)
    return q


@on_its_gpu
def rms_norm_quant_per_token(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
    out=None,
    out_scale=None,
    out_residual=None,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """RMSNorm (+ residual added first, + Gemma's offset) fused with per-token quantization.

    Returns (q (M, K), scale (M,) fp32, new residual (x + residual in x.dtype) or None).
    """
    cacheable = out is None and out_scale is None and out_residual is None and config is None
    if cacheable:
        try:
            signature = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
                         weight.device, dtype, None if residual is None else (residual.shape, residual.stride(),
                                                                             residual.dtype, residual.device),
                         launch.pdl_enabled())
        except AttributeError:  # an argument is not a tensor: the checks below name it
            signature = None
        call = _RMS_CALLS.get(signature)
        # Any eps but a plain non-negative finite float, or any offset but a finite int or float, takes
        # the checked path below.
        if call is not None and type(eps) is float and 0.0 <= eps < math.inf and type(offset) in (float, int) \
                and -math.inf < offset < math.inf:
            shape, scale_shape, device, key, grid, strides, launcher, constexprs, num_warps, options = call
            q = torch.empty(*shape, dtype=dtype, device=device)  # separate ints: see quantize_per_token
            scale = torch.empty(*scale_shape, dtype=torch.float32, device=device)
            if residual is None:
                new_residual = None
                residual_arg = new_residual_arg = x
            else:
                new_residual = new_residual_arg = torch.empty(*shape, dtype=x.dtype, device=device)
                residual_arg = residual
            launcher((key, aligned(x, residual_arg, new_residual_arg, weight, q, scale)), grid,
                     (x, residual_arg, new_residual_arg, weight, q, scale, *strides, float(eps), float(offset)),
                     constexprs, num_warps, 3, options=options)
            return q, scale, new_residual
    check_rms_norm_args(x, weight, residual, eps=eps, offset=offset)
    check_quant_dtype(dtype)
    _check_runnable(x)
    M, K = x.shape
    q = _output(out, (M, K), dtype, x.device, "out")
    scale = _output(out_scale, (M,), torch.float32, x.device, "out_scale")
    new_residual = _output(out_residual, (M, K), x.dtype, x.device, "out_residual") if residual is not None else None
    if M == 0:
        return q, scale, new_residual
    if K == 0:
        return q, scale.fill_(MIN_SCALE), new_residual
    has_residual = residual is not None
    plan_key = (K, has_residual, dtype, launch.pdl_enabled())
    plan = _RMS_PLANS.get(plan_key) if config is None else None
    if plan is None:
        plan = _rms_norm_plan(K, has_residual, dtype, config)
        if config is None:
            _RMS_PLANS[plan_key] = plan
    launcher, rows, constexprs, num_warps, options, plan_id = plan
    # Unused pointers still need a tensor; x itself is a harmless stand-in.
    residual_arg = residual if has_residual else x
    new_residual_arg = new_residual if has_residual else x
    # M, K and the row strides (the outputs' are K: they are allocated contiguous).
    strides = (M, K, x.stride(0), residual_arg.stride(0), new_residual_arg.stride(0), q.stride(0))
    key = (plan_id, x.dtype, weight.dtype, *strides[2:], int_spec(M))
    grid = (cdiv(M, rows),)
    if cacheable:
        _RMS_CALLS.add(signature, ((M, K), (M,), x.device, key, grid, strides, launcher, constexprs, num_warps,
                                   options))
    launcher((key, aligned(x, residual_arg, new_residual_arg, weight, q, scale)), grid,
             (x, residual_arg, new_residual_arg, weight, q, scale, *strides, float(eps), float(offset)),
             constexprs, num_warps, 3, options=options)
    return q, scale, new_residual


__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "quantize_per_token",
    "quantize_per_tensor",
    "rms_norm_quant_per_token",
    "round_half_even",
    "round_to_e4m3_grid",
    "round_to_bf16_grid",
    "cast_for_store",
    "is_interpreted",
]
