"""The end-to-end benchmark's plumbing on CPU: one variant measured in a fresh process."""

import gc
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
    assert all(r["gc_frozen_objects"] > 0 for r in rows)
    e2e._add_ratios(rows)  # no hf-bf16 row: nothing to divide by, and no crash


def test_timed_runs_see_a_frozen_heap_every_variant_alike(monkeypatch):
    """gc.collect(); gc.freeze() after the warm-up, before the timed runs, for HF's model too; undone after."""
    frozen_at_prefill = []
    real_prefill = e2e.bench_prefill
    # Objects frozen before the test (an interpreter or a plugin may freeze some: 375 on the GPU
    # machine's Python 3.12) stay frozen through the warm-up; the variant's freeze adds to them.
    already = gc.get_freeze_count()

    def spy(*args, **kwargs):
        frozen_at_prefill.append(gc.get_freeze_count())
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(e2e, "bench_prefill", spy)
    rows = e2e.measure_variant("hf-bf16", _tiny_config(), "cpu", prefill_shapes=((1, 8),), decode_batches=(1,),
                               prompt_len=4, new_tokens=3)
    assert frozen_at_prefill[0] == already and frozen_at_prefill[-1] > already  # warm-up, then the timed run
    # The row records the count at the freeze; frozen objects that die later leave the permanent
    # generation (nothing joins it without another freeze), so the timed run sees at most that.
    assert rows[0]["gc_frozen_objects"] >= frozen_at_prefill[-1]
    assert gc.get_freeze_count() == 0


def test_failed_child_gives_an_error_row():
    rows = e2e.measure_variant_isolated("fp4-plain", _tiny_config(), "cpu", prefill_shapes=((1, 8),),
                                        decode_batches=(1,), prompt_len=4, new_tokens=3, timeout_s=300)
    assert rows == [{"variant": "fp4-plain", "workload": "all", "error": rows[0]["error"]}]
    assert "exited with" in rows[0]["error"]


def test_norm_quant_comparison_variants_and_ratios():
    assert e2e.variant_names(("fp8",), compare_norm_quant=True) == [
        "hf-bf16", "fp8-plain", "fp8-fast-exact", "fp8-fast", "fp8-fast-no-norm-quant"]
    assert e2e.prepare_variant("int8-fast-no-norm-quant", _tiny_config(), "cpu").quantkit_fast_path.deferred_norms == []
    # Two per layer; the final norm, outside the layers, makes the model's output and never defers.
    assert len(e2e.prepare_variant("int8-fast", _tiny_config(), "cpu").quantkit_fast_path.deferred_norms) == 2
    rows = [{"variant": "int8-fast", "workload": "prefill_1x8", "tokens_per_s": 12.0, "graph_tokens_per_s": 13.0,
             "workload_peak_bytes": 60, "peak_bytes": 60},
            {"variant": "int8-fast-no-norm-quant", "workload": "prefill_1x8", "tokens_per_s": 10.0,
             "graph_tokens_per_s": 12.0, "workload_peak_bytes": 64, "peak_bytes": 64},
            {"variant": "int8-fast", "workload": "decode_b1", "ms_per_token": 4.0, "workload_peak_bytes": 60,
             "peak_bytes": 60},
            {"variant": "int8-fast-no-norm-quant", "workload": "decode_b1", "ms_per_token": 5.0,
             "workload_peak_bytes": 60, "peak_bytes": 64}]
    e2e._add_ratios(rows)
    assert rows[0]["norm_quant_speedup"] == 1.2 and rows[0]["norm_quant_graph_speedup"] == 13.0 / 12.0
    assert rows[0]["norm_quant_peak_ratio"] == 60 / 64 and rows[2]["norm_quant_speedup"] == 1.25
    assert "norm_quant_speedup" not in rows[1]


