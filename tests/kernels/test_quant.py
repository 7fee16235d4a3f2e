"""Activation-quantization kernels under the interpreter, against reference.py.

Per-token and per-tensor quantization are bit-exact with the reference (same IEEE-rounded
division, same round-half-even). The fused RMSNorm rounds its norm like its twin, so the two
are bit-exact whenever their sums of squares agree: always for few-bit inputs, whose sum is
exact in float32 in any order; on random data the summation order may move rstd by an ulp
(scale within 1e-6, a value on a rounding boundary one step off).
"""

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from quantkit.bench.quant import static_quant_edge_inputs
from quantkit.kernels import ops, quant, reference

QDTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
XDTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
           pytest.param(torch.float16, id="fp16")]


def _x(M, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * 3
    x[:, :: max(1, K // 7)] *= 20  # outliers, as real activations have
    return x.to(dtype)


def _poisoned_q(M, K, dtype):
    # 77 is not a value the test data quantizes to everywhere; NaN for fp8.
    return torch.full((M, K), float("nan") if dtype.is_floating_point else 77).to(dtype)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("M,K", [(1, 64), (13, 300), (128, 1000), (257, 48)])
def test_quantize_per_token_bit_exact(qdtype, xdtype, M, K):
    x = _x(M, K, xdtype, seed=M)
    q, scale = quant.quantize_per_token(x, qdtype, out=_poisoned_q(M, K, qdtype),
                                        out_scale=torch.full((M,), float("nan")))
    ref_q, ref_scale = reference.quantize_per_token(x, qdtype)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.int8), ref_q.view(torch.int8))  # bitwise, NaN-safe


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_quantize_per_token_two_pass_long_rows(qdtype):
    # K above the single-pass limit takes the chunked two-pass path (and a ragged last chunk).
    M, K = 2, quant.MAX_SINGLE_PASS_K + 80
    x = _x(M, K, torch.bfloat16)
    q, scale = quant.quantize_per_token(x, qdtype, out=_poisoned_q(M, K, qdtype))
    ref_q, ref_scale = reference.quantize_per_token(x, qdtype)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.int8), ref_q.view(torch.int8))


LAUNCH_VARIANTS = {
    "rows2": {"rows": 2},
    "rows4_w4": {"rows": 4, "num_warps": 4},
    "two_pass_c128_rows2": {"single_pass": False, "chunk_k": 128, "rows": 2},
    "two_pass_c128_pipelined_evict": {"single_pass": False, "chunk_k": 128, "stages": 3, "evict": True},
    "keep_input_dtype": {"keep_input_dtype": True},
    "whole_row_evict": {"evict": True},
    "ieee_division": {"fast_divide": False},
    "two_pass_ieee_division": {"single_pass": False, "chunk_k": 64, "fast_divide": False},
}


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("variant", LAUNCH_VARIANTS)
def test_quantize_per_token_launch_variants_bit_exact(qdtype, variant):
    # 13 rows: the multi-row programs get a ragged last block; K=300 a ragged last chunk.
    M, K = 13, 300
    x = _x(M, K, torch.bfloat16, seed=3)
    q, scale = quant.quantize_per_token(x, qdtype, out=_poisoned_q(M, K, qdtype),
                                        out_scale=torch.full((M,), float("nan")), config=LAUNCH_VARIANTS[variant])
    ref_q, ref_scale = reference.quantize_per_token(x, qdtype)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.int8), ref_q.view(torch.int8))


