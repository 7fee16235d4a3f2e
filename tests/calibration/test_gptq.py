"""GPTQ lowers the layer output error versus round-to-nearest with the same scales."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.calibration.gptq import HessianAccumulator, collect_hessians, gptq_quantize, gptq_quantize_weights
from quantkit.kernels.reference import quantize_per_channel


def _correlated_inputs(n, k, seed):
    # Low-rank mixing + per-channel scales: strongly correlated, unequal channels, like LLM
    # activations. The mixing and scales are the distribution (fixed); only the draws vary by seed.
    structure = torch.Generator().manual_seed(1234)
    mixing = torch.randn(k // 4 + 1, k, generator=structure) / (k // 4 + 1) ** 0.5
    scales = torch.exp(torch.randn(k, generator=structure))
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, k // 4 + 1, generator=g)
    return (latent @ mixing + 0.1 * torch.randn(n, k, generator=g)) * scales


def _output_error(x, weight, q, scale):
    y = x @ weight.t()
    return float((y - x @ (q.float() * scale[:, None]).t()).norm() / y.norm())


def test_fp8_round_trip_values_are_representable():
    weight = torch.randn(7, 33)
    _, scale = quantize_per_channel(weight, torch.float8_e4m3fn)
    q = gptq_quantize(weight, torch.eye(33), scale, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and bool(torch.isfinite(q.float()).all())


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("shape", [(13, 97), (64, 300)], ids=["13x97", "64x300"])
@pytest.mark.parametrize("act_order", [False, True], ids=["in-order", "act-order"])
def test_gptq_beats_round_to_nearest(shape, act_order, dtype):
    n_out, k = shape
    g = torch.Generator().manual_seed(n_out)
    weight = torch.randn(n_out, k, generator=g)
    x_cal, x_test = _correlated_inputs(2048, k, 1), _correlated_inputs(1024, k, 2)
    acc = HessianAccumulator(k, torch.device("cpu"))
    for part in x_cal.split(300):
        acc.update(part)
    q_rtn, scale = quantize_per_channel(weight, dtype)
    q = gptq_quantize(weight, acc.hessian, scale, dtype, block_size=32, act_order=act_order)
    assert q.dtype == dtype and q.shape == weight.shape
    # Same grid as RTN (the scale is fixed up front), different rounding choices.
    err_rtn = _output_error(x_test, weight, q_rtn, scale)
    err_gptq = _output_error(x_test, weight, q, scale)
    assert err_gptq < 0.7 * err_rtn, (err_gptq, err_rtn)


def test_hessian_running_mean():
    x = torch.randn(50, 7, dtype=torch.float32)
    acc = HessianAccumulator(7, torch.device("cpu"))
    for part in x.split(13):
        acc.update(part.reshape(1, -1, 7))
    torch.testing.assert_close(acc.hessian, 2 * x.t() @ x / 50, rtol=1e-5, atol=1e-5)
    assert acc.n_tokens == 50


def test_dead_columns_are_zeroed():
    weight = torch.randn(5, 9)
    x = torch.randn(100, 9)
    x[:, 4] = 0.0
    _, scale = quantize_per_channel(weight, torch.int8)
    q = gptq_quantize(weight, 2 * x.t() @ x / 100, scale)
    assert bool((q[:, 4] == 0).all())


def test_dead_columns_do_not_change_the_rounding_with_the_input_scale():
    """Dead columns got a unit diagonal that the damping's mean then counted: with inputs of
    1e-3 (down_proj's scale) the live columns were damped ~100x harder and GPTQ's gain went from
    0.47 to 0.88 of round-to-nearest's error. Scaling the inputs must not change the rounding."""
    weight = torch.randn(24, 160, generator=torch.Generator().manual_seed(3))
    x = _correlated_inputs(1024, 160, 5)
    x[:, :8] = 0.0
    _, scale = quantize_per_channel(weight, torch.int8)
    q = {amplitude: gptq_quantize(weight, 2 * (x * amplitude).t() @ (x * amplitude) / 1024, scale)
         for amplitude in (1.0, 1e-3)}
    assert torch.equal(q[1.0], q[1e-3])
    q_rtn, _ = quantize_per_channel(weight, torch.int8)
    assert _output_error(x, weight, q[1e-3], scale) < 0.7 * _output_error(x, weight, q_rtn, scale)


def _tiny_llama():
    config = LlamaConfig(hidden_size=48, intermediate_size=112, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=131)
    return AutoModelForCausalLM.from_config(config).eval()


def test_model_path_shares_hessians_and_lowers_error():
    torch.manual_seed(0)
    model = _tiny_llama()
    blocks = torch.randint(0, 131, (6, 19))
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.down_proj"]
    hessians = collect_hessians(model, blocks, names, batch_size=4, progress=False)
    assert hessians[names[0]] is hessians[names[1]]  # q and k read the same tensor
    assert hessians[names[0]].n_tokens == 6 * 19
    weights_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = gptq_quantize_weights(model, blocks, names, progress=False, batch_size=4)
    assert all(torch.equal(p, weights_before[n]) for n, p in model.named_parameters())
    modules = dict(model.named_modules())
    seen = {}
    handle = modules[names[2]].register_forward_pre_hook(lambda _m, a: seen.update(x=a[0].reshape(-1, 112)))
    with torch.no_grad():
        model(input_ids=blocks)
    handle.remove()
    weight = modules[names[2]].weight.detach()
    q, scale = result[names[2]]
    assert q.dtype == torch.int8 and scale.shape == (48,) and scale.dtype == torch.float32
    q_rtn, _ = quantize_per_channel(weight, torch.int8)
    assert _output_error(seen["x"], weight, q, scale) < _output_error(seen["x"], weight, q_rtn, scale)


def test_mse_observer_path_and_bad_input():
    model = _tiny_llama()
    blocks = torch.randint(0, 131, (2, 11))
    name = "model.layers.0.mlp.up_proj"
    q, scale = gptq_quantize_weights(model, blocks, [name], weight_observer="mse", progress=False)[name]
    absmax_scale = dict(model.named_modules())[name].weight.detach().abs().amax(1) / 127
    assert bool((scale <= absmax_scale * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="not supported"):
        gptq_quantize_weights(model, blocks, [name], dtype=torch.float16, progress=False)
    with pytest.raises(ValueError, match="not nn.Linear"):
        gptq_quantize_weights(model, blocks, ["model.layers.0.mlp"], progress=False)
    with pytest.raises(ValueError, match=r"not nn.Linear layers of this model: \['model.layers.0.mlp.nope'\]"):
        gptq_quantize_weights(model, blocks, ["model.layers.0.mlp.nope"], progress=False)
    with pytest.raises(ValueError, match="shapes"):
        gptq_quantize(torch.randn(3, 4), torch.eye(5), torch.ones(3))


def _two_block_llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=48, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=131)
    return AutoModelForCausalLM.from_config(config).eval()


_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("dtype,static", [(torch.int8, False), (torch.float8_e4m3fn, False), (torch.int8, True)])
def test_sequential_gptq_sees_the_quantized_blocks_before(dtype, static):
    """Block 0 is rounded on the float model's inputs, as without ``sequential``; block 1 on the
    inputs that block 0 gives once quantized, built here by hand: block 0's Linears with their
    dequantized GPTQ weights and their inputs quantized per token (or per tensor at a range)."""
    from quantkit.calibration.sensitivity import quantize_dequantize_input
    from quantkit.kernels.reference import scale_from_amax

    model = _two_block_llama()
    blocks = torch.randint(0, 131, (5, 23), generator=torch.Generator().manual_seed(1))
    names = [f"model.layers.{i}.{layer}" for i in (0, 1) for layer in _LAYERS]
    amax = {name: torch.tensor(0.5 + 0.1 * i) for i, name in enumerate(names)} if static else None
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    sequential = gptq_quantize_weights(model, blocks, names, dtype, progress=False, sequential=True, input_amax=amax)
    for n, p in model.named_parameters():  # the very same Parameters, unchanged, and no hook left behind
        assert p is before[n][0] and torch.equal(p, before[n][1])
    assert not any(m._forward_pre_hooks or "forward" in vars(m) or list(m.buffers(recurse=False))
                   for m in model.modules() if isinstance(m, torch.nn.Linear))
    per_block = gptq_quantize_weights(model, blocks, names, dtype, progress=False, per_block=True)
    for name in names[:7]:
        assert all(torch.equal(a, b) for a, b in zip(sequential[name], per_block[name])), name
    assert any(not torch.equal(sequential[n][0], per_block[n][0]) for n in names[7:])

    modules = dict(model.named_modules())
    for name in names[:7]:
        q, scale = sequential[name]
        linear = modules[name]
        linear.weight.data = (q.float() * scale[:, None]).to(linear.weight.dtype)
        static_scale = scale_from_amax(amax[name], dtype) if static else None
        linear.register_forward_pre_hook(lambda _m, a, s=static_scale: (quantize_dequantize_input(a[0], dtype, s),))
    by_hand = gptq_quantize_weights(model, blocks, names[7:], dtype, progress=False)
    for name in names[7:]:
        assert all(torch.equal(a, b) for a, b in zip(sequential[name], by_hand[name])), name


@pytest.mark.parametrize("dtype,static", [(torch.int8, False), (torch.float8_e4m3fn, False), (torch.int8, True)])
def test_sequential_gptq_statistics_are_those_of_the_converted_blocks(dtype, static, monkeypatch):
    """Block 1's Hessians in sequential mode against those collected with block 0 converted to real
    QuantLinears (the torch reference) from the same results: equal to float32 summation order
    (~1e-7 relative). Without the input quantization they would be 3e-3 to 0.5 apart."""
    from quantkit.calibration import gptq
    from quantkit.convert import _set_submodule
    from quantkit.nn import QuantLinear

    model = _two_block_llama()
    blocks = torch.randint(0, 131, (5, 23), generator=torch.Generator().manual_seed(1))
    names = [f"model.layers.{i}.{layer}" for i in (0, 1) for layer in _LAYERS]
    amax = {name: torch.tensor(0.5 + 0.1 * i) for i, name in enumerate(names)} if static else None
    hessians = []
    layer = gptq._gptq_layer
    monkeypatch.setattr(gptq, "_gptq_layer", lambda weight, H, *args: (hessians.append(H.clone()),
                                                                         layer(weight, H, *args))[1])
    result = gptq_quantize_weights(model, blocks, names, dtype, progress=False, sequential=True, input_amax=amax)
    for name in names[:7]:
        _set_submodule(model, name, QuantLinear.from_linear(
            model.get_submodule(name), dtype, input_amax=amax[name] if static else None,
            quantized_weight=result[name], backend="torch"))
    converted = collect_hessians(model, blocks, names[7:], progress=False)
    for name, H in zip(names[7:], hessians[7:]):
        want = converted[name].hessian
        assert float((H - want).norm() / want.norm()) < 1e-5, name


@pytest.mark.parametrize("blockwise", [True, False])
def test_sequential_gptq_restores_the_model_when_a_pass_fails(blockwise, monkeypatch):
    """Block 1's statistics pass fails inside the block, on recorded block inputs or (blocks not a
    chain) in a whole-model pass."""
    from quantkit.calibration.blockwise import BlockInputs

    model = _two_block_llama()
    blocks = torch.randint(0, 131, (2, 11))
    names = [f"model.layers.{i}.{layer}" for i in (0, 1) for layer in _LAYERS]
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    calls = []

    def failing(_module, _args):  # block 1's first forward after block 0's rounding
        if all("forward" in vars(model.get_submodule(n)) for n in names[:7]):
            calls.append(1)
            raise RuntimeError("out of memory (simulated)")

    if not blockwise:
        monkeypatch.setattr(BlockInputs, "record", classmethod(lambda cls, *args, **kwargs: None))
    failure = model.model.layers[1].register_forward_pre_hook(failing)
    with pytest.raises(RuntimeError, match="simulated"):
        gptq_quantize_weights(model, blocks, names, progress=False, sequential=True)
    assert calls == [1]
    failure.remove()
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1])
    for name in names:
        linear = model.get_submodule(name)
        assert "forward" not in vars(linear) and not list(linear.buffers())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_sequential_gptq_of_a_static_scheme_needs_every_input_range():
    model = _two_block_llama()
    blocks = torch.randint(0, 131, (2, 11))
    names = ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    with pytest.raises(ValueError, match="1 have none, the first model.layers.0.mlp.up_proj"):
        gptq_quantize_weights(model, blocks, names, progress=False, sequential=True,
                              input_amax={names[1]: torch.tensor(1.0)})
    assert not any(m._forward_pre_hooks for m in model.modules())
