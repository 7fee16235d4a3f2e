"""Mixture-of-experts blocks unstacked into one Linear per expert (quantkit/models/experts.py):
the same function as transformers' stacked module, the source checkpoint's names and rows, and
the experts quantized, calibrated, fused and saved like every other Linear."""

import json
import logging

import pytest
import torch
import transformers

import quantkit
from quantkit.kernels.reference import scale_from_amax
from quantkit.models.experts import UnstackedExperts, input_scale_groups, stacked_experts, unstack_experts
from quantkit.nn import QuantLinear
from tests.tiny import make_tokenizer

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CONFIGS = {
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48,
                                                     shared_expert_intermediate_size=80, num_experts=5,
                                                     num_experts_per_tok=2, **COMMON),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=6,
                                                     num_experts_per_tok=2, **COMMON),
    "mixtral": lambda: transformers.MixtralConfig(intermediate_size=48, num_local_experts=11, num_experts_per_tok=2,
                                                  **COMMON),
    "olmoe": lambda: transformers.OlmoeConfig(intermediate_size=48, num_experts=7, num_experts_per_tok=3, **COMMON),
}


def _model(arch):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    with torch.no_grad():  # random init's near-uniform routing would hide a misrouted expert
        for module in model.modules():
            if hasattr(module, "gate_up_proj") or type(module).__name__.endswith("Router"):
                for p in module.parameters(recurse=False):
                    p.mul_(4.0)
    return model


