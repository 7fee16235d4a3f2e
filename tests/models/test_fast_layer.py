"""Residual adds fused into the norm + quantization kernel (``fast_layer``), tiny random models on CPU.

The fused layers must give the logits of deferred norms without the fusion bit for bit (the
kernel adds in float32 and rounds once, as torch's ``+`` does), launch the residual form of the
kernel where the adds were, and fall back to the model's own statements wherever the fusion
does not apply.
"""

import copy
import importlib
import importlib.util
import textwrap

import pytest
import torch

import quantkit
from quantkit.config import QuantConfig
from quantkit.generate import generate
from quantkit.kernels import attention_ops, ops
from quantkit.models import fast_layer
from quantkit.models.fast_layer import fused_forward, is_pre_norm_layer
from quantkit.models.fast_path import FastRMSNorm, optimize
from tests.models.test_fast_path import make_tiny

PRE_NORM = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
            "qwen3": "Qwen3DecoderLayer"}
OTHER = {"gemma3": "Gemma3DecoderLayer", "phi3": "Phi3DecoderLayer", "olmo2": "Olmo2DecoderLayer",
         "granite": "GraniteDecoderLayer"}


def _layer_class(arch, name):
    return getattr(importlib.import_module(f"transformers.models.{arch}.modeling_{arch}"), name)


def _bare(cls):
    return cls.__new__(cls)  # the check reads only the class's forward


def _quantized(arch, scheme, dtype=torch.bfloat16, backend="auto"):
    model = make_tiny(arch).to(dtype)
    config = QuantConfig.preset(scheme, backend=backend) if backend != "auto" else QuantConfig.preset(scheme)
    return quantkit.quantize(model, config, progress=False)


