"""Triton scaled GEMMs (runs under TRITON_INTERPRET=1 on CPU) against reference.py and float64.

Outputs are poisoned with NaN (or a sentinel for int32) before each launch, so an element the
kernel forgot to write fails the test. INT8 accumulators are compared exactly.
"""

import random

import pytest
import torch

from quantkit.kernels import gemm, reference

QDTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
# M in {1, 13, 128, 257}; K a multiple of 16 but not of the interpreter's 64-wide K tile (80, 208)
# as well as a multiple of it (128); N not a multiple of the 64-wide N tile.
SHAPES = [(1, 64, 128), (13, 70, 80), (128, 96, 208), (257, 40, 64)]


def _operands(M, N, K, dtype, seed, n_weight_rows=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * 2
    w_float = torch.randn(n_weight_rows or N, K, generator=gen)
    a, a_scale = reference.quantize_per_token(x, dtype)
    w, w_scale = reference.quantize_per_channel(w_float, dtype)
    bias = torch.randn(N, generator=gen)
    return a, a_scale, w, w_scale, bias


def _poisoned(M, N, dtype):
    return torch.full((M, N), float("nan"), dtype=dtype)


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# bf16 keeps 8 significant bits: one rounding is at most 2**-9 relative; fp16 2**-12. fp32: the
# kernel's erf/exp differ from torch's in the last bits, and 1 + erf(x) for very negative x
# cancels, so GELU's relative error there reaches ~1e-5.
ULP_RTOL = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-4}

# The interpreter evaluates sigmoid's exp(-x) in numpy, which warns when it saturates to inf
# (the result, 1 / (1 + inf) = 0, is the right one).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _assert_matches_reference(out, ref, out_dtype):
    """Same math in the same order: equal up to one rounding of the output dtype (plus a few
    fp32 ulps from the activation's transcendental functions)."""
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements"
    torch.testing.assert_close(out.float(), ref.float(), rtol=ULP_RTOL[out_dtype], atol=1e-5)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"M{m}_N{n}_K{k}" for m, n, k in SHAPES])
def test_int8_accumulator_is_exact(M, N, K):
    a, _, w, _, _ = _operands(M, N, K, torch.int8, seed=M + K)
    out = torch.full((M, N), -123456, dtype=torch.int32)
    acc = gemm.int8_matmul_accumulator(a, w, out=out)
    assert acc.data_ptr() == out.data_ptr()
    assert torch.equal(acc, reference.int8_matmul_exact(a, w))


def test_int8_accumulator_exact_at_saturation():
    # Products of +-127 and -128: the largest sums an int8 GEMM can produce (-128 * -128 * K).
    K = 1024
    a = torch.full((3, K), 127, dtype=torch.int8)
    a[1] = -128
    w = torch.full((17, K), 127, dtype=torch.int8)
    w[5] = -128
    acc = gemm.int8_matmul_accumulator(a, w)
    assert torch.equal(acc, reference.int8_matmul_exact(a, w))
    assert acc[0, 0].item() == 127 * 127 * K
    assert acc[1, 5].item() == 128 * 128 * K


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"M{m}_N{n}_K{k}" for m, n, k in SHAPES])
def test_scaled_mm_matches_reference_and_fp64(dtype, M, N, K):
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, seed=7 * M + K)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu", out_dtype, out=_poisoned(M, N, out_dtype))
        _assert_matches_reference(out, reference.scaled_mm(a, w, a_scale, w_scale, bias, "silu", out_dtype), out_dtype)
        exact = reference.fp64_scaled_mm(a, w, a_scale, w_scale, bias, "silu")
        assert _rel_err(out, exact) < (4e-3 if out_dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("scalar_scales", [False, True], ids=["vector_scales", "scalar_scales"])
def test_every_epilogue(dtype, activation, has_bias, scalar_scales):
    M, N, K = 13, 70, 80
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, seed=3)
    if scalar_scales:
        a_scale, w_scale = a_scale[:1].clone(), w_scale.amax().reshape(1)
    b = bias if has_bias else None
    out = gemm.scaled_mm(a, w, a_scale, w_scale, b, activation, torch.float32, out=_poisoned(M, N, torch.float32))
    ref = reference.scaled_mm(a, w, a_scale, w_scale, b, activation, torch.float32)
    _assert_matches_reference(out, ref, torch.float32)
    assert _rel_err(out, reference.fp64_scaled_mm(a, w, a_scale, w_scale, b, activation)) < 1e-6