@triton.jit
def _divide_kernel(x_ptr, scale_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    scale = tl.load(scale_ptr + offs, mask=mask, other=1.0)
    tl.store(out_ptr + offs, quant.divide_by_scale(x, scale, tl.math.div_rn(1.0, scale)), mask=mask)


def _hard_quotients(n=1 << 16, seed=0):
    """(x, scale) pairs whose IEEE quotient is hard to round: near int8 ties, near float8
    midpoints, near float32 midpoints, signed zeros, scales with all-ones mantissas."""
    rng = np.random.default_rng(seed)
    amax = np.exp(rng.uniform(-25, 25, n)).astype(np.float32)
    scale = np.maximum(amax / np.float32(rng.choice([127.0, 448.0], n)), np.float32(1e-12)).astype(np.float32)
    ones = (scale.view(np.int32) | np.int32(0x7FFFFF)).view(np.float32)
    scale = np.where(rng.random(n) < 0.2, ones, scale).astype(np.float32)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
    fp8_mid = (e4m3[:-1] + e4m3[1:]) / 2
    near = rng.uniform(-448, 448, n).astype(np.float32)
    fp32_mid = (near.astype(np.float64) + np.nextafter(near, np.float32(np.inf))) / 2
    targets = np.stack([rng.integers(-127, 127, n) + 0.5, fp8_mid[rng.integers(0, len(fp8_mid), n)], fp32_mid,
                        rng.uniform(-127, 127, n)])[rng.integers(0, 4, n), np.arange(n)]
    x = (targets * scale.astype(np.float64)).astype(np.float32)
    x = (x.view(np.int32) + rng.integers(-2, 3, n).astype(np.int32)).view(np.float32)
    x[:64] = np.where(np.arange(64) % 2 == 0, np.float32(0.0), np.float32(-0.0))
    return torch.from_numpy(x), torch.from_numpy(scale)


def test_divide_by_scale_is_ieee_division():
    # The fast path of the dynamic quantizers: reciprocal + one FMA correction must round
    # exactly like x / scale (sign of zero included), also where rounding is hardest.
    x, scale = _hard_quotients()
    out = torch.full_like(x, float("nan"))
    _divide_kernel[(1,)](x, scale, out, x.numel(), BLOCK=x.numel())
    assert torch.equal(out.view(torch.int32), (x / scale).view(torch.int32))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("variant", ["whole_row", "two_pass"])
def test_quantize_per_token_at_rounding_ties_and_signed_zeros(qdtype, variant):
    # Each row's largest |x| fixes its scale; the others sit a few ulps around the points where
    # the quantized value changes (x = (k + 1/2) * scale for int8, float8 midpoints), plus +-0.
    M, K = 6, 512
    gen = torch.Generator().manual_seed(9)
    amax = torch.exp(torch.empty(M).uniform_(-8, 8, generator=gen))
    scale = reference.scale_from_amax(amax, qdtype)
    if qdtype == torch.int8:
        points = torch.randint(-127, 127, (M, K), generator=gen) + 0.5
    else:
        grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        mids = (grid[:-1] + grid[1:]) / 2
        signs = torch.randint(0, 2, (M, K), generator=gen) * 2 - 1
        points = mids[torch.randint(0, len(mids), (M, K), generator=gen)] * signs
    x = (points.double() * scale.double()[:, None]).float()
    x = (x.view(torch.int32) + torch.randint(-2, 3, (M, K), generator=gen, dtype=torch.int32)).view(torch.float32)
    x[:, 0] = amax
    x[:, 1], x[:, 2] = 0.0, -0.0
    config = {} if variant == "whole_row" else {"single_pass": False, "chunk_k": 128}
    q, got_scale = quant.quantize_per_token(x, qdtype, out=_poisoned_q(M, K, qdtype), config=config)
    ref_q, ref_scale = reference.quantize_per_token(x, qdtype)
    assert torch.equal(got_scale, ref_scale)
    assert torch.equal(q.view(torch.int8), ref_q.view(torch.int8))


def _few_bit(M, K, dtype, seed):
    # Multiples of 1/4 up to 2: every square and every partial sum is exact in float32, so the
    # sum of squares is the same in any order and kernel and twin must agree bit for bit.
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, (M, K), generator=gen) / 4).to(dtype)


RMS_VARIANTS = {
    "whole_row": {"chunk_k": 0},
    "whole_row_rows2": {"chunk_k": 0, "rows": 2},
    "whole_row_ieee_division": {"chunk_k": 0, "fast_divide": False},
    "whole_row_evict": {"chunk_k": 0, "evict": True},
    "whole_row_no_evict": {"chunk_k": 0, "evict": False},  # the default has hints without a residual
    "chunked_two_pass": {"chunk_k": 128, "passes": 2},
    "chunked_three_pass": {"chunk_k": 128, "passes": 3},
    "chunked_pipelined_evict": {"chunk_k": 64, "passes": 2, "stages": 3, "evict": True},
    "chunked_ieee_division": {"chunk_k": 128, "passes": 3, "fast_divide": False},
}


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("variant", RMS_VARIANTS)
def test_rms_norm_quant_bit_exact_when_the_sum_of_squares_is_exact(qdtype, with_residual, variant):
    M, K = 5, 300
    x = _few_bit(M, K, torch.bfloat16, seed=10)
    x[0, :7] = 0.0  # zeros times negative (offset + w): -0 normed values (a float8 bit pattern of their own)
    residual = _few_bit(M, K, torch.bfloat16, seed=11) if with_residual else None
    weight = torch.randn(K, generator=torch.Generator().manual_seed(12)).bfloat16()
    q, scale, new_residual = quant.rms_norm_quant_per_token(
        x, weight, 1e-6, qdtype, residual, 1.0, out=_poisoned_q(M, K, qdtype),
        out_scale=torch.full((M,), float("nan")), config=RMS_VARIANTS[variant])
    ref_q, ref_scale, ref_residual = reference.rms_norm_quant_per_token(x, weight, 1e-6, qdtype, residual, 1.0)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.int8), ref_q.view(torch.int8))
    if with_residual:
        assert torch.equal(new_residual, ref_residual)


