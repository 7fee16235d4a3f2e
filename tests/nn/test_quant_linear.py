"""QuantLinear as a module: dtype casts, state_dict loading, construction and input checks."""

import copy

import pytest
import torch
from torch import nn

import quantkit
from quantkit.config import QuantConfig
from quantkit.models.fast_path import optimize
from quantkit.nn import QuantLinear
from tests.models.test_fast_path import make_tiny

SCHEMES = ["int8", "fp8", "int8-static"]


def _quantized(scheme, arch="llama"):
    model = make_tiny(arch)
    blocks = torch.randint(3, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return quantkit.quantize(model, QuantConfig.preset(scheme), blocks if scheme.endswith("static") else None,
                             progress=False)


def _formats(model):
    return {(name, key): (buf.dtype, buf.clone()) for name, m in model.named_modules()
            if hasattr(m, "quant_dtype")
            for key, buf in m._buffers.items() if key in ("weight", "weight_scale", "input_scale") and buf is not None}


def _bit_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "optimized"])
def test_dtype_casts_move_but_never_cast_the_quantized_buffers(scheme, fused):
    """model.to(bfloat16) / .half() / .double() used to cast float8 weights and fp32 scales, and the
    next forward failed ('w_scale.dtype=torch.bfloat16; scales must be float32')."""
    model = _quantized(scheme)
    if fused:
        model = optimize(model)
    before = _formats(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(), lambda m: m.float()):
        cast(model)
        after = _formats(model)
        assert after.keys() == before.keys()
        for key, (dtype, value) in before.items():
            assert after[key][0] == dtype and _bit_equal(after[key][1], value), key
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert next(iter(model.state_dict())) == next(iter(_quantized(scheme).state_dict()))


def test_load_state_dict_refuses_another_schemes_dtypes():
    fp8, int8 = _quantized("fp8"), _quantized("int8")
    with pytest.raises(RuntimeError, match="weight is torch.int8, but this QuantLinear holds torch.float8_e4m3fn"):
        fp8.load_state_dict(int8.state_dict())
    fp8.load_state_dict(copy.deepcopy(_quantized("fp8")).state_dict())  # the same scheme loads


def test_construction_and_input_checks():
    linear = nn.Linear(32, 16)
    q = torch.zeros(1, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"quantized_weight must be \(q \(16, 32\) torch.int8"):
        QuantLinear.from_linear(linear, torch.int8, quantized_weight=(q, torch.ones(1)))
    layer = QuantLinear.from_linear(linear, torch.int8, input_amax=3.0)  # a plain number is a range too
    assert layer.input_scale.item() == pytest.approx(3.0 / 127)
    fp8 = QuantLinear.from_linear(linear, torch.float8_e4m3fn, input_amax=torch.tensor(896.0))
    assert fp8.input_scale.item() == 2.0  # amax / 448: FP8's largest value, not INT8's 127
    weight = torch.randn(16, 32)
    weight[3, 5] = 44.8
    linear.weight.data.copy_(weight)
    fp8 = QuantLinear.from_linear(linear, torch.float8_e4m3fn)
    assert fp8.weight_scale[3].item() == pytest.approx(0.1)
    torch.testing.assert_close(fp8.weight_scale.view(-1), weight.abs().amax(1) / 448)
    with pytest.raises(ValueError, match="input has 48 features .* in_features=32"):
        layer(torch.randn(2, 48))
    assert "activation=silu" in repr(QuantLinear(32, 16, False, torch.int8, False, activation="silu"))


def test_load_model_names_a_file_given_for_a_directory(tmp_path):
    from tests.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "m", "llama")
    with pytest.raises(quantkit.ModelLoadError, match="is a file; pass the model's directory"):
        quantkit.load_model(model_dir / "config.json")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_backward_through_a_quantized_layer_is_refused(backend, static):
    """Gradients used to come out wrong on the torch backend (through the per-token scale only)
    and missing on Triton (a detached output), with no error: backward now raises, while the
    forward with autograd on (a model called without no_grad) still runs."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = QuantLinear.from_linear(linear, torch.int8, input_amax=4.0 if static else None, backend=backend)
    x = torch.randn(5, 64, requires_grad=True)
    y = layer(x)
    with torch.no_grad():
        torch.testing.assert_close(y, layer(x))  # the same values with and without autograd
    with pytest.raises(RuntimeError, match="quantized layers have no backward"):
        (y.sum() + x.sum()).backward()
    assert not layer(x.detach()).requires_grad


def test_backward_through_an_optimized_model_is_refused():
    model = optimize(_quantized("int8"), exact=False)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    logits = model(input_ids=ids).logits  # embeddings are parameters: autograd records the forward
    with pytest.raises(RuntimeError, match="quantized layers have no backward"):
        logits.float().pow(2).mean().backward()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_transposed_and_strided_inputs_give_the_contiguous_result(backend):
    torch.manual_seed(1)
    layer = QuantLinear.from_linear(nn.Linear(64, 32), torch.float8_e4m3fn, backend=backend)
    x = torch.randn(64, 7)
    with torch.no_grad():
        want = layer(x.t().contiguous())
        assert torch.equal(layer(x.t()), want)
        wide = torch.randn(7, 128)
        assert torch.equal(layer(wide[:, ::2]), layer(wide[:, ::2].contiguous()))


def test_backend_and_width_are_checked_when_the_layer_is_built():
    linear = nn.Linear(40, 16)
    for backend in ("auto", "bogus", "Torch"):
        with pytest.raises(ValueError, match=f"backend='{backend}' is not one of \\('triton', 'torch'\\)"):
            QuantLinear.from_linear(linear, torch.int8, backend=backend)
    with pytest.raises(ValueError, match="in_features=40 is not a multiple of 16"):
        QuantLinear.from_linear(linear, torch.int8, backend="triton")
    from quantkit.nn.linear import layer_backend

    assert layer_backend("triton", 40) == "torch" and layer_backend("triton", 48) == "triton"
    assert layer_backend("torch", 40) == "torch"


def test_to_empty_and_share_memory_apply_to_the_quantized_buffers():
    """_apply moved the format buffers with .to(device) whatever the function: to_empty from the
    meta device failed, and share_memory() left them unshared."""
    layer = QuantLinear(32, 16, True, torch.float8_e4m3fn, static_input=True, device="meta")
    layer.to_empty(device="cpu")
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float8_e4m3fn
    layer = QuantLinear.from_linear(nn.Linear(32, 16), torch.int8, input_amax=2.0)
    layer.share_memory()
    assert all(buffer.is_shared() for buffer in layer.buffers())
    layer.half()
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.float16


def test_a_static_layer_whose_input_stayed_zero_is_named(caplog):
    """An input that was zero on every calibration token gives the smallest static scale, which
    later rounds every input to ~0: the converter names the layer and the way out."""
    from quantkit.convert import convert_model

    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 8))
    config = QuantConfig.preset("int8-static", ignore=())
    with caplog.at_level("WARNING"):
        convert_model(model, config, "torch", input_amax={"0": torch.tensor(2.5), "1": torch.tensor(0.0)})
    assert "1: its input was zero on every calibration token" in caplog.text and "ignore=['1']" in caplog.text
    assert "0: its input" not in caplog.text