def _ids(model, seed=3, shape=(2, 21)):
    return torch.randint(3, model.config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _pair(arch, scheme, dtype=torch.bfloat16, backend="auto"):
    plain = _quantized(arch, scheme, dtype, backend)
    return (optimize(copy.deepcopy(plain), exact=False, residual_add=False),
            optimize(copy.deepcopy(plain), exact=False))


class _ResidualLaunches:
    """Counts ``ops.rms_norm_quant_per_token`` launches with and without a residual."""

    def __init__(self, monkeypatch):
        self.with_residual = self.without = 0
        real = ops.rms_norm_quant_per_token

        def spy(x, weight, eps, dtype, residual=None, *args, **kwargs):
            if residual is None:
                self.without += 1
            else:
                self.with_residual += 1
            return real(x, weight, eps, dtype, residual, *args, **kwargs)

        monkeypatch.setattr(ops, "rms_norm_quant_per_token", spy)


def _layer_class_from(source: str, tmp_path, name: str, prelude: str = ""):
    """A LlamaDecoderLayer subclass whose forward is ``source``, from a real file (the check reads
    the class's source with inspect, as it would a model's)."""
    body = textwrap.indent(textwrap.dedent(source), "    ")
    path = tmp_path / f"{name.lower()}_layer.py"
    path.write_text("import functools\nimport torch\nfrom transformers.models.llama.modeling_llama import "
                    f"LlamaDecoderLayer\n\n{prelude}\n\nclass {name}(LlamaDecoderLayer):\n{body}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_the_check_takes_exactly_the_pre_norm_forward(tmp_path):
    for arch, name in PRE_NORM.items():
        assert is_pre_norm_layer(_bare(_layer_class(arch, name))), arch
    for arch, name in OTHER.items():
        assert not is_pre_norm_layer(_bare(_layer_class(arch, name))), arch
    template = fast_layer._PRE_NORM_FORWARD
    closing = "    hidden_states = residual + hidden_states\n    return hidden_states"
    assert closing in template
    # One statement differs: the MLP branch is scaled.
    scaled = template.replace(closing, "    hidden_states = residual + 0.5 * hidden_states\n    return hidden_states")
    # Annotations, a docstring and comments do not matter.
    annotated = (template.replace("hidden_states, attention_mask=None", "hidden_states: torch.Tensor, attention_mask=None")
                 .replace("**kwargs):", "**kwargs) -> torch.Tensor:\n    \"\"\"A docstring.\"\"\"")
                 .replace("residual = hidden_states\n", "residual = hidden_states  # a comment\n", 1))
    assert scaled != template and annotated.count("torch.Tensor") == 2 and "# a comment" in annotated
    assert not is_pre_norm_layer(_bare(_layer_class_from(scaled, tmp_path, "Scaled")))
    # A decorator may change what the forward computes: not taken, with or without functools.wraps.
    decorated = template.replace("def forward(", "@halved\ndef forward(")
    halving = "def halved(f):\n    @functools.wraps(f)\n    def g(*a, **k):\n        return f(*a, **k) * 0.5\n    return g\n"
    assert not is_pre_norm_layer(_bare(_layer_class_from(decorated, tmp_path, "Decorated", halving)))
    assert is_pre_norm_layer(_bare(_layer_class_from(annotated, tmp_path, "Annotated")))
    assert is_pre_norm_layer(_bare(_layer_class_from(template, tmp_path, "Same")))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_adds_give_the_unfused_logits_bit_for_bit(arch, scheme, dtype, monkeypatch):
    off, on = _pair(arch, scheme, dtype)
    layers = on.config.num_hidden_layers
    assert on.quantkit_fast_path.fused_residual_layers == [f"model.layers.{i}" for i in range(layers)]
    assert off.quantkit_fast_path.fused_residual_layers == []
    assert all("forward" not in layer.__dict__ for layer in off.model.layers)
    launches = _ResidualLaunches(monkeypatch)
    ids = _ids(on)
    with torch.no_grad():
        want = [off(ids).logits for _ in range(3)]
        launches.with_residual = launches.without = 0
        got = [on(ids).logits]  # first call: the norms learn their consumers' dtype, adds unfused
        assert (launches.with_residual, launches.without) == (0, 2 * layers)
        for _ in range(2):
            launches.with_residual = launches.without = 0
            got.append(on(ids).logits)
            # Every add but the last layer's closing one (the final norm feeds the 16-bit lm_head).
            assert (launches.with_residual, launches.without) == (2 * layers - 1, 1)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # The norms and the link to the next layer's norm are no submodules: the weights are the same.
    assert list(on.state_dict()) == list(off.state_dict())


def test_triton_backend_under_the_interpreter(monkeypatch):
    off, on = _pair("llama", "int8", backend="triton")
    assert {m.backend for m in on.modules() if isinstance(m, FastRMSNorm)} == {"triton"}
    launches = _ResidualLaunches(monkeypatch)
    ids = _ids(on, shape=(1, 7))
    with torch.no_grad():
        want = [off(ids).logits for _ in range(2)]
        got = [on(ids).logits for _ in range(2)]
    assert launches.with_residual == 2 * on.config.num_hidden_layers - 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_greedy_generation_and_hidden_states_equal_the_unfused_model():
    off, on = _pair("llama", "int8")
    ids = _ids(on, seed=1, shape=(2, 9))
    assert torch.equal(generate(on, ids, 10, eos_token_id=None), generate(off, ids, 10, eos_token_id=None))
    with torch.no_grad():
        for _ in range(2):
            got, want = on(ids, output_hidden_states=True), off(ids, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states)
    for a, b in zip(got.hidden_states, want.hidden_states):
        assert type(a) is torch.Tensor and torch.equal(a, b)


def test_a_prepared_output_serves_only_the_tensor_it_was_made_for():
    _, on = _pair("llama", "fp8")
    ids = _ids(on)
    with torch.no_grad():
        on(ids)
        on(ids)  # consumers known: layer 0 now prepares layer 1's input norm
        layer0, layer1 = on.model.layers
        norm = layer1.input_layernorm
        captured = {}
        handle = layer0.register_forward_hook(lambda m, args, out: captured.setdefault("out", out))
        on(ids)
        handle.remove()
        summed = captured["out"]
        assert norm.prepared[0] is None  # layer 1 took it
        # By hand: run layer 0's closing fusion, then hand the norm other tensors.
        x = torch.randn_like(summed)
        residual = torch.randn_like(summed)
        normed, summed = norm.fused_add_norm(x, residual)
        assert torch.equal(summed, residual + x)
        norm.prepare(summed, normed)
        other = summed.clone()
        assert norm(other) is not normed and norm.prepared[0] is None  # another tensor: computed anew
        norm.prepare(summed, normed)
        summed.add_(1.0)  # changed in place after the fusion: its prepared output is stale
        fresh = norm(summed)
        assert fresh is not normed
        want, _ = attention_ops.rms_norm(summed.reshape(-1, summed.shape[-1]), norm.weight, norm.eps,
                                         offset=norm.offset, backend="torch")
        assert torch.equal(fresh.real_tensor().reshape(want.shape), want)
        norm.prepare(summed, normed)
        assert norm(summed) is normed  # the very tensor, unchanged


def test_no_fusion_where_norms_do_not_defer(monkeypatch):
    off, on = _pair("llama", "int8")
    launches = _ResidualLaunches(monkeypatch)
    ids = _ids(on)
    with torch.inference_mode():  # no version counters: norms return plain outputs
        for _ in range(2):
            assert torch.equal(on(ids).logits, off(ids).logits)
    assert launches.with_residual == 0
    # A consumer that reads 16 bits stops the norm deferring, and its adds stop fusing.
    with torch.no_grad():
        on(ids)
        norm = on.model.layers[0].post_attention_layernorm
        norm.defer_output = False
        x = torch.randn(2, 3, on.config.hidden_size, dtype=torch.bfloat16)
        assert norm.fused_add_norm(x, x.clone()) is None
        norm.defer_output = True
        assert norm.fused_add_norm(x, x.clone()) is not None
        assert norm.fused_add_norm(x, x.float()) is None  # another dtype
        norm.to("meta")  # a norm on another device than its inputs (a model split over devices)
        assert norm.fused_add_norm(x, x.clone()) is None
    # A residual that needs a gradient: the fused kernel has no backward.
    residual = x.clone().requires_grad_()
    assert norm.fused_add_norm(x, residual) is None
    with torch.inference_mode():
        residual = x.clone()
    assert norm.fused_add_norm(x, residual) is None


def test_switches_and_what_optimize_leaves_alone():
    plain = _quantized("llama", "int8")
    with pytest.raises(ValueError, match="residual_add=True needs"):
        optimize(copy.deepcopy(plain), exact=False, norm_quant=False, residual_add=True)
    with pytest.raises(ValueError, match="residual_add=True needs"):
        optimize(copy.deepcopy(plain), exact=True, residual_add=True)
    on = optimize(copy.deepcopy(plain), exact=False)
    layer0, layer1 = on.model.layers
    assert layer0.forward.func is fused_forward and layer0.__dict__["quantkit_next_layer"] is layer1
    assert "quantkit_next_layer" not in layer1.__dict__  # the last layer: the final norm is not linked
    optimize(on, exact=False, residual_add=False)  # again, switched off: the class's forward is back
    assert "forward" not in layer0.__dict__ and "quantkit_next_layer" not in layer0.__dict__
    gemma = optimize(_quantized("gemma3", "int8"), exact=False)
    assert gemma.quantkit_fast_path.fused_residual_layers == []
    exact = optimize(copy.deepcopy(plain))
    assert exact.quantkit_fast_path.fused_residual_layers == []


def test_a_forward_set_by_other_code_is_kept(monkeypatch):
    # accelerate's device hooks (and users' patches) set the instance's forward: optimize keeps it.
    plain = _quantized("llama", "int8")
    calls = []
    layer = plain.model.layers[1]
    original = layer.forward
    layer.forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    on = optimize(plain, exact=False)
    assert on.quantkit_fast_path.fused_residual_layers == ["model.layers.0"]
    optimize(on, exact=True)
    optimize(on, exact=False, residual_add=False)
    with torch.no_grad():
        on(_ids(on))
    assert calls == [1] and "forward" in layer.__dict__


def test_a_pickled_fused_model_loads_and_still_fuses(tmp_path, monkeypatch):
    off, on = _pair("llama", "fp8")
    ids = _ids(on)
    with torch.no_grad():
        on(ids)  # consumers learned
        torch.save(on, tmp_path / "model.pt")
        loaded = torch.load(tmp_path / "model.pt", weights_only=False)
        twin = copy.deepcopy(on)
        assert loaded.model.layers[0].forward.func is fused_forward
        assert loaded.model.layers[0].forward.args[0] is loaded.model.layers[0]
        launches = _ResidualLaunches(monkeypatch)
        want = off(ids).logits
        for model in (loaded, twin):
            launches.with_residual = 0
            assert torch.equal(model(ids).logits, want)
            assert launches.with_residual == 2 * on.config.num_hidden_layers - 1


def test_hooks_between_layers_turn_the_closing_fusion_off(monkeypatch):
    off, on = _pair("llama", "int8")
    ids = _ids(on)
    steer = torch.randn(on.config.hidden_size, dtype=torch.bfloat16)

    def steering(module, args, out):
        out.data.add_(steer)  # past the version counter

    with torch.no_grad():
        on(ids)
        for model in (on, off):
            model.model.layers[0].register_forward_hook(steering)
        launches = _ResidualLaunches(monkeypatch)
        assert torch.equal(on(ids).logits, off(ids).logits)
    # Both middle adds still fused; the closing add of the hooked layer is not (nor the last's).
    assert launches.with_residual == 2


def test_a_16_bit_reader_stops_the_deferral_with_the_fusion_too():
    _, on = _pair("llama", "int8")
    ids = _ids(on)
    norm = on.model.layers[1].input_layernorm
    with torch.no_grad():
        on(ids)
        on(ids)  # layer 0 now prepares layer 1's input norm
        # A reader of the 16-bit norm output (what a non-quantized consumer would be).
        on.model.layers[1].self_attn.register_forward_pre_hook(
            lambda module, args, kwargs: (kwargs["hidden_states"].float(), None)[1], with_kwargs=True)
        on(ids)
    assert norm.defer_output is False


def test_training_mode_runs_the_class_forward(monkeypatch):
    off, on = _pair("llama", "int8")
    ids = _ids(on)
    with torch.no_grad():
        on(ids)
        on.train()
        off.train()
        launches = _ResidualLaunches(monkeypatch)
        assert torch.equal(on(ids).logits, off(ids).logits)
    assert launches.with_residual == 0
