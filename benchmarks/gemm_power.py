"""Sustained SM clock and board power while one GEMM op runs back to back, per op and shape.

    python benchmarks/gemm_power.py --out $OUT/power --points 4096:28672:4096 \
        --ops scaled_mm+bias,triton_fp8,gluon_fp8_pp_128x128,gluon_int8_pp_128x128

Question it answers: at large M, is an op's time set by its own instruction stream, or by the
clock the board's power limit leaves it (then the op that moves fewer bytes per FLOP wins)?
Each op is captured as a CUDA graph of CALLS back-to-back calls (warm L2, no flushes: the
steady state of a long prefill) and replayed for --seconds; CUDA events give the time per call,
``nvidia-smi -lms 50`` sampled meanwhile gives SM clock, power and the clock-event reasons, read
over the window minus its first 0.3 s. Rounds rotate the op order. ``--flush``: each call in the
graph is preceded by the standard benchmark's L2 flush (a 256 MB memset), the regime its timings
run in, and a "flush" op times the flushes alone (op time = its row's time minus the flush row's).
Ops come from benchmarks/gemm_gluon.py's ``point_ops`` (the same operands, baselines and Gluon
configs, plain epilogue). Results: gemm_power.json / .txt under --out.
"""

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_gluon as bench  # noqa: E402  (sets up the quantkit package stub, as for gemm_gluon.py)

import torch  # noqa: E402

from quantkit.bench.gemm import _FLUSH_BYTES  # noqa: E402  (the standard timer's flush)

CALLS = 20
QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def start_sampler(path: Path) -> subprocess.Popen:
    handle = path.open("w")
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                            stdout=handle, stderr=subprocess.STDOUT)


def read_samples(path: Path) -> list[tuple[datetime.datetime, float, float, float, str]]:
    samples = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            samples.append((stamp, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except (ValueError, IndexError):
            continue
    return samples


def run_op(fn, seconds: float, flush: torch.Tensor | None = None
           ) -> tuple[float, datetime.datetime, datetime.datetime]:
    """us per call over ``seconds`` of graph replays, and the window's local start / end; with
    ``flush``, each call is preceded by zeroing it (the L2 flush)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            if flush is not None:
                flush.zero_()
            fn()
    graph.replay()
    torch.cuda.synchronize()
    begin_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = datetime.datetime.now()
    begin_event.record()
    replays = 0
    while True:
        graph.replay()
        replays += 1
        if replays % 8 == 0:
            torch.cuda.synchronize()
            if (datetime.datetime.now() - start).total_seconds() >= seconds:
                break
    end_event.record()
    torch.cuda.synchronize()
    stop = datetime.datetime.now()
    us = begin_event.elapsed_time(end_event) * 1e3 / (replays * CALLS)
    del graph
    return us, start, stop


def window_stats(samples, start, stop) -> dict:
    inside = [s for s in samples if start + datetime.timedelta(seconds=0.3) <= s[0] <= stop]
    if not inside:
        return {"samples": 0}
    return {"samples": len(inside), "sm_mhz": statistics.mean(s[1] for s in inside),
            "sm_mhz_min": min(s[1] for s in inside), "power_w": statistics.mean(s[2] for s in inside),
            "temp_c": max(s[3] for s in inside), "reasons": sorted({s[4] for s in inside})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default="4096:28672:4096,16384:6144:4096,1024:4096:4096")
    parser.add_argument("--ops", default="scaled_mm+bias,triton_fp8,gluon_fp8_pp_128x128,gluon_fp8_coop_128x256,"
                                         "gluon_int8_pp_128x128,bf16")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--configs", default="", help="Gluon configs to build (default: all)")
    parser.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE",
                        help="as gemm_gluon.py --variant: Gluon config variants (ops gluon_<dtype>_<name>[FIELD=VALUE])")
    parser.add_argument("--flush", action="store_true",
                        help="an L2 flush before every call (the standard benchmark's regime), and a flush-only op")
    parser.add_argument("--eager-calls", type=int, default=0,
                        help="no timing: call each op this many times, eagerly (a target for ncu)")
    args = parser.parse_args()
    bench.OPTIONS["bias"] = False
    bench.SELECTED[:] = [name for name in args.configs.split(",") if name]
    bench.add_variants(args.variant, gated=False)
    if args.eager_calls:
        for point in args.points.split(","):
            M, N, K = (int(v) for v in point.split(":"))
            ops = bench.point_ops(M, N, K, {"fp8": True, "int8": True})
            for name in (name for name in args.ops.split(",") if name in ops):
                for _ in range(args.eager_calls):
                    ops[name]()
                torch.cuda.synchronize()
                print(f"M={M} N={N} K={K} {name}: {args.eager_calls} calls", flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    smi_path = args.out / "nvidia_smi_samples.csv"
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda") if args.flush else None
    sampler = start_sampler(smi_path)
    time.sleep(0.5)
    rows = []
    try:
        for point in args.points.split(","):
            M, N, K = (int(v) for v in point.split(":"))
            ops = bench.point_ops(M, N, K, {"fp8": True, "int8": True})
            if flush is not None:
                ops["flush"] = lambda: None
            names = [name for name in args.ops.split(",") if name in ops] + (["flush"] if flush is not None else [])
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    us, start, stop = run_op(ops[name], args.seconds, flush)
                    rows.append({"M": M, "N": N, "K": K, "op": name, "round": r, "us": us,
                                 "tflops": 2.0 * M * N * K / us / 1e6, "start": start.isoformat(),
                                 "stop": stop.isoformat()})
                    print(f"M={M} N={N} K={K} {name:28s} {us:9.1f} us", flush=True)
            del ops
            torch.cuda.empty_cache()
    finally:
        time.sleep(0.3)
        sampler.terminate()
        sampler.wait()
    samples = read_samples(smi_path)
    for row in rows:
        row.update(window_stats(samples, datetime.datetime.fromisoformat(row["start"]),
                                datetime.datetime.fromisoformat(row["stop"])))
    meta = {**bench.metadata(), "calls_per_graph": CALLS, "seconds": args.seconds, "smi_samples": len(samples),
            "flush": args.flush}
    (args.out / "gemm_power.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{meta['gpu']} torch {meta['torch']} triton {meta['triton']} commit {meta['commit']} {meta['date']}", "",
             "| M | N x K | op | round | us | TFLOP/s | SM MHz (min) | W | max C | clock-event reasons |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['M']} | {row['N']}x{row['K']} | {row['op']} | {row['round']} | {row['us']:.1f} | "
                     f"{row['tflops']:.0f} | {row.get('sm_mhz', 0):.0f} ({row.get('sm_mhz_min', 0):.0f}) | "
                     f"{row.get('power_w', 0):.0f} | {row.get('temp_c', 0):.0f} | {' '.join(row.get('reasons', []))} |")
    (args.out / "gemm_power.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
