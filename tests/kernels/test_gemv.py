"""Decode GEMV (gemv.scaled_gemv, M <= 4) under TRITON_INTERPRET=1 against reference.py and float64.

INT8: the raw int32 accumulator equals an int64 matmul exactly, and the full output equals
reference.scaled_mm (same exact accumulator, same fp32 epilogue in the same order) up to one
rounding of the output dtype. FP8: within a bound derived from fp32 summation (below).
"""

import pytest
import torch

from quantkit.kernels import gemv, reference

QDTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
# K: one masked step (16, 48), several 256-wide steps with a masked tail (272, 1040), an exact
# multiple (512); N: below, between and above the interpreter's 32-row block (13, 96, 200).
SHAPES = [(1, 13, 16), (2, 96, 272), (3, 200, 1040), (4, 13, 48), (4, 96, 512), (3, 200, 272)]
SHAPE_IDS = [f"M{m}_N{n}_K{k}" for m, n, k in SHAPES]
# One rounding of the output: bf16 2**-9 relative (8 significant bits), fp16 2**-12; fp32 keeps
# room for the interpreter's numpy exp/erf differing from torch's in the last bits.
ULP_RTOL = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-5}

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _operands(M, N, K, dtype, seed, scalar_scales=False, bias_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    a, a_scale = reference.quantize_per_token(torch.randn(M, K, generator=gen) * 2, dtype)
    w, w_scale = reference.quantize_per_channel(torch.randn(N, K, generator=gen), dtype)
    if scalar_scales:
        a_scale, w_scale = a_scale.max().reshape(1), w_scale.max().reshape(())
    bias = None if bias_dtype is None else torch.randn(N, generator=gen).to(bias_dtype)
    return a, a_scale, w, w_scale, bias


def _float64_reference(a, w, a_scale, w_scale, bias, activation):
    acc = a.double() @ w.double().t()
    out = acc * a_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    return reference.apply_activation(out, activation), acc


@pytest.mark.parametrize("M,N,K", SHAPES, ids=SHAPE_IDS)
def test_int8_accumulator_is_exact(M, N, K):
    a, _, w, _, _ = _operands(M, N, K, torch.int8, seed=M + N + K)
    acc = gemv.int8_gemv_accumulator(a, w)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.long(), a.long() @ w.long().t())


def test_int8_accumulator_exact_at_saturation():
    # Products of +-127 and -128, the largest sums an int8 dot product of this length can reach.
    K = 1040
    a = torch.full((3, K), 127, dtype=torch.int8)
    a[1] = -128
    w = torch.full((5, K), 127, dtype=torch.int8)
    w[2, ::2] = -127
    w[4] = -128
    acc = gemv.int8_gemv_accumulator(a, w)
    assert torch.equal(acc.long(), a.long() @ w.long().t())
    assert acc[0, 0].item() == 127 * 127 * K
    assert acc[1, 4].item() == 128 * 128 * K