@pytest.mark.parametrize("dtype", QDTYPES)
def test_fp16_output(dtype):
    M, N, K = 13, 70, 80
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, seed=11)
    out = gemm.scaled_mm(a, w, a_scale, w_scale, bias * 0.01, "gelu_tanh", torch.float16,
                         out=_poisoned(M, N, torch.float16))
    ref = reference.scaled_mm(a, w, a_scale, w_scale, bias * 0.01, "gelu_tanh", torch.float16)
    _assert_matches_reference(out, ref, torch.float16)


def test_int8_with_unit_scales_is_the_exact_accumulator():
    M, N, K = 13, 70, 208
    a, _, w, _, _ = _operands(M, N, K, torch.int8, seed=5)
    ones_m, ones_n = torch.ones(M), torch.ones(N)
    out = gemm.scaled_mm(a, w, ones_m, ones_n, None, "none", torch.float32)
    # |acc| < 2**24 here, so the fp32 output holds the int32 accumulator exactly.
    assert torch.equal(out, reference.int8_matmul_exact(a, w).float())


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("M", [1, 13, 257])
def test_gated_scaled_mm(dtype, activation, M):
    N, K = 70, 80
    a, a_scale, w, w_scale, _ = _operands(M, N, K, dtype, seed=M, n_weight_rows=2 * N)
    out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, activation, torch.float32, out=_poisoned(M, N, torch.float32))
    ref = reference.gated_scaled_mm(a, w, a_scale, w_scale, activation, torch.float32)
    _assert_matches_reference(out, ref, torch.float32)
    # And against two independent GEMMs in float64.
    gate = reference.fp64_scaled_mm(a, w[:N], a_scale, w_scale[:N], None, activation)
    up = reference.fp64_scaled_mm(a, w[N:], a_scale, w_scale[N:])
    assert _rel_err(out, gate * up) < 1e-6


def test_gated_pairs_gate_with_its_own_up_rows():
    # A weight whose up half is the identity pattern exposes any gate/up row mismatch.
    M, N, K = 5, 64, 64
    a = torch.randint(-127, 128, (M, K), dtype=torch.int8)
    gate = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    up = torch.zeros(N, K, dtype=torch.int8)
    up[torch.arange(N), torch.arange(N) % K] = 1
    w = torch.cat([gate, up])
    ones = torch.ones(1)
    out = gemm.gated_scaled_mm(a, w, ones, ones, "relu", torch.float32)
    expected = torch.relu(reference.int8_matmul_exact(a, gate).float()) * a[:, torch.arange(N) % K].float()
    assert torch.equal(out, expected)


