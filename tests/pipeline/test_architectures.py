"""Architectures whose weights are not all in nn.Linear: mixture-of-experts blocks (transformers 5
keeps the experts as stacked 3-D tensors, which quantkit unstacks into one Linear per expert, and
the router as its own module) and GPT-2's Conv1D."""

import logging

import pytest
import torch
import transformers

import quantkit
from quantkit.nn import QuantLinear
from tests.tiny import make_tokenizer

COMMON = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _model(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _qwen2_moe():
    """Tiny Qwen2-MoE: 4 routed experts (3-D tensors), a shared expert and its one-output gate."""
    return _model(transformers.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=64,
                                              shared_expert_intermediate_size=128, num_experts=4,
                                              num_experts_per_tok=2, **COMMON))


def _quantized_qwen2_moe(config, caplog):
    """(quantized tiny Qwen2-MoE, its logits, the 16-bit model's logits) on the same random ids."""
    model = _qwen2_moe()
    ids = torch.randint(1, 300, (2, 11))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    with caplog.at_level(logging.WARNING, logger="quantkit.convert"):
        qmodel = quantkit.quantize(model, config)
    with torch.no_grad():
        return qmodel, qmodel(input_ids=ids).logits, reference


def test_qwen2_moe_quantizes_its_experts_and_keeps_its_routing_gates(caplog):
    qmodel, logits, reference = _quantized_qwen2_moe("int8", caplog)
    report = qmodel.quantkit_report
    # Every routed expert's three projections, one QuantLinear each, as the source checkpoint names them.
    experts = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(2) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")]
    assert set(experts) <= set(report.converted)
    assert all(isinstance(qmodel.get_submodule(name), QuantLinear) for name in experts)
    gates = [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)]
    assert set(gates) <= set(report.skipped) and not set(gates) & set(report.converted)
    assert set(report.other_weights) == {"Qwen2MoeTopKRouter"}  # the router's weight, not a Linear
    assert "of the model's matrix weights were quantized" not in caplog.text
    assert ((logits - reference).norm() / reference.norm()).item() < 0.05


def test_ignored_experts_stay_stacked_and_are_reported(caplog):
    config = quantkit.QuantConfig.preset("int8", ignore=("lm_head", "*.experts.*"))
    qmodel, logits, reference = _quantized_qwen2_moe(config, caplog)
    report = qmodel.quantkit_report
    # shared_expert_gate scales the whole shared expert from one output: it stays in 16 bits, like the router.
    gates = [f"model.layers.{i}.mlp.shared_expert_gate" for i in range(2)]
    assert set(gates) <= set(report.skipped) and not set(gates) & set(report.converted)
    assert all(type(qmodel.get_submodule(name)) is torch.nn.Linear for name in gates)
    assert any(name.endswith("shared_expert.down_proj") for name in report.converted)
    # The routed experts are 3-D tensors, not Linears: the report and a warning say they stay in 16 bits.
    assert set(report.other_weights) == {"Qwen2MoeExperts", "Qwen2MoeTopKRouter"}
    assert report.other_weights["Qwen2MoeExperts"] == 2 * 4 * 3 * 64 * 64
    assert "Qwen2MoeExperts" in str(report)
    assert "of the model's matrix weights were quantized" in caplog.text
    assert ((logits - reference).norm() / reference.norm()).item() < 0.05


def test_a_model_without_linears_is_refused_by_name():
    config = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    model = _model(config)
    with pytest.raises(ValueError, match="its weights are in Conv1D, which quantkit does not quantize"):
        quantkit.quantize(model, "int8")
    # Before any calibration work: keep_sensitive used to report "all 0 quantizable layers" instead.
    blocks = torch.randint(1, 300, (2, 16))
    with pytest.raises(ValueError, match="Conv1D"):
        quantkit.quantize(model, quantkit.QuantConfig.preset("int8-static", "accurate"), blocks)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_fewer_calibration_blocks_than_asked_warns(text_dir):
    tokenizer = make_tokenizer()
    with pytest.warns(UserWarning, match="fewer than num_samples=100000"):
        blocks = quantkit.prepare_calibration_data(tokenizer, str(text_dir), num_samples=100000, seq_len=32)
    assert 1 <= len(blocks) < 100000


