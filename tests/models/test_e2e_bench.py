"""The end-to-end benchmark's plumbing on CPU: one variant measured in a fresh process."""

import sys

import pytest

from quantkit.bench import e2e


def _tiny_config():
    return e2e.llama3_8b_config(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=64, vocab_size=128, max_position_embeddings=64,
                                bos_token_id=1, eos_token_id=2)


def test_variant_names_and_bad_variant(monkeypatch):
    monkeypatch.setattr(e2e.importlib.util, "find_spec", lambda name: None)  # as if torchao were absent
    assert e2e.variant_names(("fp8",)) == ["hf-bf16", "fp8-plain", "fp8-fast-exact", "fp8-fast"]
    assert e2e.variant_names(("int8",), fast_inexact=False) == ["hf-bf16", "int8-plain", "int8-fast-exact"]
    with pytest.raises(ValueError, match="fp4-plain"):
        e2e.prepare_variant("fp4-plain", _tiny_config(), "cpu")


def test_torchao_variants_listed_when_installed_and_clear_error_when_not(monkeypatch):
    monkeypatch.setattr(e2e.importlib.util, "find_spec", lambda name: object() if name == "torchao" else None)
    assert e2e.variant_names(("fp8", "int8"), fast_inexact=False)[-2:] == ["torchao-fp8", "torchao-int8"]
    with pytest.raises(ValueError, match="torchao-fp4"):
        e2e.prepare_variant("torchao-fp4", _tiny_config(), "cpu")
    monkeypatch.setitem(sys.modules, "torchao", None)  # importing it now fails, as when not installed
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(ValueError, match="pip install torchao"):
        e2e.prepare_variant("torchao-int8", _tiny_config(), "cpu")


def test_isolated_variant_returns_its_rows():
    rows = e2e.measure_variant_isolated("int8-fast", _tiny_config(), "cpu", prefill_shapes=((1, 8),),
                                        decode_batches=(1,), prompt_len=4, new_tokens=3, timeout_s=300)
    assert [r["workload"] for r in rows] == ["prefill_1x8", "decode_b1"]
    assert all(r["variant"] == "int8-fast" and "error" not in r for r in rows)
    assert rows[0]["tokens_per_s"] > 0 and rows[1]["ms_per_token"] > 0
    e2e._add_ratios(rows)  # no hf-bf16 row: nothing to divide by, and no crash


def test_failed_child_gives_an_error_row():
    rows = e2e.measure_variant_isolated("fp4-plain", _tiny_config(), "cpu", prefill_shapes=((1, 8),),
                                        decode_batches=(1,), prompt_len=4, new_tokens=3, timeout_s=300)
    assert rows == [{"variant": "fp4-plain", "workload": "all", "error": rows[0]["error"]}]
    assert "exited with" in rows[0]["error"]