def test_fuzz_random_shapes_and_flags():
    """>= 200 seeded random combinations of shape, dtype, scales, bias, activation, gating, out dtype,
    kernel (tiled or persistent TMA) and FP8 accumulation mode."""
    rng = random.Random(1234)
    for case in range(240):
        dtype = rng.choice([torch.int8, torch.float8_e4m3fn])
        M = rng.choice([1, 2, 3, 5, 13, 16, 17, 31, 64, 65, 100, 128, 257])
        N = rng.choice([1, 3, 16, 33, 64, 65, 100])
        K = 16 * rng.randint(1, 12)
        gated = rng.random() < 0.25
        activation = rng.choice(reference.ACTIVATIONS)
        has_bias = not gated and rng.random() < 0.5
        out_dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, seed=case, n_weight_rows=2 * N if gated else N)
        if rng.random() < 0.3:
            a_scale = a_scale[:1].clone()
        if rng.random() < 0.3:
            w_scale = w_scale[:1].clone()
        bias = bias * 0.1 if has_bias else None
        kernel = rng.choice(["auto", "auto", "tiled", "persistent"])
        if kernel == "persistent" and N * out_dtype.itemsize % 16:
            kernel = "tiled"  # TMA needs 16-byte output rows (test_bad_kernel_choice_raises)
        fast = rng.random() < 0.7  # FP8 only: fast or promoted accumulation
        ctx = (f"case {case}: {dtype} M={M} N={N} K={K} gated={gated} act={activation} bias={has_bias} {out_dtype} "
               f"kernel={kernel} fast={fast}")
        flags = {"kernel": kernel, "fp8_fast_accum": fast, "out": _poisoned(M, N, out_dtype)}
        if gated:
            out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, activation, out_dtype, **flags)
            ref = reference.gated_scaled_mm(a, w, a_scale, w_scale, activation, torch.float32)
        else:
            out = gemm.scaled_mm(a, w, a_scale, w_scale, bias, activation, out_dtype, **flags)
            ref = reference.scaled_mm(a, w, a_scale, w_scale, bias, activation, torch.float32)
        assert not out.isnan().any(), ctx
        # ref is fp32; the kernel's one extra rounding is to out_dtype.
        torch.testing.assert_close(out.float(), ref, rtol=ULP_RTOL[out_dtype], atol=1e-3 if out_dtype == torch.float16 else 1e-5,
                                   msg=lambda m: f"{ctx}\n{m}")


# ---------------------------------------------------------------------------------------------- bad input


def _valid(dtype=torch.int8, M=4, N=32, K=64):
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, seed=0)
    return a, w, a_scale, w_scale, bias


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a, w, sa, sw, b: (a.float(), w, sa, sw, b), "a.dtype"),
        (lambda a, w, sa, sw, b: (a, w.to(torch.float8_e4m3fn), sa, sw, b), "w.dtype"),
        (lambda a, w, sa, sw, b: (a, w[:, :48].contiguous(), sa, sw, b), "K mismatch"),
        (lambda a, w, sa, sw, b: (a[:, :40].contiguous(), w[:, :40].contiguous(), sa, sw, b), "multiple of 16"),
        (lambda a, w, sa, sw, b: (a.t().contiguous().t(), w, sa, sw, b), "strides"),
        (lambda a, w, sa, sw, b: (a, w, sa[:3], sw, b), "a_scale has shape"),
        (lambda a, w, sa, sw, b: (a, w, sa, sw.view(-1, 1), b), r"scale.view\(-1\)"),
        (lambda a, w, sa, sw, b: (a, w, sa.double(), sw, b), "float32"),
        (lambda a, w, sa, sw, b: (a, w, sa, sw, b[:5]), "bias has shape"),
        (lambda a, w, sa, sw, b: (a[None], w, sa, sw, b), "2-D"),
    ],
    ids=["a_float", "w_dtype", "k_mismatch", "k_alignment", "non_contiguous", "a_scale_shape", "w_scale_2d",
         "scale_dtype", "bias_shape", "3d_input"],
)
def test_bad_input_raises_clear_value_error(mutate, match):
    args = mutate(*_valid())
    with pytest.raises(ValueError, match=match):
        gemm.scaled_mm(*args, activation="none", out_dtype=torch.bfloat16)