def test_checkpoints_with_a_quantized_routing_gate_still_load(tmp_path, monkeypatch):
    """Checkpoints saved before routing gates stayed in 16 bits hold a quantized shared_expert_gate
    and list only lm_head as ignored: the loader follows the checkpoint's ignore list."""
    from quantkit import convert

    model = _qwen2_moe()
    with monkeypatch.context() as patch:
        patch.setattr(convert, "ROUTER_NAMES", ())
        qmodel = quantkit.quantize(model, "int8")
        assert "model.layers.0.mlp.shared_expert_gate" in qmodel.quantkit_report.converted
        out = quantkit.save(qmodel, tmp_path / "old", tokenizer=make_tokenizer())
    loaded = quantkit.load(out, device="cpu")
    assert isinstance(loaded.get_submodule("model.layers.0.mlp.shared_expert_gate"), QuantLinear)
    ids = torch.randint(1, 300, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, qmodel(input_ids=ids).logits)


def test_ignoring_every_linear_names_the_ignore_patterns():
    with pytest.raises(ValueError, match="check the ignore patterns"):
        quantkit.quantize(_qwen2_moe(), quantkit.QuantConfig.preset("int8", ignore=("lm_head", "model.*")))


def test_moe_checkpoint_keeps_the_source_layout(tmp_path):
    """transformers 5 stacks a mixture of experts' per-expert matrices into 3-D tensors when it
    loads; a checkpoint carries them per expert, as save_pretrained writes them and vLLM reads them
    (before, quantkit wrote the stacked `mlp.experts.gate_up_proj`). With the experts kept in 16
    bits, quantkit.load stacks them back, and transformers (compressed-tensors) loads the checkpoint
    with the experts' values."""
    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open

    source = tmp_path / "source"
    _qwen2_moe().save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    model, tokenizer = quantkit.load_model(source)
    qmodel = quantkit.quantize(model, quantkit.QuantConfig.preset("fp8", ignore=("lm_head", "*.experts.*")),
                               progress=False)
    out = quantkit.save(qmodel, tmp_path / "ckpt", tokenizer=tokenizer)

    def names(directory):
        with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
            return set(handle.keys())

    saved, original = names(out), names(source)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved and not any("gate_up_proj" in n for n in saved)
    assert original <= saved and all(n.endswith("_scale") for n in saved - original)
    # The experts stay in 16 bits, and the ignore list names each, as vLLM matches an expert layer
    # (it takes one the list does not name for quantized).
    import json

    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    experts = {n.removesuffix(".weight") for n in original if ".experts." in n}
    assert len(experts) == 2 * 4 * 3 and experts <= set(ignore)
    ids = torch.randint(1, 300, (2, 13), generator=torch.Generator().manual_seed(3))
    loaded = quantkit.load(out, device="cpu", progress=False)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, qmodel(input_ids=ids).logits)
        assert torch.equal(hf_model.get_parameter(experts).float(), qmodel.get_parameter(experts).float())
        ours, theirs = qmodel(input_ids=ids).logits, hf_model(input_ids=ids).logits
        original = quantkit.load_model(source)[0](input_ids=ids).logits
    # Float noise between the two stacks moves the odd activation across an 8-bit rounding step
    # (README): far less than quantization itself moves the logits.
    assert (ours - theirs).norm() < 0.5 * (ours - original).norm()


def test_a_checkpoint_with_stacked_experts_still_loads(tmp_path, monkeypatch):
    """Checkpoints quantkit wrote before it kept the source layout hold the stacked 3-D tensors."""
    from quantkit import checkpoint

    qmodel = quantkit.quantize(_qwen2_moe(), quantkit.QuantConfig.preset("int8", ignore=("lm_head", "*.experts.*")),
                               progress=False)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "revert_weight_conversion", lambda model, state: state)
        out = quantkit.save(qmodel, tmp_path / "stacked", tokenizer=make_tokenizer())
    loaded = quantkit.load(out, device="cpu", progress=False)
    ids = torch.randint(1, 300, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, qmodel(input_ids=ids).logits)