def _ids(seed=0, shape=(3, 17)):
    return torch.randint(3, 300, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_unstacked_experts_compute_what_the_stacked_ones_do(arch, tmp_path):
    model = _model(arch)
    model.save_pretrained(tmp_path)  # the source layout: what save_pretrained writes
    from safetensors.torch import load_file

    source = load_file(str(tmp_path / "model.safetensors"))
    ids = _ids()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    names = unstack_experts(model)
    assert names == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(isinstance(model.get_submodule(name), UnstackedExperts) for name in names)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    # Each expert Linear reverts (as save() reverts it) to the source checkpoint's name, with its rows.
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(model, dict(model.state_dict()))
    assert set(reverted) == set(source)
    experts = [name for name in source if ".experts." in name]
    assert len(experts) == 2 * 3 * model.get_submodule(names[0]).num_experts
    assert all(torch.equal(reverted[name], source[name]) for name in experts)


def test_a_layout_it_cannot_split_stays_stacked():
    """gpt-oss stores its experts transposed, with biases and its own gate: not taken, so they stay
    stacked in 16 bits and the report names them."""
    config = transformers.GptOssConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert stacked_experts(model) == {}
    qmodel = quantkit.quantize(model, "int8", progress=False)
    assert "GptOssExperts" in qmodel.quantkit_report.other_weights


@pytest.mark.parametrize("scheme", ["int8-static", "fp8-static"])
def test_static_experts_share_one_input_scale_per_projection_set(scheme):
    """vLLM runs a layer's experts as one GEMM with one input scale (the largest): quantkit
    calibrates the largest input of all gate/up projections, and of all down projections."""
    config = quantkit.QuantConfig.preset(scheme)
    blocks = _ids(1, (4, 24))
    observed = _model("qwen3_moe")
    unstack_experts(observed)
    amax = {}

    def hook(name):
        def record(_module, args):
            amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
        return record

    for name, module in observed.named_modules():
        if type(module) is torch.nn.Linear and ".experts." in name:
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        observed(input_ids=blocks)
    qmodel = quantkit.quantize(_model("qwen3_moe"), config, blocks, progress=False)
    groups = input_scale_groups(qmodel)
    assert len(groups) == 4  # per layer: gate/up of every expert, down of every expert
    for group in groups:
        seen = [amax[name] for name in group if name in amax]
        assert len(set(seen)) > 1  # the experts saw different ranges: sharing is not a no-op here
        expected = scale_from_amax(torch.tensor(max(seen)), config.torch_dtype).reshape(1)
        for name in group:
            torch.testing.assert_close(qmodel.get_submodule(name).input_scale, expected, rtol=1e-6, atol=0)


def test_partly_ignored_experts_are_named_in_a_warning(caplog):
    config = quantkit.QuantConfig.preset("int8", ignore=("lm_head", "*.experts.0.*"))
    with caplog.at_level(logging.WARNING, logger="quantkit.convert"):
        qmodel = quantkit.quantize(_model("qwen2_moe"), config, progress=False)
    assert "model.layers.0.mlp.experts: 3 of its 15 expert layers stay in 16 bits" in caplog.text
    assert type(qmodel.get_submodule("model.layers.0.mlp.experts.0.up_proj")) is torch.nn.Linear
    assert isinstance(qmodel.get_submodule("model.layers.0.mlp.experts.1.up_proj"), QuantLinear)


def test_sensitive_layers_kept_in_16_bits_are_never_experts():
    config = quantkit.QuantConfig.preset("int8", keep_sensitive=2)
    qmodel = quantkit.quantize(_model("qwen3_moe"), config, _ids(2, (4, 24)), progress=False)
    assert qmodel.quantkit_kept and not any(".experts." in name for name in qmodel.quantkit_kept)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scheme", ["int8", "fp8-static"])
def test_optimize_runs_the_experts_as_two_grouped_gemms(backend, scheme):
    """optimize() stacks each layer's quantized experts (Mixtral's w1/w3/w2 answer as gate_proj /
    up_proj / down_proj) for the grouped kernel, routed on the device: the experts' buffers become
    views of the stacked weights, graphs may capture the model, and the logits stay close (the
    grouped kernel multiplies act(gate) * up in float32, the plain path rounds both first)."""
    from quantkit.models.experts import routes_on_host

    config = quantkit.QuantConfig.preset(scheme, backend=backend)
    qmodel = quantkit.quantize(_model("mixtral"), config, _ids(7, (2, 24)), progress=False)
    ids = _ids(3)
    with torch.no_grad():
        reference = qmodel(input_ids=ids).logits
    assert routes_on_host(qmodel)
    report = quantkit.optimize(qmodel).quantkit_fast_path
    assert report.grouped_experts == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert not any(".experts." in name for name in report.fused_mlps)
    assert routes_on_host(qmodel) == (backend == "torch")  # the torch twin syncs per expert
    experts = qmodel.get_submodule("model.layers.1.mlp.experts")
    grouped = experts.__dict__["_grouped"]
    assert experts[10].w3.weight.data_ptr() == grouped.w13[10, 48:].data_ptr()  # a view, not a copy
    with torch.no_grad():
        logits = qmodel(input_ids=ids).logits
        assert experts.__dict__["_grouped"] is grouped  # not restacked by a forward
        assert ((logits - reference).norm() / reference.norm()).item() < 2e-3
        # Buffers replaced behind its back (a device move, a load): restacked from them on the next call.
        experts._apply(lambda t: t.clone())
        assert torch.equal(qmodel(input_ids=ids).logits, logits)
        assert experts.__dict__["_grouped"] is not grouped
        # A scale replaced alone (weights untouched) is picked up too.
        down = experts[0].down_proj
        down._buffers["weight_scale"] = down.weight_scale * 2
        changed = qmodel(input_ids=ids).logits
        assert not torch.equal(changed, logits)
        down._buffers["weight_scale"] = down.weight_scale / 2
        assert torch.equal(qmodel(input_ids=ids).logits, logits)


def _grouped_qwen3_experts(scheme: str):
    """A one-layer Qwen3-MoE's experts (2 of 48, hidden 64), quantized with ``scheme`` on the
    Triton backend and stacked for the grouped GEMMs (``optimize``)."""
    config = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=2,
                                         num_experts_per_tok=2, **{**COMMON, "num_hidden_layers": 1})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    qconfig = quantkit.QuantConfig.preset(scheme, backend="triton")
    quantkit.optimize(quantkit.quantize(model, qconfig, _ids(7, (2, 24)), progress=False), attention=False, rope=False)
    experts = model.model.layers[0].mlp.experts
    return experts


