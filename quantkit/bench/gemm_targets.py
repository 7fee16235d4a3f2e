"""The GEMM issue's targets, read from the rows the GEMM and quantization benchmarks write.

One line per target: how many points it covers, how many meet it, the lowest and highest ratio,
and the points that miss. ``benchmarks/gemm.py`` prints and writes it (``gemm_targets.json``)
after a run; ``benchmarks/gemm_targets.py`` reads it from result files, e.g. a standard run
taken in parts (``--m``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def _gemm(op: str, metric: str, rows_of):
    def select(gemm_rows, quant_rows):
        return [(r, r[metric]) for r in gemm_rows if r["op"] == op and rows_of(r)]
    return select


def _quant(prefix: str):
    def select(gemm_rows, quant_rows):
        return [(r, r["fraction_of_same_size_copy"]) for r in quant_rows if r["op"].startswith(prefix)]
    return select


def _large(epilogue):
    return lambda r: r["M"] >= 1024 and r["epilogue"] == epilogue


def _small(r):
    return r["M"] <= 16


# (target, threshold, strictly above, rows and the ratio each gives). A threshold of None: reported, no target.
TARGETS = [
    ("FP8 vs _scaled_mm (fast accumulation) + epilogue, M >= 1024, plain", 1.0, False,
     _gemm("quantkit_fp8", "speedup_vs_baseline", _large("plain"))),
    ("FP8 vs _scaled_mm (fast accumulation) + epilogue, M >= 1024, bias + SiLU", 1.0, False,
     _gemm("quantkit_fp8", "speedup_vs_baseline", _large("bias_silu"))),
    ("INT8 vs _int_mm + epilogue, M >= 1024, plain", 1.25, False,
     _gemm("quantkit_int8", "speedup_vs_baseline", _large("plain"))),
    ("INT8 vs _int_mm + epilogue, M >= 1024, bias + SiLU", 1.25, False,
     _gemm("quantkit_int8", "speedup_vs_baseline", _large("bias_silu"))),
    ("FP8 vs bf16 F.linear, M >= 1024, both epilogues", 1.5, False,
     _gemm("quantkit_fp8", "speedup_vs_bf16", lambda r: r["M"] >= 1024)),
    ("INT8 vs bf16 F.linear, M >= 1024, both epilogues", 1.5, False,
     _gemm("quantkit_int8", "speedup_vs_bf16", lambda r: r["M"] >= 1024)),
    ("FP8 vs bf16 F.linear, M <= 16, both epilogues", 1.5, False, _gemm("quantkit_fp8", "speedup_vs_bf16", _small)),
    ("INT8 vs bf16 F.linear, M <= 16, both epilogues", 1.5, False, _gemm("quantkit_int8", "speedup_vs_bf16", _small)),
    ("fused gate+up FP8 vs two GEMMs + act*mul", 1.0, True,
     _gemm("quantkit_gated_fp8", "speedup_vs_baseline", lambda r: True)),
    ("fused gate+up INT8 vs two GEMMs + act*mul", 1.0, True,
     _gemm("quantkit_gated_int8", "speedup_vs_baseline", lambda r: True)),
    ("per-token quantization vs a same-size copy", 0.75, False, _quant("quantize_per_token")),
    ("RMSNorm + quantization vs a same-size copy", 0.75, False, _quant("rms_norm_quant")),
    ("residual add + RMSNorm + quantization vs a same-size copy", 0.75, False, _quant("add_rms_norm_quant")),
    ("static per-tensor quantization vs a same-size copy (no target)", None, False, _quant("quantize_per_tensor")),
]


def _point(row) -> str:
    where = f"{row['M']}x{row['N']}x{row['K']}" if "N" in row else f"{row['M']}x{row['K']}"
    return f"{row['op']} {where}" + (f" {row['epilogue']}" if "epilogue" in row else "")


def summarize_targets(gemm_rows: list[dict], quant_rows: list[dict]) -> list[dict]:
    """One dict per target with points: target, threshold, strict (above, not at), points, met,
    lowest, highest, misses."""
    out = []
    for target, threshold, strict, select in TARGETS:
        found = [(row, value) for row, value in select(gemm_rows, quant_rows) if not math.isnan(value)]
        if not found:
            continue
        values = [value for _, value in found]
        if threshold is None:
            misses = []
        else:
            misses = [(row, value) for row, value in found if (value <= threshold if strict else value < threshold)]
        out.append({"target": target, "threshold": threshold, "strict": strict, "points": len(found),
                    "met": len(found) - len(misses),
                    "lowest": min(values), "highest": max(values),
                    "misses": [{"point": _point(row), "value": value} for row, value in misses]})
    return out


def targets_markdown(summary: list[dict]) -> str:
    """The summary as a markdown table (ratios to 3 decimals; copy fractions in %)."""
    lines = ["| target | needs | met | range | misses |", "|---|---|---|---|---|"]
    for t in summary:
        percent = "copy" in t["target"]
        fmt = (lambda v: f"{100 * v:.1f} %") if percent else (lambda v: f"{v:.3f}x")
        bar = "–" if t["threshold"] is None else (">" if t["strict"] else "≥") + " " + fmt(t["threshold"])
        misses = ", ".join(f"{m['point']} {fmt(m['value'])}" for m in t["misses"]) or "–"
        lines.append(f"| {t['target']} | {bar} | {t['met']} of {t['points']} | "
                     f"{fmt(t['lowest'])} – {fmt(t['highest'])} | {misses} |")
    return "\n".join(lines)


def write_targets(out_dir, gemm_rows: list[dict], quant_rows: list[dict]) -> list[dict]:
    """A run's targets: ``gemm_targets.json`` under ``out_dir``, the table on stdout. Returns the summary."""
    summary = summarize_targets(gemm_rows, quant_rows)
    Path(out_dir, "gemm_targets.json").write_text(json.dumps(summary, indent=1))
    print(targets_markdown(summary), flush=True)
    return summary