@pytest.mark.parametrize("chunk_k", [0, 1024], ids=["whole_row", "chunked"])
def test_rms_norm_quant_rounds_the_norm_in_the_twins_order(chunk_k):
    # (x * w') * rstd and (x * rstd) * w' differ in the last bit for about half the elements;
    # float8's coarse grid turns ~1 in 2000 of those into another quantized value, so 64k
    # elements tell the two orders apart (the scale alone would not: it uses the max identity).
    M, K = 16, 4096
    x = _few_bit(M, K, torch.bfloat16, seed=20)
    weight = torch.randn(K, generator=torch.Generator().manual_seed(21)).bfloat16()
    q, scale, _ = quant.rms_norm_quant_per_token(x, weight, 1e-6, torch.float8_e4m3fn, None, 1.0,
                                                 config={"chunk_k": chunk_k})
    ref_q, ref_scale, _ = reference.rms_norm_quant_per_token(x, weight, 1e-6, torch.float8_e4m3fn, None, 1.0)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.int8), ref_q.view(torch.int8))


@pytest.mark.parametrize("chunk_k", [0, 128], ids=["whole_row", "chunked"])
@pytest.mark.parametrize("alias", ["x", "residual"])
def test_add_rms_norm_quant_in_place_residual(chunk_k, alias):
    # out_residual may be one of the inputs (an in-place residual stream update).
    M, K = 4, 300
    x, residual = _x(M, K, torch.bfloat16, seed=13), _x(M, K, torch.bfloat16, seed=14)
    weight = torch.randn(K)
    want = quant.rms_norm_quant_per_token(x, weight, 1e-6, torch.int8, residual, 0.0, config={"chunk_k": chunk_k})
    x2, residual2 = x.clone(), residual.clone()
    target = x2 if alias == "x" else residual2
    got = quant.rms_norm_quant_per_token(x2, weight, 1e-6, torch.int8, residual2, 0.0, out_residual=target,
                                         config={"chunk_k": chunk_k})
    assert got[2].data_ptr() == target.data_ptr()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_sqrt_rn_is_correctly_rounded():
    # torch's vectorized CPU sqrt can be an ulp off; the twin's must round like sqrt_rn.
    gen = np.random.default_rng(3)
    t = np.concatenate([np.exp(gen.uniform(-80, 80, 200_000)), [0.0, 1.0, 2.0, 4.0, np.inf]]).astype(np.float32)
    got = reference.sqrt_rn(torch.from_numpy(t))
    assert torch.equal(got.view(torch.int32), torch.from_numpy(np.sqrt(t)).view(torch.int32))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("rows", [2, 4])
