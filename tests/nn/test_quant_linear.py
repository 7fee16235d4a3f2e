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