@pytest.mark.parametrize("config", [
    pytest.param({"BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1}, id="4x1024"),
    pytest.param({"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2, "num_stages": 1}, id="16x64"),
])
def test_int8_accumulator_exact_with_explicit_config(config):
    a, _, w, _, _ = _operands(4, 37, 1040, torch.int8, seed=3)
    assert torch.equal(gemv.int8_gemv_accumulator(a, w, config=config).long(), a.long() @ w.long().t())


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("M,N,K", SHAPES[:3], ids=SHAPE_IDS[:3])
def test_int8_matches_reference(M, N, K, activation):
    """Exact accumulator and the epilogue's order: equal to reference.scaled_mm up to one output rounding."""
    for out_dtype, bias_dtype, scalar in ((torch.bfloat16, torch.bfloat16, False), (torch.float32, None, True),
                                          (torch.float16, torch.float32, False)):
        a, a_scale, w, w_scale, bias = _operands(M, N, K, torch.int8, seed=M * N + K, scalar_scales=scalar,
                                                 bias_dtype=bias_dtype)
        out = gemv.scaled_gemv(a, w, a_scale, w_scale, bias, activation, out_dtype)
        ref = reference.scaled_mm(a, w, a_scale, w_scale, bias, activation, out_dtype)
        assert out.shape == (M, N) and out.dtype == out_dtype
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), ref.float(), rtol=ULP_RTOL[out_dtype], atol=1e-5)


def _fp8_bound(a, w, a_scale, w_scale, bias, out_ref, out_dtype):
    """Elementwise error bound of the FP8 output against the float64 result.

    Each e4m3 x e4m3 product is exact in fp32 (4 x 4 significant bits); summing n of them in
    fp32 in any order errs by at most gamma_n * sum|a_k w_k|, gamma_n = n u / (1 - n u),
    u = 2**-24, and the kernel's order (a tree over BLOCK_K, then K / BLOCK_K sequential
    additions) has depth below K, so n = K is safe. The activations' slopes are below 1.13; the
    fp32 epilogue adds a few ulps; the output cast one rounding of out_dtype.
    """
    K = a.shape[1]
    u = 2.0**-24
    gamma = K * u / (1 - K * u)
    abs_sum = a.double().abs() @ w.double().abs().t()
    scale = (a_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)).abs()
    epilogue = abs_sum * scale + (0.0 if bias is None else bias.double().abs())
    return 1.13 * (gamma * abs_sum * scale + 8 * u * epilogue) + ULP_RTOL[out_dtype] * out_ref.abs() + 1e-30


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("M,N,K", SHAPES[:3], ids=SHAPE_IDS[:3])
def test_fp8_within_fp32_summation_bound(M, N, K, activation):
    for out_dtype, bias_dtype, scalar in ((torch.float32, torch.bfloat16, False), (torch.bfloat16, None, True),
                                          (torch.float16, torch.float32, False)):
        a, a_scale, w, w_scale, bias = _operands(M, N, K, torch.float8_e4m3fn, seed=M * N + K + 1,
                                                 scalar_scales=scalar, bias_dtype=bias_dtype)
        out = gemv.scaled_gemv(a, w, a_scale, w_scale, bias, activation, out_dtype)
        ref, _ = _float64_reference(a, w, a_scale, w_scale, bias, activation)
        assert out.shape == (M, N) and out.dtype == out_dtype
        err = (out.double() - ref).abs()
        bound = _fp8_bound(a, w, a_scale, w_scale, bias, ref, out_dtype)
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES[3:], ids=SHAPE_IDS[3:])
def test_more_shapes_match_float64(dtype, M, N, K):
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, seed=N + K, bias_dtype=torch.float32)
    out = gemv.scaled_gemv(a, w, a_scale, w_scale, bias, "gelu_tanh", torch.float32)
    ref, _ = _float64_reference(a, w, a_scale, w_scale, bias, "gelu_tanh")
    err = (out.double() - ref).abs()
    assert bool((err <= _fp8_bound(a, w, a_scale, w_scale, bias, ref, torch.float32)).all())


def test_fp8_bound_catches_a_wrong_kernel():
    """The FP8 bound is tight enough to fail on one K element dropped from the sum."""
    a, a_scale, w, w_scale, bias = _operands(2, 96, 272, torch.float8_e4m3fn, seed=5)
    ref, _ = _float64_reference(a, w, a_scale, w_scale, bias, "none")
    a_dropped = a.clone()
    a_dropped[:, 100] = 0
    wrong = gemv.scaled_gemv(a_dropped, w, a_scale, w_scale, bias, "none", torch.float32)
    assert not bool(((wrong.double() - ref).abs() <= _fp8_bound(a, w, a_scale, w_scale, bias, ref,
                                                                  torch.float32)).all())


def test_empty_n_returns_empty():
    a, a_scale, w, w_scale, _ = _operands(2, 1, 32, torch.int8, seed=0)
    out = gemv.scaled_gemv(a, w[:0], a_scale, w_scale[:0], None)
    assert out.shape == (2, 0)