def test_rms_norm_quant_rows_per_program(qdtype, rows):
    M, K = 13, 300
    x, residual = _x(M, K, torch.bfloat16, seed=4), _x(M, K, torch.bfloat16, seed=5)
    weight = torch.randn(K)
    one_row = quant.rms_norm_quant_per_token(x, weight, 1e-6, qdtype, residual, 1.0)
    q, scale, new_residual = quant.rms_norm_quant_per_token(
        x, weight, 1e-6, qdtype, residual, 1.0, out=_poisoned_q(M, K, qdtype),
        out_scale=torch.full((M,), float("nan")), config={"rows": rows})
    # Same per-row arithmetic whatever the rows per program: identical to the one-row launch.
    assert torch.equal(q.view(torch.int8), one_row[0].view(torch.int8))
    assert torch.equal(scale, one_row[1]) and torch.equal(new_residual, one_row[2])


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_quant_chunked_kernel(qdtype, with_residual):
    # 300 = 2 full 128-wide chunks + a ragged one. Random data: the sum of squares is rounded,
    # in another order than the twin's, so the twin is matched to rounding; two and three
    # passes share the order and must agree exactly (max|normed| == max|x * w'| * rstd).
    M, K = 5, 300
    x = _x(M, K, torch.bfloat16, seed=6)
    residual = _x(M, K, torch.bfloat16, seed=7) if with_residual else None
    weight = torch.randn(K)
    q, scale, new_residual = quant.rms_norm_quant_per_token(
        x, weight, 1e-6, qdtype, residual, 1.0, out=_poisoned_q(M, K, qdtype),
        out_scale=torch.full((M,), float("nan")), config={"chunk_k": 128, "passes": 2})
    three = quant.rms_norm_quant_per_token(x, weight, 1e-6, qdtype, residual, 1.0, config={"chunk_k": 128, "passes": 3})
    assert torch.equal(q.view(torch.int8), three[0].view(torch.int8)) and torch.equal(scale, three[1])
    ref_q, ref_scale, ref_residual = reference.rms_norm_quant_per_token(x, weight, 1e-6, qdtype, residual, 1.0)
    if with_residual:
        assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    dequant, ref_dequant = q.float() * scale[:, None], ref_q.float() * ref_scale[:, None]
    assert (dequant - ref_dequant).norm() / ref_dequant.norm() < 1e-3


def test_launch_defaults_follow_the_measurements():
    # NOTES-quant.md (2026-11-23): the fused norm keeps the row in registers at every K.
    for K, residual in ((4096, False), (14336, False), (14336, True)):
        assert quant.rms_norm_launch_config(K, residual)["chunk_k"] == 0
    # H200 (session 43): rows up to 16384 whole, 16-bit in registers on 8 warps, no eviction hints;
    # longer ones chunked.
    long_rows = quant.per_token_launch_config(14336)
    assert long_rows["single_pass"] and long_rows["keep_input_dtype"] and long_rows["num_warps"] == 8
    assert not long_rows["evict"]
    longer = quant.per_token_launch_config(quant.MAX_SINGLE_PASS_K + 1)
    assert not longer["single_pass"] and longer["chunk_k"] == 8192 and longer["evict"]
    assert quant.per_token_launch_config(4096)["single_pass"]
    assert quant._norm_row_warps(4096, False) == quant._norm_row_warps(4096, True) == 4
    assert quant._norm_row_warps(16384, False) == 8 and quant._norm_row_warps(16384, True) == 16
    # H200 (session 38): eviction hints help the norm without a residual and cost with one.
    assert all(quant.rms_norm_launch_config(K)["evict"] for K in (4096, 14336))
    assert not any(quant.rms_norm_launch_config(K, True)["evict"] for K in (4096, 14336))
    # H200 (session 43): rows over 8192 elements without a residual cap the registers at 80.
    assert quant.rms_norm_launch_config(14336)["max_registers"] == 80
    assert quant.rms_norm_launch_config(4096)["max_registers"] is None
    assert quant.rms_norm_launch_config(14336, True)["max_registers"] is None


@pytest.mark.parametrize("registers", [0, 16, 300, 80.0, "80"])
def test_rejects_a_bad_register_cap(registers):
    x, w = torch.randn(3, 64), torch.randn(64)
    with pytest.raises(ValueError, match="max_registers"):
        quant.rms_norm_quant_per_token(x, w, 1e-6, torch.int8, config={"max_registers": registers})
    with pytest.raises(ValueError, match="max_registers"):
        quant.quantize_per_token(x, torch.int8, config={"max_registers": registers})


def test_per_token_register_cap_is_part_of_the_launch():
    plans = [quant._per_token_plan(200, torch.float32, torch.int8, {"max_registers": r}) for r in (None, 48)]
    assert plans[0][3] is None and plans[1][3] == {"maxnreg": 48} and plans[0][-1] != plans[1][-1]
    x = torch.randn(6, 200) * 3
    q, s = quant.quantize_per_token(x, torch.int8, config={"max_registers": 48})
    ref_q, ref_s = reference.quantize_per_token(x, torch.int8)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)


