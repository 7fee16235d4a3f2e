"""optimize(exact=False): RMSNorm outputs deferred into the fused RMSNorm + per-token quantization.

Tiny random Llama, Qwen2 and Gemma-3 models on CPU (torch backend, one Triton-interpreter case):
the consumers' quantized inputs are the fused kernel's, bit for bit; the 16-bit norm output is
not computed where only quantized layers read it; logits stay as close to the unquantized model
as without the fusion; every other use of a deferred output sees the plain norm output exactly.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import quantkit
from quantkit.config import QuantConfig
from quantkit.generate import generate
from quantkit.kernels import attention_ops, ops, reference
from quantkit.models.fast_norm import NormOutput
from quantkit.models.fast_path import FastRMSNorm, optimize
from quantkit.nn import QuantLinear
from tests.models.test_fast_path import make_tiny

ARCHS = ["llama", "qwen2", "gemma3"]


def _quantized(arch, scheme, dtype=torch.bfloat16, backend="auto"):
    model = make_tiny(arch).to(dtype)
    return quantkit.quantize(model, QuantConfig.preset(scheme, backend=backend) if backend != "auto"
                             else QuantConfig.preset(scheme), progress=False)


def _ids(model, seed=3, shape=(2, 21)):
    return torch.randint(3, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class _Calls:
    """Records calls of kernel entry points (module attributes looked up at call time)."""

    def __init__(self, monkeypatch, targets):
        self.log = []
        for module, name in targets:
            real = getattr(module, name)
            monkeypatch.setattr(module, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def spy(*args, **kwargs):
            self.log.append((name, args))
            return real(*args, **kwargs)

        return spy

    def count(self, name):
        return sum(1 for n, _ in self.log if n == name)

    def clear(self):
        self.log.clear()


KERNELS = [(ops, "scaled_mm"), (ops, "gated_scaled_mm"), (ops, "quantize_per_token"),
           (ops, "rms_norm_quant_per_token"), (attention_ops, "rms_norm")]


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_consumers_get_the_fused_kernels_quantization_and_no_16_bit_norm(arch, scheme, monkeypatch):
    # residual_add=False: every norm module is called (test_fast_layer covers the fused adds).
    fast = optimize(_quantized(arch, scheme), exact=False, residual_add=False)
    layers = fast.config.num_hidden_layers
    report = fast.quantkit_fast_path
    assert report.deferred_norms, str(report)
    inputs = {}
    for name, module in fast.named_modules():
        if isinstance(module, FastRMSNorm) and module.defer_output:
            module.register_forward_pre_hook(lambda m, args, name=name: inputs.setdefault(name, args[0].clone()))
    calls = _Calls(monkeypatch, KERNELS)
    ids = _ids(fast)
    with torch.no_grad():
        fast(ids)  # first pass: norms read in 16 bits (Gemma's post-norms) stop deferring
        calls.clear()
        inputs.clear()
        fast(ids)
    active = [name for name, m in fast.named_modules() if isinstance(m, FastRMSNorm) and m.defer_output]
    # One attention and one MLP input per layer: two fused launches, none of them a 16-bit norm.
    assert len(active) == 2 * layers and set(active) <= set(inputs)
    assert calls.count("rms_norm_quant_per_token") == 2 * layers
    swapped = len(report.swapped_norms)
    assert calls.count("rms_norm") == swapped - 2 * layers
    assert calls.count("quantize_per_token") == 2 * layers  # o_proj and down_proj only
    # Each consumer GEMM reads exactly the twin's fused quantization of its norm's input.
    want = []
    for name in active:
        norm = fast.get_submodule(name)
        x = inputs[name]
        q, scale, _ = reference.rms_norm_quant_per_token(x.reshape(-1, x.shape[-1]), norm.weight, norm.eps,
                                                         getattr(torch, {"int8": "int8", "fp8": "float8_e4m3fn"}[scheme]),
                                                         None, norm.offset)
        want.append((q, scale))
    consumers = [args for name, args in calls.log if name in ("scaled_mm", "gated_scaled_mm")
                 and args[1].shape[1] == fast.config.hidden_size and args[1].shape[0] != fast.config.hidden_size]
    assert len(consumers) == 2 * layers  # stacked q/k/v and stacked gate/up per layer
    for args in consumers:
        assert any(torch.equal(args[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(args[2], scale)
                   for q, scale in want)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_as_close_to_bf16_as_without_the_fusion(arch, scheme):
    base = make_tiny(arch).to(torch.bfloat16)
    plain = quantkit.quantize(copy.deepcopy(base), QuantConfig.preset(scheme), progress=False)
    off = optimize(copy.deepcopy(plain), exact=False, norm_quant=False)
    on = optimize(copy.deepcopy(plain), exact=False)
    assert off.quantkit_fast_path.deferred_norms == [] and on.quantkit_fast_path.deferred_norms
    ids = _ids(plain)
    with torch.no_grad():
        want, got_off, got_on = base(ids).logits, off(ids).logits, on(ids).logits
        again = on(ids).logits  # second pass: the norms that stopped deferring give the same values
    assert torch.equal(got_on, again)
    # The fused kernel skips one 16-bit rounding of the norm output; its effect is of the size of
    # any requantization change: not bit-equal, but no further from the unquantized model.
    assert not torch.equal(got_on, got_off)
    assert _rel(got_on, want) <= 1.1 * _rel(got_off, want)


def test_fp32_deferral_differs_only_by_float32_rounding_order():
    plain = _quantized("llama", "int8", torch.float32)
    off = optimize(copy.deepcopy(plain), exact=False, norm_quant=False)
    on = optimize(copy.deepcopy(plain), exact=False)
    ids = _ids(plain)
    with torch.no_grad():
        got_off, got_on = off(ids).logits, on(ids).logits
    # (x * w) * rstd with an IEEE square root vs x * rsqrt * w: an ulp here and there.
    assert (got_on - got_off).abs().max().item() <= 1e-5 * got_off.abs().max().item()


def _norm(width=96, offset=0.0, dtype=torch.bfloat16, defer=True):
    weight = (1.0 + 0.1 * torch.randn(width, generator=torch.Generator().manual_seed(11))).to(dtype)
    return FastRMSNorm(weight, 1e-6, offset, "torch", defer_output=defer)


def _x(shape=(2, 5, 96), dtype=torch.bfloat16, seed=12):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


FALLBACKS = {
    "add": lambda y: y + 1,
    "radd": lambda y: 1.5 + y,
    "float": lambda y: y.float(),
    "index": lambda y: y[1, 2:4],
    "mul": lambda y: y * y,
    "cat": lambda y: torch.cat([y, y], dim=1),
    "sum": lambda y: y.sum(-1),
    "transpose": lambda y: y.transpose(0, 1),
    "clone": lambda y: y.clone(),
    "linear": lambda y: F.linear(y, torch.ones(7, 96, dtype=y.dtype)),
    "softmax": lambda y: torch.softmax(y.float(), -1),
    "eq": lambda y: y == 0.5,
    "tolist": lambda y: torch.tensor(y.tolist()),
    "reshape_merging_last_dim": lambda y: y.reshape(2, -1),
    "reshape_then_add": lambda y: y.reshape(-1, 96) + 0,
    "view_then_index": lambda y: y.view(10, 96)[3],
    "flatten_then_mul": lambda y: y.flatten(0, 1) * 2,
    "to_dtype": lambda y: y.to(torch.float16),
    "numpy": lambda y: torch.from_numpy(y.float().numpy()),
}


@pytest.mark.parametrize("op", list(FALLBACKS), ids=list(FALLBACKS))
def test_every_other_use_sees_the_plain_norm_output(op):
    norm, plain_norm = _norm(), _norm(defer=False)
    x = _x()
    with torch.no_grad():
        want = plain_norm(x)
        y = norm(x)
        assert type(y) is NormOutput
        got = FALLBACKS[op](y)
        expected = FALLBACKS[op](want)
    assert type(got) is not NormOutput
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert norm.materialized_calls == 1 and not norm.defer_output  # it stops deferring


def test_metadata_does_not_compute_the_norm():
    norm = _norm()
    x = _x()
    with torch.no_grad():
        y = norm(x)
        assert y.shape == x.shape and y.size() == x.shape and y.size(-1) == 96 and y.dim() == 3 and y.ndim == 3
        assert y.dtype == x.dtype and y.device == x.device and not y.is_inference() and not y.requires_grad
        assert y.numel() == x.numel() and len(y) == 2 and y.is_contiguous() and y.stride() == (480, 96, 1)
        assert y.contiguous() is y and y._version == 0 and y.grad_fn is None and hash(y) == id(y)
        r = y.reshape(-1, 96)
        assert type(r) is NormOutput and r.shape == (10, 96) and type(y.view(10, 96)) is NormOutput
        assert type(torch.flatten(y, 0, 1)) is NormOutput and type(torch.reshape(y, (5, 2, 96))) is NormOutput
    assert y.pending.output is None and norm.materialized_calls == 0 and norm.defer_output


def test_in_place_changes_are_seen_by_every_view():
    norm, plain_norm = _norm(offset=1.0), _norm(offset=1.0, defer=False)
    x = _x()
    with torch.no_grad():
        want = plain_norm(x)
        y = norm(x)
        flat = y.reshape(-1, 96)
        y.mul_(2)
        assert torch.equal(y + 0, want * 2) and torch.equal(flat + 0, (want * 2).reshape(-1, 96))
        assert y._version > 0  # FusedQKV's stash would notice
        # A quantized consumer now quantizes the changed 16-bit values, as it would a plain tensor.
        linear = QuantLinear.from_linear(torch.nn.Linear(96, 8, dtype=torch.bfloat16), torch.int8)
        assert torch.equal(linear(y), linear(want * 2))
        y[0, 0, 0] = 7.0
        assert (y + 0)[0, 0, 0].item() == 7.0


def test_static_scale_and_unquantized_consumers_get_plain_values():
    norm, plain_norm = _norm(), _norm(defer=False)
    x = _x()
    dense = torch.nn.Linear(96, 8, dtype=torch.bfloat16)
    static = QuantLinear.from_linear(dense, torch.int8, input_amax=torch.tensor(4.0))
    dynamic = QuantLinear.from_linear(dense, torch.int8)
    with torch.no_grad():
        want = plain_norm(x)
        assert torch.equal(static(norm(x)), static(want))
        norm.defer_output = True
        assert torch.equal(dense(norm(x)), dense(want))
        norm.defer_output = True
        y = norm(x)
        fused = dynamic(y)  # dynamic per-token: the fused kernel's quantization
        assert norm.fused_calls == 1 and y.pending.output is None
        q, scale, _ = reference.rms_norm_quant_per_token(x.reshape(-1, 96), norm.weight, norm.eps, torch.int8)
        direct = ops.scaled_mm(q, dynamic.weight, scale, dynamic.weight_scale.view(-1), dynamic.bias, "none",
                               torch.bfloat16).reshape(2, 5, 8)
        assert torch.equal(fused, direct)


def test_changed_input_is_refused_not_silently_wrong():
    norm = _norm()
    x = _x()
    with torch.no_grad():
        y = norm(x)
        x.add_(1.0)
        with pytest.raises(RuntimeError, match="changed in place"):
            y + 0


def test_plain_output_under_autograd_inference_mode_and_for_subclass_inputs():
    norm = _norm(dtype=torch.float32)
    x = _x(dtype=torch.float32)
    leaf = x.clone().requires_grad_(True)
    out = norm(leaf)
    assert type(out) is torch.Tensor and out.requires_grad
    with torch.no_grad():
        assert type(norm(leaf)) is NormOutput  # no graph is recorded: nothing to differentiate
    with torch.inference_mode():
        assert type(norm(x)) is torch.Tensor
    with torch.no_grad():
        chained = norm(norm(x))  # a deferred input is materialized first, the norm runs plainly
        plain_norm = _norm(dtype=torch.float32, defer=False)
        assert type(chained) is torch.Tensor and torch.equal(chained, plain_norm(plain_norm(x)))


def test_exact_mode_never_defers_and_norm_quant_needs_inexact():
    model = optimize(_quantized("gemma3", "int8", torch.float32), exact=True)
    assert model.quantkit_fast_path.swapped_norms and model.quantkit_fast_path.deferred_norms == []
    assert not any(m.defer_output for m in model.modules() if isinstance(m, FastRMSNorm))
    with pytest.raises(ValueError, match="exact=False"):
        optimize(model, exact=True, norm_quant=True)
    optimize(model, exact=False)  # again: the already swapped norms start deferring
    assert len(model.quantkit_fast_path.deferred_norms) > 0
    optimize(model, exact=False, norm_quant=False)
    assert not any(m.defer_output for m in model.modules() if isinstance(m, FastRMSNorm))


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_with_deferral(arch):
    # float32: the fusion changes only the float32 rounding order, so greedy tokens agree. (In
    # bf16 they may legitimately differ where two logits are within the requantization noise.)
    plain = _quantized(arch, "int8", torch.float32)
    off = optimize(copy.deepcopy(plain), exact=False, norm_quant=False)
    on = optimize(copy.deepcopy(plain), exact=False)
    ids = _ids(plain, seed=1, shape=(2, 9))
    want = generate(off, ids, 10, eos_token_id=None)
    got = generate(on, ids, 10, eos_token_id=None)
    assert torch.equal(got, want)
    assert sum(m.fused_calls for m in on.modules() if isinstance(m, FastRMSNorm)) > 0


def test_triton_backend_under_the_interpreter(monkeypatch):
    fast = optimize(_quantized("llama", "int8", backend="triton"), exact=False)
    reference_model = optimize(_quantized("llama", "int8", backend="triton"), exact=False, norm_quant=False)
    assert {m.backend for m in fast.modules() if isinstance(m, (FastRMSNorm, QuantLinear))} == {"triton"}
    calls = _Calls(monkeypatch, KERNELS)
    ids = _ids(fast, shape=(1, 7))
    with torch.no_grad():
        fast(ids)
        calls.clear()
        got = fast(ids).logits
        assert calls.count("rms_norm_quant_per_token") == 2 * fast.config.num_hidden_layers
        want = reference_model(ids).logits
    assert _rel(got, want) < 0.05


def test_separate_quantlinear_consumers_share_one_fused_launch(monkeypatch):
    # qkv=False: q_proj, k_proj and v_proj are plain QuantLinears, each reshaping the deferred
    # output and quantizing it through quantize_input; the three share one fused launch.
    plain = _quantized("llama", "int8")
    fast = optimize(copy.deepcopy(plain), exact=False, qkv=False)
    reference_model = optimize(copy.deepcopy(plain), exact=False, qkv=False, norm_quant=False)
    calls = _Calls(monkeypatch, KERNELS)
    ids = _ids(plain)
    layers = plain.config.num_hidden_layers
    with torch.no_grad():
        fast(ids)
        calls.clear()
        got = fast(ids).logits
        assert calls.count("rms_norm_quant_per_token") == 2 * layers and calls.count("quantize_per_token") == 2 * layers
        calls.clear()
        want = reference_model(ids).logits
        assert calls.count("quantize_per_token") == 6 * layers  # q, k, v, o, gate/up, down
    assert 0 < _rel(got, want) < 0.05


def test_flatten_with_named_dims_falls_back():
    norm = _norm()
    with torch.no_grad():
        y = norm(_x())
        with pytest.raises((RuntimeError, TypeError, IndexError)):
            y.flatten("a", "b")  # the plain output has no names either


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
def test_raw_storage_reads_give_nan_never_plausible_values():
    # torch.tensor(y) copies the raw storage past __torch_function__: NaN, not zeros.
    norm = _norm()
    with torch.no_grad():
        y = norm(_x())
        assert torch.isnan(torch.tensor(y).float()).all()


def test_computed_output_releases_the_norm_input():
    norm = _norm()
    with torch.no_grad():
        y = norm(_x())
        pending = y.pending
        want = _norm(defer=False)(_x())
        assert torch.equal(y + 0, want + 0)
        assert pending.x2d is None  # the caller keeping y keeps only the output, not the input too


def test_fused_then_16_bit_reader_gives_the_same_values_on_every_call():
    # A dynamic quantized consumer takes fused values first, then something reads 16 bits: the
    # norm must keep deferring, or the first call and later calls would feed different values.
    norm = _norm()
    dense = torch.nn.Linear(96, 8, dtype=torch.bfloat16)
    dynamic = QuantLinear.from_linear(dense, torch.int8)
    x = _x()
    with torch.no_grad():
        runs = []
        for _ in range(3):
            y = norm(x)
            runs.append((dynamic(y), y * 2))
        assert norm.defer_output
        for fused, doubled in runs[1:]:
            assert torch.equal(fused, runs[0][0]) and torch.equal(doubled, runs[0][1])


def test_flatten_with_start_after_end_falls_back_to_torchs_error():
    norm = _norm()
    with torch.no_grad():
        y = norm(_x())
        with pytest.raises(RuntimeError):
            y.flatten(1, 0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_models_output_is_a_plain_tensor(arch):
    # The final norm makes the output: deferred, a base model's first last_hidden_state reached
    # the caller as a NormOutput (torch.as_tensor(h, dtype=float64) read NaN from it).
    fast = optimize(_quantized(arch, "int8"), exact=False)
    assert fast.quantkit_fast_path.deferred_norms
    assert not any(name.startswith("model.norm") for name in fast.quantkit_fast_path.deferred_norms)
    with torch.no_grad():
        out = fast.model(_ids(fast))
    hidden = out.last_hidden_state
    assert type(hidden) is torch.Tensor
    assert torch.equal(torch.as_tensor(hidden, dtype=torch.float64), hidden.double())