def _bad_calls():
    a, a_scale, w, w_scale, bias = _operands(2, 16, 64, torch.int8, seed=1)
    a5, a5_scale, _, _, _ = _operands(5, 16, 64, torch.int8, seed=1)
    a_fp8, _, _, _, _ = _operands(2, 16, 64, torch.float8_e4m3fn, seed=1)
    return {
        "M5": ((a5, w, a5_scale, w_scale, bias), {}, "M=5"),
        "dtype_mismatch": ((a_fp8, w, a_scale, w_scale, bias), {}, "w.dtype"),
        "K_not_16": ((a[:, :40], w[:, :40], a_scale, w_scale, bias), {}, "K=40"),
        "scale_shape": ((a, w, a_scale, w_scale[:3], bias), {}, "w_scale"),
        "scale_dtype": ((a, w, a_scale.double(), w_scale, bias), {}, "a_scale.dtype"),
        "activation": ((a, w, a_scale, w_scale, bias), {"activation": "tanh"}, "activation"),
        "out_dtype": ((a, w, a_scale, w_scale, bias), {"out_dtype": torch.int32}, "out_dtype"),
        "bias_shape": ((a, w, a_scale, w_scale, bias[:5]), {}, "bias"),
        "config": ((a, w, a_scale, w_scale, bias), {"config": {"BLOCK_N": 6, "BLOCK_K": 256}}, "BLOCK_N=6"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_value_error(case):
    args, kwargs, needle = _bad_calls()[case]
    with pytest.raises(ValueError, match=needle):
        gemv.scaled_gemv(*args, **kwargs)



# ------------------------------------------------------------------ gemm.scaled_mm's dispatch to it


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_scaled_mm_runs_single_rows_on_the_gemv(dtype):
    from quantkit.kernels import gemm

    a, a_scale, w, w_scale, bias = _operands(1, 96, 272, dtype, seed=7)
    auto = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu")
    assert torch.equal(auto, gemv.scaled_gemv(a, w, a_scale, w_scale, bias, "silu"))
    assert torch.equal(auto, gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu", kernel="gemv"))
    tiled = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu", kernel="tiled")
    # Same products summed in another order, then one bf16 rounding each (truncation under the
    # interpreter, GPU.md): two bf16 ulps.
    torch.testing.assert_close(auto.float(), tiled.float(), rtol=2**-7, atol=1e-5)


def test_scaled_mm_gemv_kernel_limits():
    from quantkit.kernels import gemm

    a, a_scale, w, w_scale, bias = _operands(4, 96, 272, torch.int8, seed=8)
    assert torch.equal(gemm.scaled_mm(a, w, a_scale, w_scale, bias, kernel="gemv"),
                       gemv.scaled_gemv(a, w, a_scale, w_scale, bias))
    a5, a5_scale, _, _, _ = _operands(5, 96, 272, torch.int8, seed=9)
    with pytest.raises(ValueError, match="kernel='gemv' takes .* M <= 4 rows \\(M=5\\)"):
        gemm.scaled_mm(a5, w, a5_scale, w_scale, kernel="gemv")



@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("M,activation", [(1, "silu"), (3, "gelu_tanh")])
def test_gated_gemv_matches_the_reference(dtype, M, activation):
    from quantkit.kernels import gemm

    a, a_scale, w, w_scale, _ = _operands(M, 200, 272, dtype, seed=11 + M)
    # The stacked [gate; up] weight: 2 x 100 rows, per-channel scales for all 200.
    out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, activation, kernel="gemv" if M > 1 else "auto")
    assert out.shape == (M, 100)
    expected = reference.gated_scaled_mm(a, w, a_scale, w_scale, activation, torch.float32)
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=1e-5)  # one bf16 rounding (truncated)
    if dtype == torch.int8:
        # Exact integer sums: only the fp32 epilogue and the bf16 rounding separate it from the twin.
        tiled = gemm.gated_scaled_mm(a, w, a_scale, w_scale, activation, kernel="tiled")
        assert torch.equal(out, tiled)


def test_single_row_with_a_k_stride_is_refused():
    from quantkit.kernels import gemm

    a, a_scale, w, w_scale, _ = _operands(1, 96, 272, torch.int8, seed=12)
    strided = torch.zeros(1, 2 * 272, dtype=torch.int8)
    strided[:, ::2] = a
    with pytest.raises(ValueError, match="unit stride along K"):
        gemm.scaled_mm(strided[:, ::2], w, a_scale, w_scale)
