"""Launchers' per-signature caches of validated calls (``call_cache.SignatureCache``).

What a cache may never change: the outputs (a cached call equals the first, validated one, bit for
bit, and the twin where the kernel is bit-exact), the errors (bad input after a good call with a
similar signature raises the same ValueError), and memory (bounded however many signatures come).
The cached RoPE and flash-attention launches on the GPU path are driven with a fake compiled
kernel, as in test_launch.py: the direct launch must pass what triton's path got.
"""

import pytest
import torch

from quantkit.kernels import attention, attention_ops, call_cache, launch, quant, reference, rope
from quantkit.models import fast_rope
from tests.kernels.test_rope import hf_cos_sin
from tests.kernels.fake_launch import FakeDriver, RecordingKernel

DTYPES = [torch.int8, torch.float8_e4m3fn]
DTYPE_IDS = ["int8", "fp8"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8) if t.element_size() == 1 else t


def _same(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def test_signature_cache_is_bounded_and_keeps_the_newest():
    cache = call_cache.SignatureCache(max_entries=4)
    for i in range(11):
        assert cache.add(("sig", i), i) == i
        assert len(cache) <= 4
    assert cache[("sig", 10)] == 10


@pytest.mark.parametrize("shape", [(2, 3, 4), (0, 5), (1, 16), (7,)])
def test_contiguous_strides_are_torchs(shape):
    assert call_cache.contiguous_strides(shape) == torch.empty(shape).stride()


# ---------------------------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_per_token_cached_call_is_bit_identical(dtype):
    quant._PER_TOKEN_CALLS.clear()
    x = torch.randn(13, 64) * 3
    first = quant.quantize_per_token(x, dtype)
    assert len(quant._PER_TOKEN_CALLS) == 1
    second = quant.quantize_per_token(x.clone(), dtype)  # same signature: the cached path
    assert len(quant._PER_TOKEN_CALLS) == 1
    want = reference.quantize_per_token(x, dtype)
    assert _same(first, want) and _same(second, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_quant_cached_call_is_bit_identical(dtype, residual):
    quant._RMS_CALLS.clear()
    x, weight = torch.randn(13, 64), torch.randn(64)
    res = torch.randn(13, 64) if residual else None
    first = quant.rms_norm_quant_per_token(x, weight, 1e-6, dtype, res)
    second = quant.rms_norm_quant_per_token(x.clone(), weight, 1e-6, dtype, res)
    assert len(quant._RMS_CALLS) == 1
    # An explicit (default) config never uses the cache: the launcher's full path.
    want = quant.rms_norm_quant_per_token(x, weight, 1e-6, dtype, res, config={})
    assert _same(first, want) and _same(second, want)


def test_quant_bad_input_after_a_good_call_still_raises():
    x = torch.randn(13, 64)
    quant.quantize_per_token(x, torch.int8)
    quant.quantize_per_token(x, torch.int8)  # cached now
    with pytest.raises(ValueError, match="unit stride"):
        quant.quantize_per_token(torch.randn(64, 13).t(), torch.int8)  # same shape, K not contiguous
    with pytest.raises(ValueError, match="must be 2-D"):
        quant.quantize_per_token(x[None], torch.int8)
    with pytest.raises(ValueError, match="not supported"):
        quant.quantize_per_token(x.to(torch.float64), torch.int8)
    with pytest.raises(ValueError, match="not a quantized dtype"):
        quant.quantize_per_token(x, torch.float16)
    weight = torch.randn(64)
    quant.rms_norm_quant_per_token(x, weight, 1e-6, torch.int8)
    quant.rms_norm_quant_per_token(x, weight, 1e-6, torch.int8)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        quant.rms_norm_quant_per_token(x, torch.randn(128)[::2], 1e-6, torch.int8)
    with pytest.raises(ValueError, match="residual.dtype"):
        quant.rms_norm_quant_per_token(x, weight, 1e-6, torch.int8, torch.randn(13, 64, dtype=torch.float64))


def test_quant_caches_stay_bounded(monkeypatch):
    for name in ("_PER_TOKEN_CALLS", "_RMS_CALLS"):
        monkeypatch.setattr(quant, name, call_cache.SignatureCache(max_entries=8))
    for M in range(1, 2 * quant._PER_TOKEN_CALLS.max_entries + 3):
        x = torch.randn(M, 16)
        quant.quantize_per_token(x, torch.int8)
        quant.rms_norm_quant_per_token(x, torch.ones(16), 1e-6, torch.int8)
        assert len(quant._PER_TOKEN_CALLS) <= quant._PER_TOKEN_CALLS.max_entries
        assert len(quant._RMS_CALLS) <= quant._RMS_CALLS.max_entries


# ---------------------------------------------------------------------------------------------- RoPE, attention


def _rope_inputs(seq=13, dtype=torch.bfloat16):
    torch.manual_seed(seq)
    q = (3 * torch.randn(2, seq, 4, 64)).to(dtype).transpose(1, 2)
    k = (3 * torch.randn(2, seq, 2, 64)).to(dtype).transpose(1, 2)
    cos, sin = (t.to(dtype) for t in hf_cos_sin(1, seq, 64))
    return q, k, cos, sin


def test_rope_cached_call_is_bit_identical():
    rope._CALLS.clear()
    q, k, cos, sin = _rope_inputs()
    first = rope.apply_rope(q, k, cos, sin)
    second = rope.apply_rope(q, k, cos, sin)
    assert len(rope._CALLS) == 1
    want = attention_ops.apply_rope(q, k, cos, sin, backend="torch")
    assert _same(first, want) and _same(second, want)


def test_rope_bad_input_after_a_good_call_still_raises():
    q, k, cos, sin = _rope_inputs()
    rope.apply_rope(q, k, cos, sin)
    with pytest.raises(ValueError, match="cos must be"):
        rope.apply_rope(q, k, cos[:, :-1], sin)
    with pytest.raises(ValueError, match="contiguous in its last axis"):
        rope.apply_rope(q, k, cos, torch.randn(1, 13, 128, dtype=sin.dtype)[..., ::2])
    with pytest.raises(ValueError, match="heads_per_program"):
        rope.apply_rope(q, k, cos, sin, heads_per_program=0)


def test_rope_dispatcher_cache_accepts_and_refuses_per_signature(monkeypatch):
    monkeypatch.setattr(fast_rope, "on_kernel_device", lambda q: True)
    fast_rope._TAKES.clear()
    q, k, cos, sin = _rope_inputs()
    assert fast_rope._kernel_takes(q, k, cos, sin) and fast_rope._kernel_takes(q, k, cos, sin)
    assert not fast_rope._kernel_takes(q, k, cos[:, :-1], sin)  # a signature the kernel refuses
    assert not fast_rope._kernel_takes(q, k, cos[:, :-1], sin)
    assert not fast_rope._kernel_takes(q, k, cos.float(), sin)  # dtypes differ: refused before the cache
    assert list(fast_rope._TAKES.values()) == [True, False]


def _attention_inputs(seq=40, dtype=torch.float32):
    torch.manual_seed(seq)
    return (torch.randn(1, 4, seq, 64, dtype=dtype), torch.randn(1, 2, seq, 64, dtype=dtype),
            torch.randn(1, 2, seq, 64, dtype=dtype))


@pytest.mark.parametrize("window", [None, 16])
def test_flash_attention_cached_call_is_bit_identical(window):
    attention._CALLS.clear()
    q, k, v = _attention_inputs()
    first = attention.flash_attention(q, k, v, 0.125, window)
    second = attention.flash_attention(q, k, v, 0.125, window)
    assert len(attention._CALLS) == 1
    assert _same(first, second)
    torch.testing.assert_close(first, attention_ops.flash_attention(q, k, v, 0.125, window, backend="torch"),
                               rtol=2e-5, atol=2e-5)


def test_flash_attention_bad_input_after_a_good_call_still_raises():
    q, k, v = _attention_inputs()
    attention.flash_attention(q, k, v, 0.125, 16)
    with pytest.raises(ValueError, match="window=16.0"):
        attention.flash_attention(q, k, v, 0.125, 16.0)  # equal to the cached 16, but not an int
    with pytest.raises(ValueError, match="k shape"):
        attention.flash_attention(q, k, v[:, :, :-1], 0.125, 16)
    with pytest.raises(ValueError, match="fewer keys"):
        attention.flash_attention(q, k[:, :, :-1], v[:, :, :-1], 0.125, 16)


def test_attention_and_rope_caches_stay_bounded(monkeypatch):
    for module in (attention, rope):
        monkeypatch.setattr(module, "_CALLS", call_cache.SignatureCache(max_entries=8))
    for seq in range(1, attention._CALLS.max_entries + 6):
        q, k, v = (t[:, :, :1] for t in _attention_inputs(2))
        # A new stride each time (a view into a wider buffer): a new signature, same tiny launch.
        wide = torch.randn(1, 4, 1, 64 * seq)[..., :64]
        attention.flash_attention(wide, k, v, 0.125)
        rope.apply_rope(wide, k, torch.ones(1, 1, 64), torch.zeros(1, 1, 64))
        assert len(attention._CALLS) <= attention._CALLS.max_entries
        assert len(rope._CALLS) <= rope._CALLS.max_entries


# ---------------------------------------------------------------------------------------------- GPU launch path


@pytest.fixture
def recorded(monkeypatch):
    """rope's and flash attention's CachedLaunch on the GPU path with a recording fake kernel."""
    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_driver", lambda: FakeDriver())
    kernels = {}
    for module, name in ((rope, "_ROPE"), (attention, "_FLASH_PREFILL")):
        cached = launch.CachedLaunch(getattr(module, name).kernel)
        cached.kernel = kernels[name] = RecordingKernel()
        monkeypatch.setattr(module, name, cached)
        monkeypatch.setattr(module, "_CALLS", call_cache.SignatureCache())
    return kernels


def _check_direct_launch_repeats_triton_path(kernel, arg_names, direct_launches):
    grid, args, kwargs = kernel.triton_calls[0]
    tail = tuple(kwargs[name] for name in arg_names[len(args):])
    for run in kernel.compiled.runs[-direct_launches:]:
        assert run[3:9] == (1234, "fn-handle", "packed", None, None, None)
        assert len(run[9:]) == len(args) + len(tail)
        for got, want in zip(run[9:], args + tail):
            assert got is want or (type(got) is type(want) and not isinstance(got, torch.Tensor) and got == want) \
                or (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype)


def test_rope_launches_directly_with_tritons_arguments(recorded):
    kernel = recorded["_ROPE"]
    q, k, cos, sin = _rope_inputs(seq=64)
    for _ in range(3):
        rope.apply_rope(q, k, cos, sin)
    assert len(kernel.triton_calls) == 1 and len(kernel.compiled.runs) == 2
    _, _, kwargs = kernel.triton_calls[0]
    assert kwargs["enable_fp_fusion"] is False and kwargs["num_warps"] == 4
    _check_direct_launch_repeats_triton_path(kernel, rope._rope_kernel.arg_names, 2)
    # Another sequence length with the same integer specialization: same binary, no new entry.
    rope.apply_rope(*_rope_inputs(seq=80))
    assert len(kernel.triton_calls) == 1 and len(rope._ROPE.compiled) == 1
    # An odd one specializes differently: one more trip through triton.
    rope.apply_rope(*_rope_inputs(seq=13))
    assert len(kernel.triton_calls) == 2


def test_flash_attention_launches_directly_with_tritons_arguments(recorded):
    kernel = recorded["_FLASH_PREFILL"]
    q, k, v = _attention_inputs(seq=32, dtype=torch.bfloat16)
    for _ in range(3):
        attention.flash_attention(q, k, v, 0.125, 16)
    assert len(kernel.triton_calls) == 1 and len(kernel.compiled.runs) == 2
    _check_direct_launch_repeats_triton_path(kernel, attention._flash_prefill_kernel.arg_names, 2)
    # The scale is a runtime float: a new one launches the same binary with the new value.
    attention.flash_attention(q, k, v, 0.5, 16)
    assert len(kernel.triton_calls) == 1
    assert kernel.compiled.runs[-1][9 + 22] == pytest.approx(0.5 * attention.LOG2E)


def test_unhashable_arguments_still_get_the_clear_error():
    # The signature is looked up before validation: an unhashable argument must fall through to
    # it (ValueError naming the value), not fail the lookup with a TypeError.
    q = torch.randn(1, 2, 8, 64)
    k = v = torch.randn(1, 1, 8, 64)
    with pytest.raises(ValueError, match="window"):
        attention.flash_attention(q, k, v, 0.125, window=[4])
    cache = call_cache.SignatureCache()
    assert cache.get(([1],)) is None and cache.add(([1],), "entry") == "entry" and not cache
