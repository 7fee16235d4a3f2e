"""Block-by-block calibration passes run each decoder block once per batch and give what
whole-model forwards give."""

import pytest
import torch
import transformers
from torch import nn

import quantkit
from quantkit.calibration.blockwise import BlockInputs
from quantkit.calibration.gptq import gptq_quantize_weights
from quantkit.calibration.offload import decoder_blocks
from quantkit.convert import target_linears
from quantkit.nn import QuantLinear
from tests.tiny import make_model

VOCAB = 200


def _gemma3_mixed(layers: int = 3):
    """Sliding and full-attention layers (windows shorter than the data): each block gets its own
    mask and rotary table, so a block run on another block's arguments would compute differently."""
    torch.manual_seed(2)
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=8, max_position_embeddings=256,
        layer_types=["full_attention" if i % 2 else "sliding_attention" for i in range(layers)])
    return transformers.Gemma3ForCausalLM(config).eval()


def _qwen2_moe():
    torch.manual_seed(3)
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


MODELS = {"llama": lambda: make_model("llama", VOCAB, seed=1).float(), "gemma3": _gemma3_mixed}


def _data(n=5, seq_len=24, seed=0):
    return torch.randint(3, VOCAB, (n, seq_len), generator=torch.Generator().manual_seed(seed))


def _whole_model_passes(monkeypatch):
    """From here on, blocks never count as a chain: GPTQ takes a forward through blocks 0..i."""
    monkeypatch.setattr(BlockInputs, "record", classmethod(lambda cls, *args, **kwargs: None))


@pytest.mark.parametrize("arch", sorted(MODELS))
@pytest.mark.parametrize("mode", ["per_block", "sequential"])
def test_blockwise_gptq_equals_whole_model_passes(arch, mode, monkeypatch):
    """5 samples in batches of 2: the last batch is smaller (Gemma 3's masks are then its own)."""
    model = MODELS[arch]()
    names = list(target_linears(model, quantkit.QuantConfig.preset("int8")))
    data = _data()
    steps = []
    run = BlockInputs.run
    monkeypatch.setattr(BlockInputs, "run", lambda self, index, *a, **k: (steps.append(index), run(self, index, *a, **k)))
    blockwise = gptq_quantize_weights(model, data, names, progress=False, batch_size=2, **{mode: True})
    n_blocks = len(decoder_blocks(model))
    # sequential: each block for its statistics, then quantized for the next one's inputs (not the last)
    assert sorted(steps) == sorted(list(range(n_blocks)) + (list(range(n_blocks - 1)) if mode == "sequential" else []))
    _whole_model_passes(monkeypatch)
    whole = gptq_quantize_weights(model, data, names, progress=False, batch_size=2, **{mode: True})
    assert blockwise.keys() == whole.keys() == set(names)
    for name in names:
        assert all(torch.equal(a, b) for a, b in zip(blockwise[name], whole[name])), name
    if mode == "per_block":  # and both equal the one-pass statistics of the float model
        one_pass = gptq_quantize_weights(model, data, names, progress=False, batch_size=2)
        for name in names:
            assert all(torch.equal(a, b) for a, b in zip(blockwise[name], one_pass[name])), name


@pytest.mark.parametrize("sequential", [False, True])
def test_streamed_mixture_of_experts_gptq_equals_whole_model_passes(sequential, monkeypatch):
    """Through the public API, streamed (per-block statistics), on a mixture of experts whose experts
    see few tokens: the same quantized weights either way."""
    config = quantkit.QuantConfig.preset("int8", gptq=True, gptq_sequential=sequential)
    data = _data(n=4, seq_len=16)
    blockwise = quantkit.quantize(_qwen2_moe(), config, data, progress=False, offload_device="cpu")
    _whole_model_passes(monkeypatch)
    whole = quantkit.quantize(_qwen2_moe(), config, data, progress=False, offload_device="cpu")
    expected = {n: m for n, m in whole.named_modules() if isinstance(m, QuantLinear)}
    actual = {n: m for n, m in blockwise.named_modules() if isinstance(m, QuantLinear)}
    assert actual.keys() == expected.keys() and any(".experts." in n for n in actual)
    for name, module in expected.items():
        assert torch.equal(actual[name].weight, module.weight), name
        assert torch.equal(actual[name].weight_scale, module.weight_scale), name