def _round_trip(model, tmp_path, config="int8"):
    qmodel = quantkit.quantize(model, config, progress=False)
    out = quantkit.save(qmodel, tmp_path / "ckpt", tokenizer=make_tokenizer())
    loaded = quantkit.load(out, device="cpu", progress=False)
    ids = torch.randint(3, 300, (1, 9), generator=torch.Generator().manual_seed(1))
    ours, theirs = qmodel.state_dict(), loaded.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[n].float(), theirs[n].float()) for n in ours)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, qmodel(input_ids=ids).logits)
    return out


def test_more_than_ten_experts_are_stacked_in_their_order(tmp_path, monkeypatch):
    """The checkpoint's headers list experts.10 before experts.2: 16-bit experts are stacked in that
    order, expert 2's weights went to expert 10's place (shapes match, so only the values tell), in
    one shard or many. Quantized ones (Mixtral's w1/w2/w3 under block_sparse_moe) load by name."""
    from quantkit import checkpoint

    config = transformers.MixtralConfig(intermediate_size=64, num_local_experts=12, num_experts_per_tok=2, **COMMON)
    kept = quantkit.QuantConfig.preset("int8", ignore=("lm_head", "*.experts.*"))
    _round_trip(_model(config), tmp_path / "one", kept)
    _round_trip(_model(config), tmp_path / "quantized", "fp8")
    monkeypatch.setattr(checkpoint, "MAX_SHARD_BYTES", 20000)
    out = _round_trip(_model(config), tmp_path / "many", kept)
    assert len(list(out.glob("*.safetensors"))) > 10
    out = _round_trip(_model(config), tmp_path / "many-quantized", "int8")
    assert len(list(out.glob("*.safetensors"))) > 10


def test_a_renaming_that_misses_is_not_applied(tmp_path):
    """DeepSeek-V4's loader renames `.norm.` to `.kv_norm.` (its source checkpoints' spelling of the
    attention norm); the final `model.norm.weight` keeps its name, as from_pretrained keeps it."""
    config = transformers.AutoConfig.for_model(
        "deepseek_v4", vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2, o_groups=2,
        o_lora_rank=32, index_n_heads=2, index_head_dim=32, index_topk=8, max_position_embeddings=256,
        sliding_window=16, num_nextn_predict_layers=0, qk_rope_head_dim=8, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    _round_trip(_model(config), tmp_path)


def test_a_conversion_over_quantized_layers_keeps_the_model_names(tmp_path):
    """HRM splits a stored gate_up_proj into gate_proj and up_proj when it loads: reverting that
    would join int8 codes with a 16-bit half (or drop their scales), so the checkpoint keeps the
    model's names, with a warning, and loads back."""
    config = transformers.HrmTextConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                        head_dim=32, num_hidden_layers=4, num_layers_per_stack=2, H_cycles=1, L_cycles=1,
                                        max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with pytest.warns(UserWarning, match="keeps transformers' module names"):
        _round_trip(_model(config), tmp_path / "partial",
                    quantkit.QuantConfig.preset("int8", ignore=("lm_head", "*.mlp.gate_proj")))


def test_without_transformers_conversion_api_models_keep_their_names(tmp_path, monkeypatch):
    """An older transformers (a GPU image's 5.17) has no conversion API: experts then stay stacked
    in 16 bits, and a checkpoint keeps the model's names and loads back (saving raised NameError)."""
    from quantkit import checkpoint
    from quantkit.models import experts

    monkeypatch.setattr(checkpoint, "get_model_conversion_mapping", None)
    monkeypatch.setattr(experts, "revert_weight_conversion", None)
    qmodel = quantkit.quantize(_qwen2_moe(), "int8", progress=False)
    assert "Qwen2MoeExperts" in qmodel.quantkit_report.other_weights
    out = quantkit.save(qmodel, tmp_path / "ckpt", tokenizer=make_tokenizer())
    loaded = quantkit.load(out, device="cpu", progress=False)
    ids = torch.randint(1, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, qmodel(input_ids=ids).logits)