def test_residual_comparison_variant_and_ratio():
    fast = e2e.prepare_variant("int8-fast-no-residual", _tiny_config(), "cpu").quantkit_fast_path
    assert fast.fused_residual_layers == [] and fast.deferred_norms
    rows = [{"variant": "fp8-fast", "workload": "decode_b1", "ms_per_token": 4.0, "workload_peak_bytes": 60,
             "peak_bytes": 60},
            {"variant": "fp8-fast-no-residual", "workload": "decode_b1", "ms_per_token": 4.4,
             "workload_peak_bytes": 60, "peak_bytes": 60}]
    e2e._add_ratios(rows)
    assert rows[0]["residual_speedup"] == 4.4 / 4.0 and rows[0]["residual_peak_ratio"] == 1.0
    assert "residual_speedup" not in rows[1] and "norm_quant_speedup" not in rows[0]


def test_ratios_to_hf_bf16_and_the_targets_they_meet():
    """speedup_vs_bf16 is ours over the baseline's throughput (prefill) and the baseline's time
    over ours (decode): above 1 when quantkit is faster, and the target lines read it so."""
    rows = [{"variant": "hf-bf16", "workload": "prefill_1x8", "tokens_per_s": 100.0, "graph_tokens_per_s": 120.0,
             "peak_bytes": 200, "model_bytes": 160},
            {"variant": "fp8-fast", "workload": "prefill_1x8", "tokens_per_s": 180.0, "graph_tokens_per_s": 240.0,
             "peak_bytes": 110, "model_bytes": 88},
            {"variant": "hf-bf16", "workload": "decode_b1", "ms_per_token": 9.0, "peak_bytes": 200, "model_bytes": 160},
            {"variant": "fp8-fast", "workload": "decode_b1", "ms_per_token": 5.0, "peak_bytes": 100, "model_bytes": 88}]
    e2e._add_ratios(rows)
    prefill, decode = rows[1], rows[3]
    assert prefill["speedup_vs_bf16"] == 1.8 and decode["speedup_vs_bf16"] == 9.0 / 5.0
    assert prefill["graph_speedup_vs_bf16_graph"] == 2.0 and prefill["graph_speedup_vs_bf16_eager"] == 2.4
    assert prefill["memory_ratio_vs_bf16"] == 0.55 and decode["model_bytes_ratio_vs_bf16"] == 0.55
    lines = {line["target"]: line for line in e2e.summarize_targets(rows)}
    eager = lines["prefill_1x8 fp8-fast >= 1.7x hf-bf16 (both eager)"]
    assert eager["value"] == 1.8 and eager["met"]
    assert lines["decode_b1 fp8-fast <= 6.0 ms/token"]["met"]


def test_fast_path_check_verdicts():
    """exact mode must equal the plain path; exact=False (the timed mode) must be as close to the
    unquantized model as the plain path, within 10 %; graph decode must equal eager decode."""
    good = {"exact_logits_equal": True, "exact_tokens_equal": True, "quantization_rel_err": 0.040,
            "fast_quantization_rel_err": 0.043, "exact_graph_equals_eager": True, "fast_graph_equals_eager": True}
    assert e2e._fast_path_passed(good)
    assert not e2e._fast_path_passed({**good, "fast_quantization_rel_err": 0.045})
    assert not e2e._fast_path_passed({**good, "exact_tokens_equal": False})
    assert not e2e._fast_path_passed({**good, "fast_graph_equals_eager": False})


def test_failed_fast_path_checks_stop_the_run_before_any_timing(monkeypatch, tmp_path):
    from quantkit.bench.common import CheckFailed

    monkeypatch.setattr(e2e, "run_fast_path_checks", lambda *args, **kwargs: [
        {"arch": "llama", "scheme": "fp8", "passed": False}])
    monkeypatch.setattr(e2e, "measure_variant", lambda *args, **kwargs: pytest.fail("timed after a failed check"))
    with pytest.raises(CheckFailed, match="fast-path checks failed for llama fp8"):
        e2e.run_e2e_benchmark(tmp_path, plot=False, device="cpu", config=_tiny_config(), isolate=False)
    assert (tmp_path / "e2e_checks_failed.json").is_file() and not (tmp_path / "e2e.json").exists()
