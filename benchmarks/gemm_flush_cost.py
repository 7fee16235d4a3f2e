"""What the standard GEMM timer charges an op for: its kernel, and the L2 flush that follows it.

    PYTHONUNBUFFERED=1 python benchmarks/gemm_flush_cost.py --out $OUT/flush \
        --points 16384:6144:4096,4096:28672:4096 --configs coop2_128x256_g16_lean_t3_pl1_bal

The standard timer (quantkit.bench.gemm.bench_graph_ms) replays a graph of n x (256 MB memset, op)
and subtracts a graph of the n memsets alone. A memset that follows a GEMM may take longer than one
that follows a memset: the GEMM leaves its last output lines dirty in the L2, and the memset's writes
evict them to memory. That time is charged to the op. This times, per op, eagerly and in one stream,
``CALLS`` x (op, memset) with a CUDA event before and after each, so each kernel's own span is known:
the op's, and the memset's after that op, against a memset after a memset ("none"). Rounds rotate
the op order; the ops are benchmarks/gemm_gluon.py's ``point_ops`` (FP8, plain epilogue). Also
the standard timer's number for each op in the same run. Results: gemm_flush_cost.json / .txt.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_gluon as bench  # noqa: E402  (sets up the quantkit package stub, as for gemm_gluon.py)

import torch  # noqa: E402

from quantkit.bench.gemm import _FLUSH_BYTES, adaptive_graph_ms, rotated_medians  # noqa: E402

CALLS = 20


def spans(op, flush: torch.Tensor) -> tuple[float, float]:
    """Median µs of the op's kernel(s) and of the memset right after it, over CALLS eager pairs."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(3 * CALLS)]
    torch.cuda.synchronize()
    for i in range(CALLS):
        events[3 * i].record()
        if op is not None:
            op()
        events[3 * i + 1].record()
        flush.zero_()
        events[3 * i + 2].record()
    torch.cuda.synchronize()
    op_us = [events[3 * i].elapsed_time(events[3 * i + 1]) * 1e3 for i in range(CALLS)]
    flush_us = [events[3 * i + 1].elapsed_time(events[3 * i + 2]) * 1e3 for i in range(CALLS)]
    return statistics.median(op_us), statistics.median(flush_us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default="16384:6144:4096,4096:28672:4096")
    parser.add_argument("--configs", default="coop2_128x256_g16_lean_t3_pl1_bal")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    bench.OPTIONS["bias"] = False
    bench.SELECTED[:] = [name for name in args.configs.split(",") if name]
    args.out.mkdir(parents=True, exist_ok=True)
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    rows = []
    for point in args.points.split(","):
        M, N, K = (int(v) for v in point.split(":"))
        all_ops = bench.point_ops(M, N, K, {"fp8": True})
        ops = {"none": None, "scaled_mm": all_ops["scaled_mm+bias"]}
        ops.update({name: all_ops[f"gluon_fp8_{name}"] for name in bench.SELECTED})
        for op in ops.values():
            if op is not None:
                op()  # compile outside the timing
        # Each sample is an (op, memset after it) pair of spans: only the per-round samples are used.
        _, samples = rotated_medians(ops, lambda op: spans(op, flush), args.rounds)
        for name, values in samples.items():
            row = {"M": M, "N": N, "K": K, "op": name,
                   "op_us": statistics.median(v[0] for v in values),
                   "flush_after_us": statistics.median(v[1] for v in values),
                   "rounds": [list(v) for v in values]}
            row["standard_timer_us"] = None if ops[name] is None else adaptive_graph_ms(ops[name]) * 1e3
            rows.append(row)
            print(f"M={M} N={N} K={K} {name:40s} op {row['op_us']:8.1f} us  memset after it "
                  f"{row['flush_after_us']:7.1f} us  standard timer {row['standard_timer_us'] or 0:8.1f} us", flush=True)
        del all_ops, ops
        torch.cuda.empty_cache()
    meta = {**bench.metadata(), "calls": CALLS, "flush_bytes": _FLUSH_BYTES}
    (args.out / "gemm_flush_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{meta['gpu']} torch {meta['torch']} triton {meta['triton']} commit {meta['commit']} {meta['date']}", "",
             "| M | N x K | op | op µs | memset after it µs | standard timer µs |", "|---|---|---|---|---|---|"]
    for row in rows:
        std = "-" if row["standard_timer_us"] is None else f"{row['standard_timer_us']:.1f}"
        lines.append(f"| {row['M']} | {row['N']}x{row['K']} | {row['op']} | {row['op_us']:.1f} | "
                     f"{row['flush_after_us']:.1f} | {std} |")
    (args.out / "gemm_flush_cost.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