def test_bad_activation_out_dtype_and_gated_rows():
    a, w, sa, sw, b = _valid()
    with pytest.raises(ValueError, match="activation='swish'"):
        gemm.scaled_mm(a, w, sa, sw, b, "swish", torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm.scaled_mm(a, w, sa, sw, b, "none", torch.int8)
    with pytest.raises(ValueError, match="2 \\* N rows"):
        gemm.gated_scaled_mm(a, w[:31].contiguous(), sa, sw[:31].contiguous(), "silu", torch.bfloat16)
    with pytest.raises(ValueError, match="out is"):
        gemm.scaled_mm(a, w, sa, sw, b, "none", torch.bfloat16, out=torch.empty(4, 31, dtype=torch.bfloat16))


# ---------------------------------------------------------------------------------------------- kernels and FP8 modes
# The persistent TMA kernel (gemm_tma.py) runs under the interpreter with 3 "SMs" and 64-wide
# tiles, so these shapes walk several tiles per program, the grouped order, the zero-filled K
# tail and the clipped edge tiles.
PERSISTENT_SHAPES = [(1, 64, 128), (13, 72, 80), (257, 136, 208), (300, 64, 64)]


@pytest.mark.parametrize("M,N,K", PERSISTENT_SHAPES, ids=[f"M{m}_N{n}_K{k}" for m, n, k in PERSISTENT_SHAPES])
def test_persistent_int8_accumulator_is_exact(M, N, K):
    a, _, w, _, _ = _operands(M, N, K, torch.int8, seed=M + 2 * K)
    acc = gemm.int8_matmul_accumulator(a, w, out=torch.full((M, N), -123456, dtype=torch.int32), kernel="persistent")
    assert torch.equal(acc, reference.int8_matmul_exact(a, w))


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("fp8_fast_accum", [True, False], ids=["fast_accum", "promoted"])
@pytest.mark.parametrize("kernel", ["tiled", "persistent"])
@pytest.mark.parametrize("M,N,K", PERSISTENT_SHAPES, ids=[f"M{m}_N{n}_K{k}" for m, n, k in PERSISTENT_SHAPES])
def test_kernels_and_accumulation_modes_match_reference(dtype, fp8_fast_accum, kernel, M, N, K):
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, seed=5 * M + K)
    for out_dtype in (torch.bfloat16, torch.float32):
        out = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "gelu_tanh", out_dtype, out=_poisoned(M, N, out_dtype),
                             fp8_fast_accum=fp8_fast_accum, kernel=kernel)
        ref = reference.scaled_mm(a, w, a_scale, w_scale, bias, "gelu_tanh", out_dtype)
        _assert_matches_reference(out, ref, out_dtype)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("activation", ["none", "silu"])
def test_persistent_scalar_scales_no_bias(dtype, activation):
    M, N, K = 70, 40, 96
    a, a_scale, w, w_scale, _ = _operands(M, N, K, dtype, seed=9)
    a_scale, w_scale = a_scale[:1].clone(), w_scale[:1].clone()
    out = gemm.scaled_mm(a, w, a_scale, w_scale, None, activation, torch.float32, out=_poisoned(M, N, torch.float32),
                         kernel="persistent")
    _assert_matches_reference(out, reference.scaled_mm(a, w, a_scale, w_scale, None, activation, torch.float32),
                              torch.float32)


# Session-4 persistent options: the epilogue stored in quarters, two programs per SM (a longer
# tile stride: each program walks fewer tiles), the A tile routed through registers (an identity
# move on the GPU; plumbing only under the interpreter).
PERSISTENT_OPTIONS = [
    {"EPILOGUE_SPLIT": 4},
    {"CTAS_PER_SM": 2},
    {"EPILOGUE_SPLIT": 4, "CTAS_PER_SM": 2, "A_IN_REGISTERS": True, "GROUP_M": 1},
]


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("options", PERSISTENT_OPTIONS, ids=["quarters", "two_per_sm", "all"])
def test_persistent_options_match_reference_exactly(dtype, options):
    M, N, K = 257, 200, 208  # 5 x 4 tiles of 64 on 3 (or 6) programs; N tail of 8 columns
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, seed=11)
    config = {**gemm_tma_interpreter_config(), **options, "num_warps": 4, "num_stages": 3}
    out = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu", torch.bfloat16, out=_poisoned(M, N, torch.bfloat16),
                         config=config, kernel="persistent")
    ref = reference.scaled_mm(a, w, a_scale, w_scale, bias, "silu", torch.bfloat16)
    if dtype == torch.int8:
        assert torch.equal(out, ref)  # exact int32 accumulator, the reference's epilogue order
    else:
        _assert_matches_reference(out, ref, torch.bfloat16)
    if dtype == torch.int8:
        acc = gemm.int8_matmul_accumulator(a, w, config=config, kernel="persistent",
                                           out=torch.full((M, N), -7, dtype=torch.int32))
        assert torch.equal(acc, reference.int8_matmul_exact(a, w))


