"""Streaming calibration (one decoder block on the device at a time) gives the same quantized model."""

import copy

import pytest
import torch

import quantkit
from quantkit.calibration.gptq import gptq_quantize_weights
from quantkit.calibration.offload import check_offload, decoder_blocks, stream_blocks
from quantkit.convert import target_linears
from quantkit.nn import QuantLinear
from tests.tiny import make_model


def _blocks(vocab, n=4, seq_len=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, seq_len), generator=g)


@pytest.mark.parametrize("arch, sequential", [("llama", False), ("gemma3", False), ("llama", True),
                                              ("gemma3", True)])
def test_streamed_recipe_equals_resident_recipe(arch, sequential):
    """SmoothQuant + sensitivity + static ranges + per-block (or sequential) GPTQ under streaming ==
    the plain run."""
    model = make_model(arch, vocab_size=200, seed=3).float().eval()
    streamed = copy.deepcopy(model)
    config = quantkit.QuantConfig.preset("int8-static", smoothquant_alpha=0.5, gptq=True, keep_sensitive=1,
                                         gptq_sequential=sequential)
    data = _blocks(200)
    if sequential:  # quantize() passes the option on: the last block's weights differ from per-block GPTQ's
        other = quantkit.quantize(copy.deepcopy(model), config.replace(gptq_sequential=False), data, progress=False)
    quantkit.quantize(model, config, data, progress=False)
    if sequential:
        last = len(decoder_blocks(model)) - 1
        assert any(not torch.equal(m.weight, other.get_submodule(n).weight) for n, m in model.named_modules()
                   if isinstance(m, QuantLinear) and f"layers.{last}." in n)
    quantkit.quantize(streamed, config, data, progress=False, offload_device="cpu")
    assert streamed.quantkit_kept == model.quantkit_kept
    expected = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    actual = {n: m for n, m in streamed.named_modules() if isinstance(m, QuantLinear)}
    assert expected.keys() == actual.keys() and len(actual) > 0
    for name, module in expected.items():
        # GPTQ statistics gathered block by block equal the one-pass statistics (same inputs).
        assert torch.equal(actual[name].weight, module.weight), name
        torch.testing.assert_close(actual[name].weight_scale, module.weight_scale, rtol=0, atol=0)
        torch.testing.assert_close(actual[name].input_scale, module.input_scale, rtol=0, atol=0)
    ids = _blocks(200, n=2, seq_len=19, seed=1)
    with torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, model(input_ids=ids).logits)


def test_stream_blocks_moves_one_block_at_a_time():
    model = make_model("llama", vocab_size=200, seed=0).float().eval()
    n_blocks = len(decoder_blocks(model))
    assert n_blocks >= 2
    with stream_blocks(model, "cpu") as stats, torch.no_grad():
        model(input_ids=_blocks(200, n=2))
    assert stats.onloads == n_blocks and stats.max_resident == 1 and stats.resident == 0


def test_accelerate_cpu_offload_is_refused_with_the_way_out():
    model = make_model("llama", vocab_size=200)
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu"}
    with pytest.raises(ValueError, match="offload_device='cuda'"):
        check_offload(model)


def test_streaming_needs_the_model_in_host_memory():
    model = make_model("llama", vocab_size=200).to("meta")
    with pytest.raises(ValueError, match="device='cpu'"):
        with stream_blocks(model, "cpu"):
            pass