@pytest.mark.parametrize("scheme", ["fp8-static", "int8"])
def test_prefill_sizes_keep_the_rows_in_slot_order(scheme, monkeypatch):
    """Over 192 pairs an expert (128-row blocks) the grouped layer gathers the tokens into the
    plan's slots once, runs both GEMMs over whole expert blocks and sums each token's rows from
    their slots: the pair-order path's output to float32 rounding (the combine multiplies each
    rounded row by its routing weight; the pair-order GEMM rounds the weighted row), pairs of no
    expert included."""
    from quantkit.kernels import ops

    experts = _grouped_qwen3_experts(scheme)
    gen = torch.Generator().manual_seed(11)
    tokens = 197  # 394 pairs over 2 experts
    hidden = torch.randn(tokens, 64, generator=gen)
    index = torch.randint(0, 3, (tokens, 2), generator=gen)  # 2: no expert (expert parallelism's sentinel)
    weights = torch.rand(tokens, 2, generator=gen)
    calls = []
    slot_mm = ops.grouped_slot_mm
    monkeypatch.setattr(ops, "grouped_slot_mm", lambda *a, **k: calls.append(1) or slot_mm(*a, **k))
    with torch.no_grad():
        slot_order = experts(hidden, index, weights)
        assert len(calls) == 2
        monkeypatch.setattr(ops, "moe_slot_order", lambda plan: False)
        pair_order = experts(hidden, index, weights)
    assert len(calls) == 2
    assert ((slot_order - pair_order).norm() / pair_order.norm()).item() < 1e-6


@pytest.mark.parametrize("scheme", ["fp8", "int8-static"])
def test_quantized_experts_round_trip_in_the_source_layout(scheme, tmp_path):
    """Saved per expert under the source names (Mixtral's block_sparse_moe.experts.N.w1), each with
    its scales; quantkit.load unstacks and reads them back to the same logits."""
    from safetensors import safe_open

    source = tmp_path / "source"
    _model("mixtral").save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    model, _ = quantkit.load_model(source)
    qmodel = quantkit.quantize(model, scheme, _ids(4, (2, 24)), progress=False)
    if scheme == "int8-static":
        with pytest.warns(UserWarning, match="vLLM runs INT8 experts only with dynamic per-token activations"):
            out = quantkit.save(qmodel, tmp_path / "ckpt", tokenizer=make_tokenizer())
    else:
        out = quantkit.save(qmodel, tmp_path / "ckpt", tokenizer=make_tokenizer())
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        saved = set(handle.keys())
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        original = set(handle.keys())
    expert = "model.layers.1.block_sparse_moe.experts.10.w3"
    assert original <= saved and f"{expert}.weight_scale" in saved
    assert (f"{expert}.input_scale" in saved) == (scheme == "int8-static")
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert not any(".experts." in name for name in ignore)
    loaded = quantkit.load(out, device="cpu", progress=False)
    assert isinstance(loaded.get_submodule("model.layers.1.mlp.experts.10.w3"), QuantLinear)
    ids = _ids(5)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, qmodel(input_ids=ids).logits)


def test_transformers_loads_fp8_experts_dequantized(tmp_path):
    """transformers (compressed-tensors) reads the per-expert FP8 tensors with dequantize=True and
    stacks them: its experts hold quantkit's dequantized weights."""
    pytest.importorskip("compressed_tensors")
    source = tmp_path / "source"
    _model("qwen2_moe").save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    model, _ = quantkit.load_model(source)
    qmodel = quantkit.quantize(model, "fp8", progress=False)
    out = quantkit.save(qmodel, tmp_path / "ckpt", tokenizer=make_tokenizer())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    stacked = hf_model.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
    for e in range(5):
        expert = qmodel.get_submodule(f"model.layers.1.mlp.experts.{e}")
        ours = torch.cat([expert.gate_proj.dequantized_weight(), expert.up_proj.dequantized_weight()])
        torch.testing.assert_close(stacked[e], ours, rtol=1e-6, atol=0)


def test_experts_routed_on_the_host_are_not_captured():
    """The unstacked experts pick their experts on the host (as transformers' eager loop does): a
    CUDA graph cannot hold that, so graphed() and generate(cuda_graph=True) refuse in one line."""
    from quantkit.models.experts import routes_on_host
    from quantkit.models.graphed import GraphedForward

    qmodel = quantkit.quantize(_model("olmoe"), "fp8", progress=False)
    assert routes_on_host(qmodel)
    with pytest.raises(ValueError, match="cannot capture this model's mixture of experts"):
        GraphedForward(qmodel, _graphs=object())
    with pytest.raises(ValueError, match="cuda_graph=True cannot capture this model's mixture of experts"):
        quantkit.generate_tokens(qmodel, _ids(6, (1, 5)), 3, cuda_graph=True)
    tokens = quantkit.generate_tokens(qmodel, _ids(6, (1, 5)), 3)
    assert tokens.shape == (1, 8)


