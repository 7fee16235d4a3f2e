"""SmoothQuant is an exact identity in floating point and really flattens activation outliers."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from quantkit.calibration.smoothquant import find_smoothing_groups, smooth_model, smoothing_scales
from quantkit.kernels.reference import quantize_per_tensor, qmax_of

VOCAB = 257


def _llama():
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    for name, p in model.named_parameters():
        if p.dim() == 1:  # norms start at 1: make them non-trivial so a wrong fold shows
            p.data.uniform_(0.5, 1.5)
    return model.eval()


def _gemma3():
    config = Gemma3TextConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    for name, p in model.named_parameters():
        if p.dim() == 1:  # Gemma norms are (1 + w) with w = 0 at init
            p.data.normal_(0.0, 0.4)
    return model.eval()


MODELS = [pytest.param(_llama, id="llama"), pytest.param(_gemma3, id="gemma3")]


def _blocks(n=5, seq=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(3, VOCAB, (n, seq), generator=g)
    blocks[:, 0] = 2  # BOS
    return blocks


def _with_outliers(model):
    # Real LLMs have a few huge activation channels; give the input norms some.
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, getattr(layer, "post_attention_layernorm", None)):
                if norm is not None:
                    norm.weight[[3, 41]] = 30.0
    return model


@pytest.mark.parametrize("make_model", MODELS)
def test_logits_unchanged(make_model):
    torch.manual_seed(0)
    model = make_model()
    blocks = _blocks()
    with torch.no_grad():
        before = model(input_ids=blocks).logits
    weights_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = smooth_model(model, blocks, alpha=0.5, batch_size=2, progress=False)
    with torch.no_grad():
        after = model(input_ids=blocks).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5 * float(before.abs().max()))
    # The mechanism must have found every exact group of each decoder layer ...
    found = {(g["producer"].split(".", 2)[-1], tuple(c.rsplit(".", 1)[-1] for c in g["consumers"])) for g in report["groups"]}
    mlp_norm = "post_attention_layernorm" if "llama" in type(model).__name__.lower() else "pre_feedforward_layernorm"
    for i in range(2):
        assert (f"{i}.input_layernorm", ("k_proj", "q_proj", "v_proj")) in found
        assert (f"{i}.{mlp_norm}", ("gate_proj", "up_proj")) in found
        assert (f"{i}.self_attn.v_proj", ("o_proj",)) in found
        assert (f"{i}.mlp.up_proj", ("down_proj",)) in found
    assert len(report["groups"]) == 8
    # ... and really rescaled them (an identity that changes nothing proves nothing).
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, weights_before[n])]
    assert any("o_proj" in n for n in changed) and any("input_layernorm" in n for n in changed)
    assert report["probe_relative_change"] < 1e-5


def test_bf16_model_keeps_its_dtypes_and_function():
    torch.manual_seed(5)
    model = _llama().to(torch.bfloat16)
    blocks = _blocks(3, 15, seed=5)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    with torch.no_grad():
        before = model(input_ids=blocks).logits.float()
    report = smooth_model(model, blocks, alpha=0.5, progress=False)
    assert report["n_smoothed"] == 8
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers
    with torch.no_grad():
        after = model(input_ids=blocks).logits.float()
    # The folds are exact in float32; rounding the folded weights back to bf16 costs what one
    # bf16 rounding of every weight costs (~0.4 % relative), no more.
    assert float((after - before).norm() / before.norm()) < 2e-2


def test_gqa_channel_map_repeats_kv_heads():
    model = _llama()  # 4 query heads over 2 kv heads, head_dim 16
    groups, _ = find_smoothing_groups(model, _blocks(1, 17))
    (vo,) = [g for g in groups if g.producer.endswith("0.self_attn.v_proj")]
    head_dim, n_rep = 16, 2
    expected = torch.tensor([((c // head_dim) // n_rep) * head_dim + c % head_dim for c in range(64)])
    assert torch.equal(vo.channel_maps[0], expected)


@pytest.mark.parametrize("make_model", MODELS)
def test_outliers_flattened_and_static_int8_error_drops(make_model):
    torch.manual_seed(1)
    model = _with_outliers(make_model())
    blocks = _blocks(6, 31, seed=1)
    q_proj = model.model.layers[1].self_attn.q_proj

    def static_int8_error():
        seen = {}
        handle = q_proj.register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0].detach().clone()))
        with torch.no_grad():
            model.model(input_ids=blocks)
        handle.remove()
        x = seen["x"].reshape(-1, 64)
        scale = (x.abs().max() / qmax_of(torch.int8)).reshape(1)
        x_q = quantize_per_tensor(x, scale, torch.int8).float() * scale
        weight = q_proj.weight.detach()
        y, y_q = x @ weight.t(), x_q @ weight.t()
        return float((y - y_q).norm() / y.norm()), float(x.abs().amax(0).max() / x.abs().amax(0).median())

    error_before, spread_before = static_int8_error()
    report = smooth_model(model, blocks, alpha=0.5, batch_size=3, progress=False)
    error_after, spread_after = static_int8_error()
    assert spread_after < 0.3 * spread_before
    assert error_after < 0.5 * error_before
    (entry,) = [g for g in report["groups"] if g["producer"] == "model.layers.1.input_layernorm"]
    assert {o["channel"] for o in entry["outlier_channels"]["top"]} >= {3, 41}


@pytest.mark.parametrize("dtype,static", [(torch.int8, False), (torch.int8, True), (torch.float8_e4m3fn, False)],
                         ids=["int8-dynamic", "int8-static", "fp8-dynamic"])
def test_alpha_search_picks_the_lowest_error_and_stays_exact(dtype, static):
    torch.manual_seed(4)
    model = _with_outliers(_gemma3())
    blocks = _blocks(4, 29, seed=4)
    with torch.no_grad():
        before = model(input_ids=blocks).logits
    grid = (0.3, 0.5, 0.8)
    report = smooth_model(model, blocks, batch_size=2, progress=False, alpha_grid=grid, quant_dtype=dtype,
                          static_activations=static, search_tokens=64)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=blocks).logits, before, rtol=1e-5, atol=1e-5 * float(before.abs().max()))
    assert report["alpha"] == "searched" and len(report["groups"]) == 8
    for entry in report["groups"]:
        errors = entry["search_errors"]
        assert set(errors) == {"none", "0.3", "0.5", "0.8"}
        chosen = "none" if entry["alpha"] is None else f"{entry['alpha']:g}"
        assert errors[chosen] == min(errors.values())
    # The injected outlier channels make smoothing the input norms worth it under static INT8.
    norms = [g for g in report["groups"] if g["producer"].endswith("input_layernorm")]
    if static and dtype == torch.int8:
        assert all(g["alpha"] is not None for g in norms)
        assert all(g["search_errors"][f"{g['alpha']:g}"] < 0.5 * g["search_errors"]["none"] for g in norms)


class _ToyModel(nn.Module):
    """Embedding -> LayerNorm -> Linear -> ReLU -> Linear, optionally with the norm output also added back."""

    def __init__(self, residual: bool):
        super().__init__()
        self.residual = residual
        self.embed = nn.Embedding(VOCAB, 24)
        self.norm = nn.LayerNorm(24)
        self.fc1 = nn.Linear(24, 24)
        self.fc2 = nn.Linear(24, 11)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 2.0)
            self.norm.bias.uniform_(-1.0, 1.0)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, use_cache=False):
        h = self.norm(self.embed(input_ids))
        h = torch.relu(self.fc1(h)) + (h if self.residual else 0.0)
        return self.fc2(h)


def test_layernorm_with_bias_is_folded_exactly():
    torch.manual_seed(2)
    model = _ToyModel(residual=False).eval()
    blocks = _blocks(4, 9)
    with torch.no_grad():
        before = model(blocks)
    report = smooth_model(model, blocks, alpha=0.7, progress=False, probe_tokens=9)
    # ReLU is positively homogeneous, so fc1 -> relu -> fc2 is an exact pair too: the probe finds it.
    assert [g["producer"] for g in report["groups"]] == ["norm", "fc1"]
    with torch.no_grad():
        torch.testing.assert_close(model(blocks), before, rtol=1e-5, atol=1e-5)


def test_norm_that_also_feeds_a_residual_is_skipped():
    torch.manual_seed(3)
    model = _ToyModel(residual=True).eval()
    blocks = _blocks(4, 9)
    with torch.no_grad():
        before = model(blocks)
    report = smooth_model(model, blocks, alpha=0.5, progress=False, probe_tokens=9)
    assert report["groups"] == []
    assert any(s["module"] == "norm" and "not exact" in s["reason"] for s in report["skipped"])
    with torch.no_grad():
        torch.testing.assert_close(model(blocks), before, rtol=0, atol=0)


def test_scales_formula():
    act = torch.tensor([4.0, 0.0, 9.0])
    weight = torch.tensor([1.0, 2.0, 4.0])
    s = smoothing_scales(act, weight, alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 1.0, 1.5], dtype=torch.float64))
    # alpha != 0.5 tells x^alpha / w^(1 - alpha) from x^(1 - alpha) / w^alpha:
    # 16^0.75 / 1 = 8, 81^0.75 / 16^0.25 = 27 / 2; a channel that never fired keeps 1.
    s = smoothing_scales(torch.tensor([16.0, 0.0, 81.0]), torch.tensor([1.0, 2.0, 16.0]), alpha=0.75)
    torch.testing.assert_close(s, torch.tensor([8.0, 1.0, 13.5], dtype=torch.float64))


def test_bad_arguments():
    model = _ToyModel(residual=False)
    with pytest.raises(ValueError, match="alpha"):
        smooth_model(model, _blocks(), alpha=1.5, progress=False)
    with pytest.raises(ValueError, match="blocks"):
        smooth_model(model, torch.randn(2, 5), progress=False)
    with pytest.raises(ValueError, match="alpha_grid"):
        smooth_model(model, _blocks(), alpha_grid=(), progress=False)


def test_norm_fold_rounds_the_gain_first_and_compensates_the_consumers():
    """A 16-bit Gemma norm stores (1 + w) / s - 1, near -1 for a large s, where bf16 keeps few
    bits of the gain: the consumers take the scale the rounded gain really applies."""
    from quantkit.calibration.smoothing_graph import SmoothGroup, _fold

    g = torch.Generator().manual_seed(0)
    norm, consumer = nn.Module(), nn.Linear(16, 8, bias=False).double()
    norm.weight = nn.Parameter(torch.randn(16, generator=g, dtype=torch.float64))
    gain_before, weight_before = norm.weight.detach() + 1.0, consumer.weight.detach().clone()
    scales = torch.linspace(1.0, 60.0, 16, dtype=torch.float64)
    _fold(SmoothGroup("norm", "norm", ["consumer"], offset=1.0), {"norm": norm, "consumer": consumer}, scales,
          stored_dtypes={norm.weight: torch.bfloat16})
    stored = norm.weight.detach()
    assert torch.equal(stored, stored.to(torch.bfloat16).double())  # what the bf16 model will hold
    torch.testing.assert_close((stored + 1.0)[None, :] * consumer.weight, gain_before[None, :] * weight_before,
                               rtol=1e-12, atol=0)


@pytest.mark.parametrize("storage_dtype", [torch.bfloat16, torch.float16])
def test_a_float32_model_stored_in_16_bits_folds_gains_it_can_store(storage_dtype):
    """A model computed in float32 but saved in 16 bits (quantize on a CPU): the folded norm gains
    are that dtype's values and the consumers compensate for their rounding, so the logits stay
    exact; folded in float32 and rounded when saved, they would not be."""
    torch.manual_seed(3)
    model = _gemma3()
    blocks = _blocks()
    with torch.no_grad():
        before = model(input_ids=blocks).logits
    smooth_model(model, blocks, alpha=0.8, progress=False, linear_pairs=False, storage_dtype=storage_dtype)
    with torch.no_grad():
        after = model(input_ids=blocks).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5 * float(before.abs().max()))
    norms = [m.weight for n, m in model.named_modules() if n.endswith(("input_layernorm", "pre_feedforward_layernorm"))]
    assert len(norms) == 4 and all(w.dtype == torch.float32 for w in norms)
    assert all(torch.equal(w, w.to(storage_dtype).float()) for w in norms)

    torch.manual_seed(3)
    plain = _gemma3()
    smooth_model(plain, blocks, alpha=0.8, progress=False, linear_pairs=False)
    assert not all(torch.equal(m.weight, m.weight.to(storage_dtype).float())
                   for n, m in plain.named_modules() if n.endswith("input_layernorm"))


def _relu_llama(gate_bias):
    torch.manual_seed(5)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, hidden_act="relu", mlp_bias=True)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").double().eval()
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.bias.fill_(gate_bias)
    return model


def test_a_consumer_fed_by_two_producers_is_scaled_once():
    """In a ReLU gated MLP both gate->down and up->down are channel-wise linear: both were folded,
    dividing down_proj's input by the square of the intended scale."""
    model = _relu_llama(gate_bias=3.0)  # ReLU(gate) > 0 everywhere: no dead channel hides the map
    blocks = _blocks(4, 17)
    with torch.no_grad():
        before = model(blocks).logits
    report = smooth_model(model, blocks, alpha=0.5, progress=False, probe_tokens=17)
    feeding_down = [g["producer"] for g in report["groups"] if "model.layers.0.mlp.down_proj" in g["consumers"]]
    assert len(feeding_down) == 1, report["groups"]
    assert any(s["reason"].startswith("feeds model.layers.0.mlp.down_proj, whose input another rescaling")
               for s in report["skipped"]), report["skipped"]
    with torch.no_grad():
        torch.testing.assert_close(model(blocks).logits, before, rtol=1e-9, atol=1e-9)


def test_a_producer_left_alone_for_dead_channels_is_reported():
    model = _relu_llama(gate_bias=-0.3)  # two thirds of the ReLU(gate) channels stay at 0
    report = smooth_model(model, _blocks(4, 17), alpha=0.5, progress=False, probe_tokens=17)
    assert any("stay zero on the probe tokens" in s["reason"] for s in report["skipped"]), report["skipped"]


def test_nan_hidden_states_are_refused_in_one_line():
    model = _llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = float("inf")
    blocks = _blocks(3, 11)
    blocks[:, 3] = 7
    with pytest.raises(ValueError, match="hidden states hold NaN or inf on the calibration text"):
        smooth_model(model, blocks, alpha=0.5, progress=False, probe_tokens=11)