@pytest.mark.parametrize("mode", ["resident", "per_block", "sequential"])
@pytest.mark.parametrize("chain", [True, False])
def test_each_block_runs_once_per_batch_per_step(mode, chain, monkeypatch):
    """Recording: blocks 0..L-1 once per batch; then each block runs once more for its statistics,
    and for sequential once more after that, quantized, for the next block's inputs (the last
    block's outputs are not needed). Without a chain: one forward collecting every Hessian, or
    where one block's Hessians at a time is the point (per_block, sequential) a forward through
    blocks 0..i for block i."""
    model = _gemma3_mixed(layers=5)
    blocks = decoder_blocks(model)
    calls = []
    handles = [b.register_forward_pre_hook(lambda _m, _a, i=i: calls.append(i)) for i, b in enumerate(blocks)]
    names = list(target_linears(model, quantkit.QuantConfig.preset("int8")))
    if not chain:
        _whole_model_passes(monkeypatch)
    gptq_quantize_weights(model, _data(n=3), names, progress=False, batch_size=2, per_block=mode == "per_block",
                          sequential=mode == "sequential")
    for handle in handles:
        handle.remove()
    n_blocks, n_batches = len(blocks), 2
    if chain:
        per_batch = list(range(n_blocks)) * 2 + (list(range(n_blocks - 1)) if mode == "sequential" else [])
    elif mode == "resident":
        per_batch = list(range(n_blocks))
    else:
        per_batch = [i for last in range(n_blocks) for i in range(last + 1)]
    assert sorted(calls) == sorted(per_batch * n_batches)


class _Halving(nn.Module):
    """A block that halves its input in place before its Linear."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(x.mul_(0.5))


class _Stack(nn.Module):
    """Embedding, then blocks; between blocks the loop hands on the output (``"none"``), a view of
    all of it (``"view"``) or a new tensor (``"tanh"``, not a chain)."""

    def __init__(self, between: str = "none", in_place: bool = False):
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList((_Halving() if in_place else nn.Linear(16, 16)) for _ in range(3))
        self.between = between

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, use_cache=False):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
            if self.between == "view":
                h = h[:, slice(0, None), :]
            elif self.between == "tanh":
                h = torch.tanh(h)
        return h


@pytest.mark.parametrize("between, in_place", [("none", False), ("view", False), ("none", True)])
def test_stepping_the_blocks_gives_the_model_output(between, in_place):
    """Also when the loop hands on a view of the whole output, and when blocks edit their input in
    place (each block first run without keeping its outputs, as sequential GPTQ's statistics pass)."""
    data = _data(n=5, seq_len=7)
    model = _Stack(between, in_place)
    inputs = BlockInputs.record(model, model.layers, data, batch_size=2, last=2)
    assert inputs is not None and len(inputs.hidden) == 3
    with pytest.raises(ValueError, match="block 1 cannot run before block 0"):
        inputs.run(1)
    for i in range(3):
        inputs.run(i, keep=False)
        inputs.run(i)
    with torch.no_grad():
        assert torch.equal(torch.cat(inputs.hidden), model(data))


def test_a_broken_chain_is_refused():
    data = _data(n=5, seq_len=7)
    model = _Stack("tanh")
    assert BlockInputs.record(model, model.layers, data, batch_size=2, last=2) is None
    # The chain is checked up to the last block asked for.
    assert BlockInputs.record(model, model.layers, data, batch_size=2, last=0) is not None
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_equal_arguments_of_later_batches_are_shared():
    """Full batches' masks and rotary tables are equal: one copy is held, not one per batch."""
    model = _gemma3_mixed()
    inputs = BlockInputs.record(model, decoder_blocks(model), _data(n=6), batch_size=2, last=2)
    first, third = inputs.calls[0][1].arguments()[1], inputs.calls[2][1].arguments()[1]
    tensors = [k for k, v in first.items() if isinstance(v, torch.Tensor)]
    assert tensors  # position_ids at least
    assert all(first[k] is third[k] for k in tensors)
    cos, sin = first["position_embeddings"]
    assert third["position_embeddings"][0] is cos and third["position_embeddings"][1] is sin
    # Sliding and full layers get different rotary tables: blocks 0 and 1 do not share them.
    assert not torch.equal(inputs.calls[0][0].arguments()[1]["position_embeddings"][0], cos)
    inputs.run(0)  # a block's arguments are dropped once stepped past
    assert all(calls[0] is None and calls[1] is not None for calls in inputs.calls)
