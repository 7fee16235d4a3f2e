"""Per-layer sensitivity ranking finds the layer that was made fragile on purpose."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from quantkit.calibration.sensitivity import (fake_quantized, most_sensitive, rank_layers, shared_input_groups,
                                             target_layers)
from quantkit.config import QuantConfig

VOCAB = 211
FRAGILE = "model.layers.1.self_attn.o_proj"


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # Make the model's predictions sharp (init weights give near-uniform logits) ...
        model.lm_head.weight.mul_(30.0)
        # ... and one layer fragile: a huge weight column on an input channel that is always zero
        # (the v_proj row feeding it is zeroed) does nothing in floating point but sets every
        # row's scale, so the layer's useful weights all round to a grid ~100x too coarse.
        modules = dict(model.named_modules())
        modules["model.layers.1.self_attn.v_proj"].weight[5] = 0.0
        modules[FRAGILE].weight[:, 5] = 5.0
    return model


def _blocks():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(3, VOCAB, (3, 21), generator=g)
    blocks[:, 0] = 2
    return blocks


@pytest.mark.parametrize("scheme", ["int8", "int8-static"])
@pytest.mark.parametrize("method", ["kl", "layer_error"])
def test_fragile_layer_ranks_first(model, scheme, method):
    config = QuantConfig.preset(scheme)
    ranking = rank_layers(model, _blocks(), config, n_blocks=3, batch_size=2, method=method, progress=False,
                          max_seq_len=17)
    names = [n for n, _ in ranking]
    assert set(names) == set(target_layers(model, config)) and "lm_head" not in names
    assert names[0] == FRAGILE, ranking[:3]
    scores = [s for _, s in ranking]
    assert scores == sorted(scores, reverse=True) and min(scores) >= 0.0
    assert ranking[0][1] > 3 * ranking[1][1]
    assert most_sensitive(ranking, 2) == names[:2]
    assert most_sensitive(ranking, 0) == []


def test_groups_that_read_one_input_are_kept_whole(model):
    """vLLM fuses q/k/v and gate/up into one GEMM of one scheme and refuses a checkpoint that keeps
    some of them in 16 bits: keeping one layer keeps its whole group."""
    config = QuantConfig.preset("int8")
    groups = shared_input_groups(model, _blocks(), target_layers(model, config))
    layer = "model.layers.{}.{}".format
    assert [layer(1, "self_attn.q_proj"), layer(1, "self_attn.k_proj"), layer(1, "self_attn.v_proj")] in groups
    assert [layer(0, "mlp.gate_proj"), layer(0, "mlp.up_proj")] in groups
    assert [FRAGILE] in groups and [layer(0, "mlp.down_proj")] in groups
    assert sorted(n for g in groups for n in g) == sorted(target_layers(model, config))
    ranking = [(layer(0, "self_attn.k_proj"), 0.9), (FRAGILE, 0.8), (layer(0, "mlp.up_proj"), 0.7),
               (layer(0, "self_attn.q_proj"), 0.6)]
    assert most_sensitive(ranking, 1, groups) == [layer(0, f"self_attn.{p}_proj") for p in "qkv"]
    assert most_sensitive(ranking, 4, groups) == [layer(0, f"self_attn.{p}_proj") for p in "qkv"] + [FRAGILE]
    assert most_sensitive(ranking, 5, groups)[-2:] == [layer(0, "mlp.gate_proj"), layer(0, "mlp.up_proj")]
    assert most_sensitive(ranking, 2) == [layer(0, "self_attn.k_proj"), FRAGILE]  # no groups: layers alone


def test_a_parallel_block_keeps_attention_and_mlp_groups_apart():
    """Phi feeds q/k/v and fc1 from one norm; engines fuse q/k/v alone, so fc1 is its own group."""
    from transformers import PhiConfig

    torch.manual_seed(0)
    phi = AutoModelForCausalLM.from_config(PhiConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=64)).eval()
    groups = shared_input_groups(phi, _blocks(), target_layers(phi, QuantConfig.preset("int8")))
    attention = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert attention in groups and ["model.layers.0.mlp.fc1"] in groups, groups


def test_fake_quantization_is_undone(model):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    blocks = _blocks()
    with torch.no_grad():
        reference = model(input_ids=blocks).logits
        with fake_quantized(dict(model.named_modules())[FRAGILE], QuantConfig.preset("int8")):
            changed = model(input_ids=blocks).logits
        restored = model(input_ids=blocks).logits
    assert not torch.allclose(changed, reference, atol=1e-3)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    torch.testing.assert_close(restored, reference, rtol=0, atol=0)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="method"):
        rank_layers(model, _blocks(), QuantConfig(), method="ppl", progress=False)
    with pytest.raises(ValueError, match="not quantized"):
        rank_layers(model, _blocks(), QuantConfig(), layer_names=["lm_head"], progress=False)
    with pytest.raises(ValueError, match="n=-1"):
        most_sensitive([("a", 1.0)], -1)


def test_layer_error_scores_a_quantized_head(model):
    """The head lives outside the backbone: its hook never fired, so layer_error scored it 0."""
    ranking = dict(rank_layers(model, _blocks(), QuantConfig.preset("int8", ignore=()), n_blocks=3, batch_size=2,
                               method="layer_error", progress=False, max_seq_len=17))
    assert ranking["lm_head"] > 0


def test_kl_is_of_the_quantized_from_the_float_distribution():
    """KL(p_float || p_quant), the direction the docstring promises, on two 3-way distributions by hand."""
    from quantkit.calibration.sensitivity import _kl

    p = torch.tensor([[0.7, 0.2, 0.1]])
    q = torch.tensor([[0.4, 0.4, 0.2]])
    expected = sum(a * math.log(a / b) for a, b in zip(p[0].tolist(), q[0].tolist()))  # 0.1838
    reverse = sum(b * math.log(b / a) for a, b in zip(p[0].tolist(), q[0].tolist()))  # 0.1920
    assert _kl([p.log()], [q.log()]) == pytest.approx(expected, rel=1e-6)
    assert abs(expected - reverse) > 5e-3
    # Mean over positions: a second, identical row halves it.
    assert _kl([torch.cat([p, p]).log()], [torch.cat([q, p]).log()]) == pytest.approx(expected / 2, rel=1e-6)


def test_a_tied_head_is_scored_alone():
    """Scoring a tied lm_head wrote its fake-quantized weight into the shared tensor, so the input
    embeddings were quantized too and the head over-ranked (5.85e-8 against 3.03e-8 alone)."""
    torch.manual_seed(2)
    config = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True)
    tied = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        tied.lm_head.weight.mul_(30.0)  # sharp predictions (shared: the embeddings scale too)
    untied = AutoModelForCausalLM.from_config(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False})).eval()
    untied.load_state_dict(tied.state_dict(), strict=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(tied.lm_head.weight)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    recipe = QuantConfig.preset("int8", ignore=())
    score = {name: dict(rank_layers(m, _blocks(), recipe, layer_names=["lm_head"], progress=False))["lm_head"]
             for name, m in (("tied", tied), ("untied", untied))}
    assert score["tied"] == pytest.approx(score["untied"], rel=1e-6)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight  # still tied after scoring
