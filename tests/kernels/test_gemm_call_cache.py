"""``gemm.scaled_mm`` / ``gated_scaled_mm``'s per-signature call cache (``gemm._CALLS``).

The cache is the GPU launcher path's (it sits next to the autotuned plans, which the interpreter
does not use), so these tests run the launcher as on the GPU (``gemm.INTERPRETED`` off, the
autotuners reduced to one interpreter-sized config, as ``test_gemm_splitk`` does) while the
kernels still run under the interpreter: the numbers are real. What the cache may never change:
the output (a cached call equals the uncached path bit for bit), the errors (bad input after a
good call of a similar signature raises the same ValueError), the kernel choice (a call whose
pointers are not 16-byte aligned never takes a cached persistent plan: TMA needs aligned bases),
triton's own path when ``launch.ENABLED`` is off, and memory (bounded).
"""

import pytest
import torch
import triton

from quantkit.kernels import call_cache, gemm, gemm_tma, launch, reference
from tests.kernels.fake_launch import FakeDriver, RecordingKernel

DTYPES = [torch.int8, torch.float8_e4m3fn]
DTYPE_IDS = ["int8", "fp8"]
# Rows from which "auto" takes the persistent kernel in these tests (1024 on the GPU): the
# interpreter's cost is per program, so persistent-sized calls stay small.
PERSISTENT_M = 64


def _operands(M, N, K, dtype, seed=0, weight_rows=None):
    gen = torch.Generator().manual_seed(seed)
    a, a_scale = reference.quantize_per_token(torch.randn(M, K, generator=gen) * 2, dtype)
    w, w_scale = reference.quantize_per_channel(torch.randn(weight_rows or N, K, generator=gen), dtype)
    return a, a_scale, w, w_scale, torch.randn(N, generator=gen)


def _tiled_tuner():
    config = triton.Config({k: v for k, v in gemm.INTERPRETER_CONFIG.items()}, num_warps=4, num_stages=1)
    return triton.autotune(configs=[config], key=["N", "K"])(
        triton.heuristics(gemm.HEURISTICS)(gemm._scaled_mm_kernel))


@pytest.fixture
def gpu_launcher(monkeypatch):
    """The launchers' GPU path (call cache, autotuned plans) around interpreted kernels."""
    monkeypatch.setattr(gemm, "INTERPRETED", False)
    monkeypatch.setattr(gemm, "_check_runnable", lambda a: None)
    monkeypatch.setattr(gemm, "PERSISTENT_MIN_M", PERSISTENT_M)
    monkeypatch.setattr(gemm, "_scaled_mm_autotuned", _tiled_tuner())
    one = gemm_tma.INTERPRETER_CONFIG
    persistent = gemm_tma.make_autotuner([gemm_tma._cfg(one["BLOCK_M"], one["BLOCK_N"], one["BLOCK_K"], 4, 1,
                                                        split=one["EPILOGUE_SPLIT"], group_m=one["GROUP_M"])])
    monkeypatch.setattr(gemm_tma, "_autotuned", lambda gated=False: persistent)
    monkeypatch.setattr(gemm_tma, "num_sms", lambda device_index: gemm_tma.INTERPRETER_NUM_SMS)
    for module, name in ((gemm_tma, "_TUNED"), (gemm_tma, "_PLANS"), (gemm, "_TUNED_TILED"), (gemm, "_TILED_PLANS")):
        monkeypatch.setattr(module, name, {})
    monkeypatch.setattr(gemm, "_CALLS", call_cache.SignatureCache())
    validations = []
    check = gemm.check_scaled_mm_args
    monkeypatch.setattr(gemm, "check_scaled_mm_args", lambda *a, **kw: validations.append(1) or check(*a, **kw))
    return validations


def _run(op, a, w, a_scale, w_scale, bias, **kw):
    # float32 out: the kernels' bf16 store rounding differs under the interpreter (GPU.md).
    if op == "gated":
        return gemm.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32, **kw)
    return gemm.scaled_mm(a, w, a_scale, w_scale, bias if op == "bias_relu" else None,
                          "relu" if op == "bias_relu" else "none", torch.float32, **kw)


