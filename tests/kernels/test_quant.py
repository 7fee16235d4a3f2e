"""Activation-quantization kernels under the interpreter, against reference.py.

Per-token and per-tensor quantization are bit-exact with the reference (same IEEE division,
same round-half-even); the fused RMSNorm sums squares in another order, so its scale may differ
in the last bits and a value on a rounding boundary may move by one step.
"""

import pytest
import torch

from quantkit.kernels import quant, reference

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
    "keep_input_dtype": {"keep_input_dtype": True},
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
    # 300 = 2 full 128-wide chunks + a ragged one: the three passes over the row.
    M, K = 5, 300
    x = _x(M, K, torch.bfloat16, seed=6)
    residual = _x(M, K, torch.bfloat16, seed=7) if with_residual else None
    weight = torch.randn(K)
    q, scale, new_residual = quant.rms_norm_quant_per_token(
        x, weight, 1e-6, qdtype, residual, 1.0, out=_poisoned_q(M, K, qdtype),
        out_scale=torch.full((M,), float("nan")), config={"chunk_k": 128})
    ref_q, ref_scale, ref_residual = reference.rms_norm_quant_per_token(x, weight, 1e-6, qdtype, residual, 1.0)
    if with_residual:
        assert torch.equal(new_residual, ref_residual)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    dequant, ref_dequant = q.float() * scale[:, None], ref_q.float() * ref_scale[:, None]
    assert (dequant - ref_dequant).norm() / ref_dequant.norm() < 1e-3


def test_rms_norm_long_rows_default_to_the_chunked_kernel_without_residual():
    assert quant.rms_norm_launch_config(14336)["chunk_k"] > 0
    assert quant.rms_norm_launch_config(14336, has_residual=True)["chunk_k"] == 0
    assert quant.rms_norm_launch_config(4096)["chunk_k"] == 0
    assert not quant.per_token_launch_config(14336)["single_pass"]
    assert quant.per_token_launch_config(4096)["single_pass"]


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
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 126.5, 127.4, -127.6, 300.0, 3.5]])
    q = quant.quantize_per_tensor(x, torch.ones(1), torch.int8)
    assert q.tolist() == [[0, 2, 2, 0, -2, -2, 0, 126, 127, -127, 127, 4]]


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
def test_quantize_per_tensor_bit_exact(qdtype, xdtype):
    M, K = 13, 300
    x = _x(M, K, xdtype)
    scale = torch.tensor([0.07])
    q = quant.quantize_per_tensor(x, scale, qdtype, out=_poisoned_q(M, K, qdtype))
    assert torch.equal(q.view(torch.int8), reference.quantize_per_tensor(x, scale, qdtype).view(torch.int8))


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
    ],
    ids=["int_input", "bad_qdtype", "non_contiguous", "3d", "scale_numel", "scale_dtype", "weight_shape",
         "residual_dtype", "residual_shape"],
)
def test_bad_input_raises_clear_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