def test_rms_norm_register_cap_is_part_of_the_launch():
    # The cap goes to triton as maxnreg and is part of the plan's key (a compiled binary per cap);
    # the interpreter ignores it, so the outputs equal the uncapped launch's here.
    x, w = torch.randn(5, 200) * 2, torch.randn(200)
    plain = quant.rms_norm_quant_per_token(x, w, 1e-6, torch.float8_e4m3fn, config={"max_registers": None})
    capped = quant.rms_norm_quant_per_token(x, w, 1e-6, torch.float8_e4m3fn, config={"max_registers": 40})
    assert torch.equal(plain[0].view(torch.uint8), capped[0].view(torch.uint8)) and torch.equal(plain[1], capped[1])
    plans = [quant._rms_norm_plan(200, False, torch.float8_e4m3fn, {"max_registers": r}) for r in (None, 40)]
    assert plans[0][4] is None and plans[1][4] == {"maxnreg": 40} and plans[0][-1] != plans[1][-1]


def test_zero_row_gets_min_scale_and_zeros():
    x = torch.zeros(3, 64)
    x[1] = torch.randn(64)
    q, scale = quant.quantize_per_token(x, torch.int8)
    assert scale[0].item() == pytest.approx(reference.MIN_SCALE) and not q[0].any()
    assert torch.isfinite(scale).all()


def test_fp8_rounding_ties_and_saturation():
    # Values between e4m3 grid points (ties included), subnormals, and values past 448.
    grid = torch.arange(-127, 128, dtype=torch.int8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid[:-1] + grid.sort().values[1:]) / 2
    x = torch.cat([grid, mids, torch.tensor([447.0, 449.0, 500.0, -1000.0, 1e-4, 3e-3, -2.1e-3])]).reshape(1, -1)
    K = x.shape[1] // 16 * 16
    x = x[:, :K].contiguous()
    scale = torch.ones(1)
    q = quant.quantize_per_tensor(x, scale, torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.int8), reference.quantize_per_tensor(x, scale, torch.float8_e4m3fn).view(torch.int8))


def test_int8_rounds_half_to_even_like_torch():
    # Saturating to [-128, 127] like compressed-tensors and vLLM (-127.6 rounds to -128).
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 126.5, 127.4, -127.6, 300.0, -300.0, 3.5, -128.5]])
    q = quant.quantize_per_tensor(x, torch.ones(1), torch.int8)
    assert q.tolist() == [[0, 2, 2, 0, -2, -2, 0, 126, 127, -128, 127, -128, 4, -128]]
    assert torch.equal(q, reference.quantize_per_tensor(x, torch.ones(1), torch.int8))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
def test_quantize_per_tensor_bit_exact(qdtype, xdtype):
    M, K = 13, 300
    x = _x(M, K, xdtype)
    scale = torch.tensor([0.07])
    q = quant.quantize_per_tensor(x, scale, qdtype, out=_poisoned_q(M, K, qdtype))
    assert torch.equal(q.view(torch.int8), reference.quantize_per_tensor(x, scale, qdtype).view(torch.int8))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("scale", [0.07, 3.1e-3, 1e-12, 2.0**-70, 7.5e20, 0.0, math.inf, math.nan],
                         ids=["0.07", "3.1e-3", "min_scale", "below_fast_range", "above_fast_range", "zero", "inf",
                              "nan"])
