import pytest

from quantkit.bench.gemm_targets import summarize_targets, targets_markdown


def _gemm_row(op, M, epilogue, vs_base, vs_bf16, N=4096, K=4096):
    return {"op": op, "M": M, "N": N, "K": K, "epilogue": epilogue, "speedup_vs_baseline": vs_base,
            "speedup_vs_bf16": vs_bf16}


def test_targets_count_misses_at_their_thresholds():
    gemm_rows = [
        _gemm_row("quantkit_fp8", 1024, "plain", 1.0, 1.9),  # exactly at 1.0: met
        _gemm_row("quantkit_fp8", 4096, "plain", 0.987, 1.49, N=6144),  # misses both
        _gemm_row("quantkit_fp8", 512, "plain", 0.5, 1.0),  # M = 512: no target covers it
        _gemm_row("quantkit_int8", 16384, "bias_silu", 1.25, 2.2),
        _gemm_row("quantkit_int8", 16, "plain", float("nan"), 1.7),  # nan: int8 has no baseline at M = 16
        _gemm_row("quantkit_gated_fp8", 64, "gated_silu", 1.0, 2.0),  # "beats": 1.0 is a miss
        _gemm_row("bf16_F.linear", 1024, "plain", 1.0, 1.0),
    ]
    quant_rows = [{"op": "rms_norm_quant_fp8", "M": 4096, "K": 4096, "fraction_of_same_size_copy": 0.74},
                  {"op": "add_rms_norm_quant_int8", "M": 4096, "K": 4096, "fraction_of_same_size_copy": 0.9},
                  {"op": "quantize_per_tensor_int8", "M": 4096, "K": 4096, "fraction_of_same_size_copy": 0.5}]
    by_target = {t["target"]: t for t in summarize_targets(gemm_rows, quant_rows)}
    fp8 = by_target["FP8 vs _scaled_mm (fast accumulation) + epilogue, M >= 1024, plain"]
    assert (fp8["points"], fp8["met"], fp8["lowest"], fp8["highest"]) == (2, 1, 0.987, 1.0)
    assert fp8["misses"] == [{"point": "quantkit_fp8 4096x6144x4096 plain", "value": 0.987}]
    assert by_target["FP8 vs bf16 F.linear, M >= 1024, both epilogues"]["met"] == 1
    assert by_target["INT8 vs _int_mm + epilogue, M >= 1024, bias + SiLU"]["met"] == 1
    assert by_target["INT8 vs bf16 F.linear, M <= 16, both epilogues"]["points"] == 1
    assert by_target["fused gate+up FP8 vs two GEMMs + act*mul"]["met"] == 0
    # RMSNorm + quant and its residual form are separate targets (one is not a prefix match of the other).
    assert by_target["RMSNorm + quantization vs a same-size copy"]["points"] == 1
    assert by_target["RMSNorm + quantization vs a same-size copy"]["met"] == 0
    assert by_target["residual add + RMSNorm + quantization vs a same-size copy"]["met"] == 1
    assert by_target["static per-tensor quantization vs a same-size copy (no target)"]["misses"] == []
    # Targets with no rows are left out (no INT8 plain row at M >= 1024 here).
    assert "INT8 vs _int_mm + epilogue, M >= 1024, plain" not in by_target
    table = targets_markdown(list(by_target.values()))
    assert "| 1 of 2 | 0.987x – 1.000x | quantkit_fp8 4096x6144x4096 plain 0.987x |" in table
    assert "rms_norm_quant_fp8 4096x4096 74.0 %" in table and "| > 1.000x | 0 of 1 |" in table


@pytest.mark.parametrize("value", [1.0001, 1.5])
def test_gated_above_one_is_met(value):
    rows = [_gemm_row("quantkit_gated_int8", 1, "gated_silu", value, 2.0)]
    (summary,) = summarize_targets(rows, [])
    assert summary["met"] == 1


def test_write_targets_writes_the_summary_and_prints_the_table(tmp_path, capsys):
    import json

    from quantkit.bench.gemm_targets import write_targets

    rows = [_gemm_row("quantkit_gated_fp8", 1, "gated_silu", 1.2, 2.0)]
    summary = write_targets(tmp_path, rows, [])
    assert json.loads((tmp_path / "gemm_targets.json").read_text()) == summary
    assert summary[0]["met"] == 1 and "| > 1.000x | 1 of 1 |" in capsys.readouterr().out