def test_two_ctas_per_sm_config_is_tuned_for_int8_only():
    from quantkit.kernels import gemm_tma

    configs = gemm_tma.PERSISTENT_CONFIGS
    two_per_sm = [c for c in configs if c.kwargs["CTAS_PER_SM"] == 2]
    assert two_per_sm, "the INT8 two-CTAs-per-SM config should be in the autotune set"
    int8_pool = gemm_tma._prune_by_dtype(configs, {}, IS_INT8=True)
    fp8_pool = gemm_tma._prune_by_dtype(configs, {}, IS_INT8=False)
    assert int8_pool == configs
    assert fp8_pool == [c for c in configs if c not in two_per_sm]


def gemm_tma_interpreter_config():
    from quantkit.kernels import gemm_tma

    return dict(gemm_tma.INTERPRETER_CONFIG)


@pytest.mark.parametrize("bad,match", [({"EPILOGUE_SPLIT": 3}, "EPILOGUE_SPLIT=3"),
                                       ({"CTAS_PER_SM": 0}, "CTAS_PER_SM=0")])
def test_bad_persistent_config_raises(bad, match):
    a, a_scale, w, w_scale, _ = _operands(16, 64, 64, torch.int8, seed=2)
    with pytest.raises(ValueError, match=match):
        gemm.scaled_mm(a, w, a_scale, w_scale, config={**gemm_tma_interpreter_config(), **bad}, kernel="persistent")


def test_auto_takes_the_persistent_kernel_for_large_m_when_interpreted(monkeypatch):
    from quantkit.kernels import gemm_tma

    calls = []
    real = gemm_tma.launch_persistent
    monkeypatch.setattr(gemm_tma, "launch_persistent", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    a, a_scale, w, w_scale, _ = _operands(gemm.PERSISTENT_MIN_M, 64, 64, torch.int8, seed=1)
    gemm.scaled_mm(a, w, a_scale, w_scale)
    assert calls, "M >= PERSISTENT_MIN_M should run the persistent kernel under the interpreter"
    calls.clear()
    small = a[:16].contiguous()
    gemm.scaled_mm(small, w, a_scale[:16].contiguous(), w_scale)
    assert not calls


def test_gated_with_promoted_fp8_accumulation():
    M, N, K = 13, 40, 80
    a, a_scale, w, w_scale, _ = _operands(M, N, K, torch.float8_e4m3fn, seed=4, n_weight_rows=2 * N)
    out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32, out=_poisoned(M, N, torch.float32),
                               fp8_fast_accum=False)
    _assert_matches_reference(out, reference.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32),
                              torch.float32)


def test_bad_kernel_choice_raises():
    a, w, sa, sw, b = _valid()
    with pytest.raises(ValueError, match="kernel='fast'"):
        gemm.scaled_mm(a, w, sa, sw, b, kernel="fast")
    # An fp32 output row of 3 elements (12 bytes) cannot be a TMA row.
    a, sa, w, sw, _ = _operands(8, 3, 64, torch.int8, seed=0)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemm.scaled_mm(a, w, sa, sw, None, "none", torch.float32, kernel="persistent")
    # The same call on kernel="auto" falls back to the tiled kernel.
    out = gemm.scaled_mm(a, w, sa, sw, None, "none", torch.float32)
    _assert_matches_reference(out, reference.scaled_mm(a, w, sa, sw, None, "none", torch.float32), torch.float32)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("fp8_fast_accum", [True, False], ids=["fast_accum", "promoted"])