def test_quantize_per_tensor_bit_exact_at_the_edges(qdtype, scale):
    """The static scale's reciprocal path (STATIC_SCALE_MIN..MAX) and IEEE division outside it,
    against the twin bit for bit: quotients on and next to every rounding boundary, signed zeros,
    values that saturate, overflow the quotient or underflow it, infinities. INT8 gives a NaN
    quotient code 0, every one compared. (FP8 NaN: the interpreter's fp8 cast makes NaN a finite
    code, so the GPU check covers them, benchmarks/gpu_checks_s42.py.)"""
    x = static_quant_edge_inputs(scale, qdtype)
    K = x.shape[1]
    s = torch.tensor([scale], dtype=torch.float32)
    want = reference.quantize_per_tensor(x, s, qdtype)
    for inputs in (x, torch.cat([x, x], dim=1)[:, :K]):  # packed (the flat launch), then row stride 2K
        got = quant.quantize_per_tensor(inputs, s, qdtype, out=_poisoned_q(*inputs.shape, qdtype))
        quotient_nan = torch.isnan(inputs.float() / s)  # 0 / 0 or inf / inf
        if qdtype == torch.int8:  # a NaN quotient is code 0 in both
            assert torch.equal(got, want) and not got[quotient_nan].any()
        else:  # (see above: compared on the GPU)
            assert torch.equal(got.view(torch.int8)[~quotient_nan], want.view(torch.int8)[~quotient_nan])


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["w", "gemma_1_plus_w"])
def test_rms_norm_quant(qdtype, xdtype, with_residual, offset):
    M, K = 13, 300
    x = _x(M, K, xdtype, seed=1)
    weight = torch.randn(K) * 0.5
    residual = _x(M, K, xdtype, seed=2) if with_residual else None
    new_res_buf = torch.full((M, K), float("nan"), dtype=xdtype) if with_residual else None
    q, scale, new_residual = quant.rms_norm_quant_per_token(
        x, weight, 1e-6, qdtype, residual, offset, out=_poisoned_q(M, K, qdtype),
        out_scale=torch.full((M,), float("nan")), out_residual=new_res_buf)
    ref_q, ref_scale, ref_residual = reference.rms_norm_quant_per_token(x, weight, 1e-6, qdtype, residual, offset)
    if with_residual:
        assert torch.equal(new_residual, ref_residual)  # the residual stream is rounded exactly like torch
    else:
        assert new_residual is None
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    steps = (q.float() - ref_q.float()).abs()
    if qdtype == torch.int8:
        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01
    dequant, ref_dequant = q.float() * scale[:, None], ref_q.float() * ref_scale[:, None]
    err = (dequant - ref_dequant).norm() / ref_dequant.norm()
    assert err < 1e-3


def test_rms_norm_quant_against_unfused_float64():
    M, K = 5, 256
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(0))
    weight = 1 + 0.1 * torch.randn(K, generator=torch.Generator().manual_seed(1))  # trained-norm-like
    q, scale, _ = quant.rms_norm_quant_per_token(x, weight, 1e-5, torch.int8, None, 0.0)
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    err = ((q.double() * scale[:, None].double() - normed).norm() / normed.norm()).item()
    # int8 noise: a step of amax/127 (amax ~ 3.5 sigma of the row) is ~1/36 of the row's rms,
    # uniform rounding error adds 1/sqrt(12) of a step: ~0.8 %.
    assert err < 0.012


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: quant.quantize_per_token(torch.randn(4, 8).to(torch.int8), torch.int8), "x.dtype"),
        (lambda: quant.quantize_per_token(torch.randn(4, 8), torch.float16), "quantized dtype"),
        (lambda: quant.quantize_per_token(torch.randn(8, 4).t(), torch.int8), "contiguous"),
        (lambda: quant.quantize_per_token(torch.randn(2, 4, 8), torch.int8), "2-D"),
        (lambda: quant.quantize_per_tensor(torch.randn(4, 8), torch.ones(2), torch.int8), "one"),
        (lambda: quant.quantize_per_tensor(torch.randn(4, 8), torch.ones(1, dtype=torch.float16), torch.int8), "float32"),
        (lambda: quant.rms_norm_quant_per_token(torch.randn(4, 8), torch.randn(7), 1e-6, torch.int8), r"shape \(8,\)"),
        (lambda: quant.rms_norm_quant_per_token(torch.randn(4, 8), torch.randn(8), 1e-6, torch.int8,
                                                torch.randn(4, 8, dtype=torch.bfloat16)), "residual.dtype"),
        (lambda: quant.rms_norm_quant_per_token(torch.randn(4, 8), torch.randn(8), 1e-6, torch.int8,
                                                torch.randn(4, 9)), "residual shape"),
        (lambda: quant.quantize_per_token(torch.randn(4, 8), torch.int8, config={"chunk": 64}), "unknown"),
        (lambda: quant.rms_norm_quant_per_token(torch.randn(4, 8), torch.randn(8), 1e-6, torch.int8,
                                                config={"chunk_k": 64, "passes": 4}), "passes"),
        (lambda: quant.quantize_per_token(torch.randn(4, 8), torch.int8, config={"stages": 0}), "stages"),
    ],
    ids=["int_input", "bad_qdtype", "non_contiguous", "3d", "scale_numel", "scale_dtype", "weight_shape",
         "residual_dtype", "residual_shape", "unknown_config_key", "passes", "stages"],
)
def test_bad_input_raises_clear_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _nan_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy on inf * 0
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("variant", ["single_pass", "rows4", "two_pass_c64"])
def test_nan_and_inf_rows_keep_their_nan_and_inf_scales(qdtype, variant):
    # tl.max drops NaN: a row holding one used to get a finite scale (its NaN quantized to a
    # finite code), hiding a diverging model behind finite logits. torch keeps it, so must the kernel.
    config = {"single_pass": {}, "rows4": {"rows": 4}, "two_pass_c64": {"single_pass": False, "chunk_k": 64}}[variant]
    M, K = 7, 150
    x = _x(M, K, torch.bfloat16, seed=11)
    x[1, 77] = float("nan")
    x[4, 149] = float("inf")
    x[5, 0] = float("-inf")
    q, scale = quant.quantize_per_token(x, qdtype, out=_poisoned_q(M, K, qdtype), config=config)
    ref_q, ref_scale = reference.quantize_per_token(x, qdtype)
    _nan_equal(scale, ref_scale)
    assert scale[1].isnan() and scale[4].isinf() and scale[5].isinf()
    finite = [0, 2, 3, 6]  # a row with a NaN or inf scale has unspecified codes (its output is NaN)
    assert torch.equal(q[finite].view(torch.int8), ref_q[finite].view(torch.int8))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("config", [None, {"chunk_k": 64, "passes": 2}, {"chunk_k": 64, "passes": 3}],
                         ids=["row", "chunked2", "chunked3"])