def test_gptq_rounds_an_expert_no_token_reached_to_nearest():
    """GPTQ zeroes the columns a layer never saw: for an expert no calibration token was routed
    to, that was its whole weight. It is rounded to nearest instead."""
    model = _model("mixtral")

    def never_five(_module, _args, out):  # layer 0's router sends expert 5's pairs to expert 4
        logits, scores, index = out
        return logits, scores, torch.where(index == 5, 4, index)

    model.model.layers[0].mlp.gate.register_forward_hook(never_five)
    qmodel = quantkit.quantize(model, quantkit.QuantConfig.preset("int8", gptq=True), _ids(9, (2, 24)),
                               progress=False)
    unseen = qmodel.get_submodule("model.layers.0.mlp.experts.5.w1")
    assert unseen.weight.abs().amax() > 0
    reference = quantkit.quantize(_model("mixtral"), "int8", progress=False).get_submodule(
        "model.layers.0.mlp.experts.5.w1")
    assert torch.equal(unseen.weight, reference.weight)
    assert qmodel.get_submodule("model.layers.0.mlp.experts.4.w1").weight.abs().amax() > 0


@pytest.mark.parametrize("scheme", ["int8-static", "fp8-static"])
def test_every_recipe_takes_an_expert_no_token_reached(scheme):
    """Static scales (the layer's shared one), SmoothQuant, GPTQ and sensitivity with an expert
    that no calibration token reaches: it is quantized, with finite scales, and the model runs."""
    model = _model("mixtral")
    model.model.layers[1].mlp.gate.register_forward_hook(
        lambda _m, _a, out: (out[0], out[1], torch.where(out[2] == 7, 6, out[2])))
    qmodel = quantkit.quantize(model, quantkit.QuantConfig.preset(scheme, "accurate"), _ids(10, (2, 24)),
                               progress=False)
    unseen = qmodel.get_submodule("model.layers.1.mlp.experts.7")
    seen = qmodel.get_submodule("model.layers.1.mlp.experts.6")
    for role in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(unseen, role)
        assert isinstance(layer, QuantLinear) and layer.weight.float().abs().amax() > 0
        assert torch.equal(layer.input_scale, getattr(seen, role).input_scale)
        assert bool(torch.isfinite(layer.weight_scale).all())
    with torch.no_grad():
        assert bool(torch.isfinite(qmodel(input_ids=_ids(11)).logits).all())


def test_a_layer_outside_the_experts_that_never_runs_is_named():
    """Only experts may see no calibration token; another Linear that never runs is named, with the fix."""
    model = _model("qwen3_moe")
    model.model.unused = torch.nn.Linear(64, 64)
    with pytest.raises(ValueError, match=r"model.unused \(and 0 more\) never ran on the calibration data.*ignore="):
        quantkit.quantize(model, "int8-static", _ids(12, (2, 16)), progress=False)


def test_a_loaded_model_keeps_the_checkpoints_config(tmp_path):
    """load() matches the ignore list under the model's names but records the checkpoint's own."""
    config = quantkit.QuantConfig.preset("int8", ignore=("lm_head", "*.experts.3.*"))
    qmodel = quantkit.quantize(_model("mixtral"), config, progress=False)
    out = quantkit.save(qmodel, tmp_path / "ckpt", tokenizer=make_tokenizer())
    loaded = quantkit.load(out, device="cpu", progress=False)
    assert loaded.quantkit_config == quantkit.read_quant_config(out)
    assert "model.layers.0.block_sparse_moe.experts.3.w1" in loaded.quantkit_config.ignore
    assert type(loaded.get_submodule("model.layers.0.mlp.experts.3.w1")) is torch.nn.Linear
    assert isinstance(loaded.get_submodule("model.layers.0.mlp.experts.2.w1"), QuantLinear)


@pytest.mark.parametrize("scheme", ["int8", "fp8-static"])
@pytest.mark.parametrize("tokens", [5, 197], ids=["pair-order", "slot-order"])
def test_grouped_experts_compile_fullgraph(scheme, tokens):
    """The grouped layer traces as one graph (route plan, gather, both GEMMs, quantizations and the
    combine as opaque ops) at a decode size and at a prefill size (slot order: 197 pairs an
    expert), and the compiled call gives the eager result."""
    experts = _grouped_qwen3_experts(scheme)
    gen = torch.Generator().manual_seed(12)
    hidden = torch.randn(tokens, 64, generator=gen)
    index = torch.randint(0, 2, (tokens, 2), generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    with torch.no_grad():
        eager = experts(hidden, index, weights)
        compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")(hidden, index, weights)
    assert torch.equal(compiled, eager)