@pytest.mark.parametrize("M,N,K", PERSISTENT_SHAPES, ids=[f"M{m}_N{n}_K{k}" for m, n, k in PERSISTENT_SHAPES])
def test_persistent_gated_matches_reference_and_the_tiled_kernel(dtype, fp8_fast_accum, M, N, K):
    a, a_scale, w, w_scale, _ = _operands(M, N, K, dtype, seed=3 * M + K, n_weight_rows=2 * N)
    ref = reference.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32)
    outs = {}
    for kernel in ("persistent", "tiled"):
        outs[kernel] = gemm.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32,
                                            out=_poisoned(M, N, torch.float32), fp8_fast_accum=fp8_fast_accum,
                                            kernel=kernel)
        _assert_matches_reference(outs[kernel], ref, torch.float32)
    gate = reference.fp64_scaled_mm(a, w[:N], a_scale, w_scale[:N], None, "silu")
    up = reference.fp64_scaled_mm(a, w[N:], a_scale, w_scale[N:])
    assert _rel_err(outs["persistent"], gate * up) < 1e-6
    if dtype == torch.int8:
        # Exact int32 accumulators and the same epilogue arithmetic: the two kernels agree bit for bit.
        assert torch.equal(outs["persistent"], outs["tiled"])


def test_persistent_gated_scalar_weight_scale_bf16_out():
    M, N, K = 70, 40, 96
    a, a_scale, w, w_scale, _ = _operands(M, N, K, torch.int8, seed=12, n_weight_rows=2 * N)
    w_scale = w_scale[:1].clone()
    out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, "gelu_tanh", torch.bfloat16,
                               out=_poisoned(M, N, torch.bfloat16), kernel="persistent")
    _assert_matches_reference(out, reference.gated_scaled_mm(a, w, a_scale, w_scale, "gelu_tanh", torch.bfloat16),
                              torch.bfloat16)


def test_auto_takes_the_persistent_gated_kernel_for_large_m_int8(monkeypatch):
    from quantkit.kernels import gemm_tma

    calls = []
    real = gemm_tma.launch_persistent
    monkeypatch.setattr(gemm_tma, "launch_persistent", lambda *a, **kw: calls.append(kw.get("gated")) or real(*a, **kw))
    a, a_scale, w, w_scale, _ = _operands(gemm.PERSISTENT_MIN_M, 32, 64, torch.int8, seed=2, n_weight_rows=64)
    out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32)
    assert calls == [True]
    _assert_matches_reference(out, reference.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32),
                              torch.float32)
    # FP8 gated stays on the tiled kernel (measured faster on an H100).
    calls.clear()
    a, a_scale, w, w_scale, _ = _operands(gemm.PERSISTENT_MIN_M, 32, 64, torch.float8_e4m3fn, seed=2,
                                          n_weight_rows=64)
    gemm.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32)
    assert calls == []


# ---------------------------------------------------------------------------------------------- split tail
# The tiles of the partial last wave split along K (gemm_tma.tail_split_plan). Under the
# interpreter the "SM" count is patched so that each case really splits (asserted through the
# plan function), with data-parallel waves before the tail (W >= 1) and without (pure split-K).
SPLIT_CASES = [
    # M, N, K, sms, ctas, max_split, epilogue_split
    (450, 72, 208, 3, 1, 4, 2),     # 8 x 2 = 16 tiles on 3: 5 waves + 1 tile in 3 slices; K tail of 16
    (100, 136, 256, 16, 1, 2, 4),   # 2 x 3 tiles on 16 programs: no full wave, 2 slices each, quarters
    (197, 136, 320, 3, 2, 3, 1),    # 4 x 3 = 12 tiles on 6 programs (two per SM): no tail -> plain
    (197, 136, 320, 5, 1, 3, 1),    # 12 tiles on 5: 2 waves + 2 tiles, 2 slices, unsplit epilogue
    (64, 64, 80, 8, 1, 4, 2),       # 1 tile, 2 K steps -> 2 slices (one K step each)
]
SPLIT_IDS = [f"M{c[0]}_N{c[1]}_K{c[2]}_sms{c[3]}x{c[4]}_max{c[5]}_q{c[6]}" for c in SPLIT_CASES]