@pytest.mark.parametrize("op", ["plain", "bias_relu", "gated"])
@pytest.mark.parametrize("M", [13, PERSISTENT_M], ids=["tiled", "persistent_size"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cached_call_is_bit_identical_to_the_uncached_path(gpu_launcher, dtype, M, op):
    N, K = 64, 128
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype, weight_rows=2 * N if op == "gated" else N)
    tuned = _run(op, a, w, a_scale, w_scale, bias)  # the autotuner's launch: nothing cached yet
    assert len(gemm._CALLS) == 0
    planned = _run(op, a, w, a_scale, w_scale, bias)  # the plan's launch, kept under the signature
    assert len(gemm._CALLS) == 1 and len(gpu_launcher) == 2
    cached = _run(op, a.clone(), w, a_scale.clone(), w_scale, bias)  # new tensors, same signature
    assert len(gemm._CALLS) == 1 and len(gpu_launcher) == 2, "the third call should skip validation"
    uncached = _run(op, a, w, a_scale, w_scale, bias, out=torch.empty(M, N))
    assert all(torch.equal(t, uncached) for t in (tuned, planned, cached))
    (entry,) = gemm._CALLS.values()
    persistent = M >= PERSISTENT_M and not (op == "gated" and dtype != torch.int8)
    assert entry[5] is persistent and isinstance(entry[4], gemm_tma.PersistentCall) is persistent
    if op == "gated":
        want = reference.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32)
    else:
        want = reference.scaled_mm(a, w, a_scale, w_scale, bias if op == "bias_relu" else None,
                                   "relu" if op == "bias_relu" else "none", torch.float32)
    torch.testing.assert_close(cached, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bad_input_after_a_good_call_still_raises(gpu_launcher, dtype):
    M, N, K = 13, 64, 64
    a, a_scale, w, w_scale, bias = _operands(M, N, K, dtype)
    for _ in range(3):
        gemm.scaled_mm(a, w, a_scale, w_scale, bias)
    assert len(gemm._CALLS) == 1
    other = torch.float8_e4m3fn if dtype == torch.int8 else torch.int8
    with pytest.raises(ValueError, match=r"w.dtype=.* != a.dtype"):
        gemm.scaled_mm(a, w.view(other), a_scale, w_scale, bias)
    with pytest.raises(ValueError, match="K mismatch"):
        gemm.scaled_mm(a, _operands(M, N, K + 16, dtype)[2], a_scale, w_scale, bias)
    with pytest.raises(ValueError, match="unit stride along K"):
        gemm.scaled_mm(_operands(K, M, M, dtype)[0].t(), w, a_scale, w_scale, bias)  # same shape, K-major
    with pytest.raises(ValueError, match=r"a_scale has shape \(12,\)"):
        gemm.scaled_mm(a, w, a_scale[:-1], w_scale, bias)
    with pytest.raises(ValueError, match=r"bias has shape \(65,\)"):
        gemm.scaled_mm(a, w, a_scale, w_scale, torch.randn(N + 1))
    with pytest.raises(ValueError, match="scales must be float32"):
        gemm.scaled_mm(a, w, a_scale.double(), w_scale, bias)
    with pytest.raises(ValueError, match="gated GEMM takes no bias"):
        gemm.check_scaled_mm_args(a, w, a_scale, w_scale, bias, "silu", torch.float32, gated=True)
    with pytest.raises(ValueError, match="2 \\* N rows"):
        gemm.gated_scaled_mm(a, w[:-1], a_scale, w_scale[:-1])
    with pytest.raises(ValueError, match="activation='swish'"):
        gemm.scaled_mm(a, w, a_scale, w_scale, bias, "swish")
    assert len(gemm._CALLS) == 1


def _unaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor of the same shape and strides whose base is 1 byte off 16."""
    flat = torch.empty(t.numel() * t.element_size() + 16, dtype=torch.uint8)
    offset = (16 - flat.data_ptr() % 16) % 16 + 1
    out = flat[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    out.copy_(t)
    assert out.stride() == t.stride() and out.data_ptr() % 16 == 1
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_unaligned_call_does_not_take_a_cached_persistent_plan(gpu_launcher, dtype, monkeypatch):
    M, N, K = PERSISTENT_M, 64, 64
    a, a_scale, w, w_scale, _ = _operands(M, N, K, dtype)
    for _ in range(2):
        aligned_out = gemm.scaled_mm(a, w, a_scale, w_scale, out_dtype=torch.float32)
    (entry,) = gemm._CALLS.values()
    assert entry[5], "an aligned persistent-sized call should have cached the persistent kernel"
    persistent_launches = []
    real_call = gemm_tma.PersistentCall.__call__
    monkeypatch.setattr(gemm_tma.PersistentCall, "__call__",
                        lambda self, *args: persistent_launches.append(1) or real_call(self, *args))
    unaligned = _unaligned_copy(a)
    got = gemm.scaled_mm(unaligned, w, a_scale, w_scale, out_dtype=torch.float32)  # same signature
    assert not persistent_launches, "an unaligned a took the cached persistent (TMA) plan"
    assert torch.equal(got, gemm.scaled_mm(unaligned, w, a_scale, w_scale, out_dtype=torch.float32,
                                           out=torch.empty(M, N), kernel="tiled"))
    torch.testing.assert_close(got, aligned_out, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemm.scaled_mm(unaligned, w, a_scale, w_scale, out_dtype=torch.float32, kernel="persistent")
    # The entry is unchanged: the next aligned call launches the persistent plan again.
    assert list(gemm._CALLS.values()) == [entry]
    gemm.scaled_mm(a, w, a_scale, w_scale, out_dtype=torch.float32)
    assert persistent_launches == [1]


def test_tiled_pick_forced_by_unaligned_pointers_is_not_cached(gpu_launcher):
    M, N, K = PERSISTENT_M, 64, 64
    a, a_scale, w, w_scale, _ = _operands(M, N, K, torch.int8)
    unaligned = _unaligned_copy(a)
    for _ in range(2):
        gemm.scaled_mm(unaligned, w, a_scale, w_scale, out_dtype=torch.float32)
    assert len(gemm._CALLS) == 0
    gemm.scaled_mm(a, w, a_scale, w_scale, out_dtype=torch.float32)
    gemm.scaled_mm(a, w, a_scale, w_scale, out_dtype=torch.float32)
    (entry,) = gemm._CALLS.values()
    assert entry[5]


def test_config_and_out_calls_bypass_the_cache(gpu_launcher):
    M, N, K = 13, 64, 64
    a, a_scale, w, w_scale, bias = _operands(M, N, K, torch.int8)
    config = {**gemm.INTERPRETER_CONFIG, "num_warps": 4, "num_stages": 1}
    with_config = [gemm.scaled_mm(a, w, a_scale, w_scale, bias, config=config) for _ in range(2)]
    out = torch.empty(M, N, dtype=torch.bfloat16)
    with_out = [gemm.scaled_mm(a, w, a_scale, w_scale, bias, out=out).clone() for _ in range(2)]
    assert len(gemm._CALLS) == 0 and len(gpu_launcher) == 4
    assert torch.equal(with_config[0], with_config[1]) and torch.equal(with_out[0], with_out[1])
    assert torch.equal(with_config[0], with_out[0])


def test_call_cache_stays_bounded(gpu_launcher, monkeypatch):
    monkeypatch.setattr(gemm, "_CALLS", call_cache.SignatureCache(max_entries=4))
    _, _, w, w_scale, _ = _operands(1, 16, 32, torch.int8)
    for M in range(1, 12):
        a, a_scale, _, _, _ = _operands(M, 16, 32, torch.int8)
        for _ in range(2):
            gemm.scaled_mm(a, w, a_scale, w_scale, out_dtype=torch.float32)
        assert 0 < len(gemm._CALLS) <= 4


# ---------------------------------------------------------------------------------------------- GPU launch path


class _FakeTuner:
    def __init__(self, best_config):
        self.best_config = best_config
        self.configs = [best_config]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("M", [13, 2048], ids=["tiled", "persistent"])
def test_cached_calls_launch_directly_unless_the_launch_cache_is_off(monkeypatch, M):
    """With a fake compiled kernel (as in test_launch.py): cached calls launch the compiled kernel
    with what triton's path got (weight descriptor included); ``launch.ENABLED = False`` sends
    them through triton's path; a new weight of the same signature gets its own descriptor."""
    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_driver", lambda: FakeDriver())
    monkeypatch.setattr(gemm, "INTERPRETED", False)
    monkeypatch.setattr(gemm, "_check_runnable", lambda a: None)
    monkeypatch.setattr(gemm_tma, "num_sms", lambda device_index: 132)
    monkeypatch.setattr(gemm, "_scaled_mm_autotuned", _FakeTuner(gemm.LARGE_M_CONFIGS[0]))
    monkeypatch.setattr(gemm_tma, "_autotuned", lambda gated=False: _FakeTuner(gemm_tma.PERSISTENT_CONFIGS[0]))
    monkeypatch.setattr(gemm_tma, "_autotune_and_launch", lambda *args, **kwargs: None)
    for module, name in ((gemm_tma, "_TUNED"), (gemm_tma, "_PLANS"), (gemm, "_TUNED_TILED"), (gemm, "_TILED_PLANS")):
        monkeypatch.setattr(module, name, {})
    monkeypatch.setattr(gemm, "_CALLS", call_cache.SignatureCache())
    kernels = {}
    for module, name in ((gemm_tma, "_PERSISTENT"), (gemm, "_TILED")):
        cached = launch.CachedLaunch(getattr(module, name).kernel)
        cached.kernel = kernels[name] = RecordingKernel()
        monkeypatch.setattr(module, name, cached)
    kernel = kernels["_PERSISTENT" if M >= gemm.PERSISTENT_MIN_M else "_TILED"]
    a, a_scale, w, w_scale, _ = _operands(M, 256, 128, torch.float8_e4m3fn)
    for _ in range(4):  # autotuner (faked), plan -> triton's path, then two cached calls
        gemm.scaled_mm(a, w, a_scale, w_scale)
    assert len(gemm._CALLS) == 1 and len(kernel.triton_calls) == 1 and len(kernel.compiled.runs) == 2
    _, args, kwargs = kernel.triton_calls[0]
    tail = tuple(kwargs[name] for name in kernel_arg_names(M)[len(args):])
    for run in kernel.compiled.runs:
        assert run[3:9] == (1234, "fn-handle", "packed", None, None, None)
        assert len(run[9:]) == len(args) + len(tail)
        for i, (got, want) in enumerate(zip(run[9:], args + tail)):
            if hasattr(want, "block_shape") and not isinstance(want, torch.Tensor):  # a TensorDescriptor
                assert (list(got.shape), list(got.strides), list(got.block_shape)) == \
                    (list(want.shape), list(want.strides), list(want.block_shape))
                if i < 2:  # a and w (the output is a new tensor per call)
                    assert got.base.data_ptr() == want.base.data_ptr()
            elif isinstance(want, torch.Tensor):
                assert got.dtype == want.dtype and got.shape == want.shape
            else:
                assert got == want
    w2 = w.clone()
    gemm.scaled_mm(a, w2, a_scale, w_scale)
    first_pointer = kernel.compiled.runs[-1][9]
    if M >= gemm.PERSISTENT_MIN_M:
        assert kernel.compiled.runs[-1][10].base.data_ptr() == w2.data_ptr()
        assert first_pointer.base is a
    monkeypatch.setattr(launch, "ENABLED", False)
    runs = len(kernel.compiled.runs)
    gemm.scaled_mm(a, w, a_scale, w_scale)
    assert len(kernel.triton_calls) == 2 and len(kernel.compiled.runs) == runs


def kernel_arg_names(M):
    kernel = gemm_tma._scaled_mm_persistent_kernel if M >= gemm.PERSISTENT_MIN_M else gemm._scaled_mm_kernel
    return kernel.arg_names


def test_explicit_configs_with_equal_values_under_other_keys_get_other_launch_keys():
    # The compiled-kernel key holds the config's items, not its values in insertion order.
    flags = (True, True, True, False, 0, False)
    first = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    swapped = {"BLOCK_N": 16, "BLOCK_M": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    assert gemm._tiled_plan(first, flags, False, False, 128)[5] != gemm._tiled_plan(swapped, flags, False, False, 128)[5]