def test_rms_norm_quant_nan_and_inf_rows_get_nan_scales(qdtype, config):
    # A NaN, or an inf (rstd = 0, inf * 0 = NaN), makes the row's scale NaN as in the twin.
    M, K = 5, 150
    x = _x(M, K, torch.float32, seed=12)
    x[1, 3] = float("nan")
    x[3, 100] = float("inf")
    weight = torch.randn(K)
    _, scale, _ = quant.rms_norm_quant_per_token(x, weight, 1e-6, qdtype, None, 0.0, config=config)
    _, ref_scale, _ = reference.rms_norm_quant_per_token(x, weight, 1e-6, qdtype)
    assert ref_scale[[1, 3]].isnan().all() and scale[[1, 3]].isnan().all()
    torch.testing.assert_close(scale[[0, 2, 4]], ref_scale[[0, 2, 4]], rtol=1e-6, atol=0)


def test_twin_quantizes_empty_rows_like_the_kernel():
    x = torch.randn(6, 48)[:, :0]
    for impl in (quant, reference):
        q, scale = impl.quantize_per_token(x, torch.int8)
        assert q.shape == (6, 0) and torch.equal(scale, torch.full((6,), reference.MIN_SCALE))


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf"), "1e-6", True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_norm_quant_refuses_a_bad_eps(eps, backend):
    x, weight = torch.randn(3, 32), torch.randn(32)
    ops.rms_norm_quant_per_token(x, weight, 1e-6, torch.int8, backend=backend)  # the launch is cached now
    with pytest.raises(ValueError, match="eps="):
        ops.rms_norm_quant_per_token(x, weight, eps, torch.int8, backend=backend)


@triton.jit
def _sum_and_max_rows_kernel(x_ptr, sum_ptr, max_ptr, K, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + tl.program_id(0) * K + cols, mask=cols < K, other=0.0)
    total, largest = tl.reduce((x, tl.abs(x)), 0, quant.sum_and_nan_max)
    tl.store(sum_ptr + tl.program_id(0), total)
    tl.store(max_ptr + tl.program_id(0), largest)


def test_one_pass_sum_and_amax_keep_nan():
    # The combine of the norm's one-pass reduction: a row's sum and its amax, NaN kept (torch's
    # amax). Integer values: every summation order gives the same sum.
    x = torch.randint(-50, 50, (4, 37)).float()
    x[1, 5] = float("nan")
    x[2, 0] = float("-inf")
    sums, maxes = torch.empty(4), torch.empty(4)
    _sum_and_max_rows_kernel[(4,)](x, sums, maxes, 37, BLOCK=64)
    torch.testing.assert_close(sums, x.sum(1), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(maxes, x.abs().amax(1), equal_nan=True, rtol=0, atol=0)
    assert maxes[1].isnan() and maxes[2] == float("inf")