def _split_config(ctas, max_split, epilogue_split):
    from quantkit.kernels import gemm_tma

    return {**gemm_tma.INTERPRETER_CONFIG, "CTAS_PER_SM": ctas, "TAIL_SPLIT": max_split,
            "EPILOGUE_SPLIT": epilogue_split, "num_warps": 4, "num_stages": 3}


def _expected_splits(M, N, K, sms, ctas, max_split):
    from quantkit.kernels import gemm_tma

    return gemm_tma.tail_split_plan(M, N, K, 64, 64, 64, sms * ctas, max_split)


def _arrivals_are_zero():
    from quantkit.kernels import gemm_tma

    return all(not bool(arrivals.any()) for _, arrivals in gemm_tma._SPLIT_WORKSPACE.values())


def test_split_cases_cover_split_and_plain_plans():
    plans = [_expected_splits(M, N, K, sms, ctas, mx) for M, N, K, sms, ctas, mx, _ in SPLIT_CASES]
    assert plans == [3, 2, 1, 2, 2]


@pytest.mark.parametrize("M,N,K,sms,ctas,max_split,epilogue_split", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_tail_int8_is_exact(monkeypatch, M, N, K, sms, ctas, max_split, epilogue_split):
    from quantkit.kernels import gemm_tma

    monkeypatch.setattr(gemm_tma, "INTERPRETER_NUM_SMS", sms)
    config = _split_config(ctas, max_split, epilogue_split)
    a, a_scale, w, w_scale, bias = _operands(M, N, K, torch.int8, seed=M + N + K)
    acc = gemm.int8_matmul_accumulator(a, w, config=config, kernel="persistent",
                                       out=torch.full((M, N), -123456, dtype=torch.int32))
    assert torch.equal(acc, reference.int8_matmul_exact(a, w))
    # Dequant + bias in the reference's order on the exact sum: the same bits (an activation's
    # exp can differ from torch's in the last fp32 bit, so it is compared with a tolerance).
    out = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "none", torch.bfloat16, out=_poisoned(M, N, torch.bfloat16),
                         config=config, kernel="persistent")
    assert torch.equal(out, reference.scaled_mm(a, w, a_scale, w_scale, bias, "none", torch.bfloat16))
    out = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu", torch.float32, out=_poisoned(M, N, torch.float32),
                         config=config, kernel="persistent")
    _assert_matches_reference(out, reference.scaled_mm(a, w, a_scale, w_scale, bias, "silu", torch.float32),
                              torch.float32)
    assert _arrivals_are_zero(), "the last slice of each tail tile resets its arrival counter"


@pytest.mark.parametrize("fp8_fast_accum", [True, False], ids=["fast_accum", "promoted"])
@pytest.mark.parametrize("M,N,K,sms,ctas,max_split,epilogue_split", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_tail_fp8_matches_reference_and_repeats(monkeypatch, fp8_fast_accum, M, N, K, sms, ctas, max_split,
                                                      epilogue_split):
    from quantkit.kernels import gemm_tma

    monkeypatch.setattr(gemm_tma, "INTERPRETER_NUM_SMS", sms)
    config = _split_config(ctas, max_split, epilogue_split)
    a, a_scale, w, w_scale, bias = _operands(M, N, K, torch.float8_e4m3fn, seed=3 * M + K)
    outs = [gemm.scaled_mm(a, w, a_scale, w_scale, bias, "gelu_tanh", torch.float32, config=config,
                           out=_poisoned(M, N, torch.float32), fp8_fast_accum=fp8_fast_accum, kernel="persistent")
            for _ in range(2)]
    _assert_matches_reference(outs[0], reference.scaled_mm(a, w, a_scale, w_scale, bias, "gelu_tanh", torch.float32),
                              torch.float32)
    assert torch.equal(outs[0], outs[1]), "the split sum is taken in slice order: the same bits every call"
    assert _arrivals_are_zero()


def test_split_tail_plan():
    from quantkit.kernels.gemm_tma import tail_split_plan

    # H100 (132 SMs), 128x256x128 tiles: Llama-3-8B qkv at M=1024 is 192 tiles = 1 wave + 60.
    assert tail_split_plan(1024, 6144, 4096, 128, 256, 128, 132, 4) == 2
    # 4096 x 4096 at M=1024: 128 tiles in one partial wave, too many to split on 132 programs.
    assert tail_split_plan(1024, 4096, 4096, 128, 256, 128, 132, 4) == 1
    # 28672 x 4096 at M=4096: 3584 tiles = 27 waves + 20 -> capped by max_split (6 would fit).
    assert tail_split_plan(4096, 28672, 4096, 128, 256, 128, 132, 4) == 4
    assert tail_split_plan(4096, 28672, 4096, 128, 256, 128, 132, 8) == 6
    # Two CTAs per SM, 128x128: 384 tiles on 264 programs = 1 wave + 120 -> 2 slices.
    assert tail_split_plan(1024, 6144, 4096, 128, 128, 128, 264, 4) == 2
    # Whole waves, TAIL_SPLIT off, and K too short for two slices: no split.
    assert tail_split_plan(4096, 4096, 4096, 128, 256, 128, 128, 4) == 1
    assert tail_split_plan(1024, 6144, 4096, 128, 256, 128, 132, 1) == 1
    assert tail_split_plan(1024, 6144, 128, 128, 256, 128, 132, 4) == 1


@pytest.mark.parametrize("bad,match", [({"TAIL_SPLIT": 0}, "TAIL_SPLIT=0"), ({"TAIL_SPLIT": 2.0}, "TAIL_SPLIT=2.0")])
def test_bad_tail_split_raises(bad, match):
    a, a_scale, w, w_scale, _ = _operands(16, 64, 64, torch.int8, seed=2)
    with pytest.raises(ValueError, match=match):
        gemm.scaled_mm(a, w, a_scale, w_scale, config={**gemm_tma_interpreter_config(), **bad}, kernel="persistent")


def test_gated_rejects_tail_split():
    a, a_scale, w, w_scale, _ = _operands(64, 128, 64, torch.int8, seed=4)
    with pytest.raises(ValueError, match="gated"):
        gemm.gated_scaled_mm(a, w, a_scale, w_scale, config={**gemm_tma_interpreter_config(), "TAIL_SPLIT": 2},
                             kernel="persistent")


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("M,kernel", [(1, "auto"), (13, "tiled"), (13, "persistent")], ids=["gemv", "tiled", "persistent"])
def test_relu_keeps_nan_like_torch(qdtype, M, kernel):
    # tl.maximum(NaN, 0) is 0: a NaN token (its per-token scale) or bias used to come out of a
    # ReLU epilogue as zeros, where torch gives NaN.
    N, K = 40, 64
    a, a_scale, w, w_scale, bias = _operands(M, N, K, qdtype, seed=5)
    a_scale[M - 1] = float("nan")
    bias[3] = float("nan")
    out = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "relu", torch.float32, out=_poisoned(M, N, torch.float32),
                         kernel=kernel)
    ref = reference.scaled_mm(a, w, a_scale, w_scale, bias, "relu", torch.float32)
    assert out[M - 1].isnan().all() and out[:, 3].isnan().all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
