"""How often the tiled kernel's autotuner picks a slower config at decode and medium batch sizes,
and whether a paired timer fixes it (issue 3, session 39).

The split-K round of session 39 (results/gemm_splitk_s39a_h200.*) found the tuner's pick 7-12 %
slower than another candidate of its own pool at two points (FP8 6144x4096 M = 32: the 2-way split
swapped tile over the unsplit one; INT8 4096x4096 M = 16), by both of the benchmark's timers. The
tuner times each candidate once with ``gemm_tma._graph_bench_ms``: a graph of 10 x (256 MB L2
flush, op) minus a graph of the flushes alone, each the median of 5 replays, the two graphs timed
one after the other. For a 10 us op the flushes are ~85 % of the graph, so a 1 % drift of the
flush time between the two is a 6 % error in the op.

Per point, in one process:
- reference: every candidate of the pool timed by the standard benchmark's timer
  (``bench.gemm.adaptive_graph_ms``), ROUNDS rounds in rotating order, medians;
- for each tuner timer (``current``: ``_graph_bench_ms``; ``paired``: ``paired_graph_ms``, the
  same two graphs replayed alternately, the median of per-pair differences): TUNINGS tunings, each
  timing every candidate once in pool order (what triton's autotuner does); per tuning the pick
  and its reference time against the reference-fastest (regret); the timer's own cost.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/tune_noise.py --out $OUT/tune
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench import gemm_splitk  # noqa: E402
from quantkit.bench.gemm import adaptive_graph_ms  # noqa: E402
from quantkit.kernels import gemm, gemm_configs, gemm_tma, reference  # noqa: E402
from quantkit.kernels.launch import config_dict  # noqa: E402

# benchmarks/gemm.py, for its precompile pool (a spawned worker imports it by this name).
import gemm as gemm_script  # noqa: E402

DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# (M, N, K, dtype): the two mispicks of run s39a first, then decode and medium points around them.
POINTS = [(32, 6144, 4096, "fp8"), (16, 4096, 4096, "int8"), (16, 6144, 4096, "int8"), (16, 4096, 14336, "fp8"),
          (1, 4096, 4096, "fp8"), (64, 4096, 4096, "int8"), (32, 4096, 14336, "int8"), (128, 6144, 4096, "fp8")]
ROUNDS = 5
TUNINGS = 7


def paired_graph_ms(fn, reps: int = 10, pairs: int = 15) -> float:
    """GPU ms of one ``fn()``: the graphs of ``_graph_bench_ms`` (reps x (flush, fn) and reps x
    flush), replayed as ``pairs`` back-to-back pairs in alternating order; the median of the
    per-pair differences / reps. A drift of the flush time cancels within a pair."""
    graphs, _flush = gemm_tma.flush_graphs(fn, reps)
    for graph in graphs.values():
        graph.replay()
    diffs = []
    for i in range(pairs):
        order = ("flush", "both") if i % 2 == 0 else ("both", "flush")
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        graphs[order[0]].replay()
        events[1].record()
        graphs[order[1]].replay()
        events[2].record()
        events[2].synchronize()
        t = {order[0]: events[0].elapsed_time(events[1]), order[1]: events[1].elapsed_time(events[2])}
        diffs.append(t["both"] - t["flush"])
    return max(statistics.median(diffs), 1e-6) / reps


TIMERS = {"current": gemm_tma._graph_bench_ms, "paired": paired_graph_ms}


def run_point(M, N, K, dtype_name):
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(M + N + K)
    a, sa = reference.quantize_per_token(torch.randn(M, K, device="cuda", generator=gen), dtype)
    w, sw = reference.quantize_per_channel(torch.randn(N, K, device="cuda", generator=gen) * K**-0.5, dtype)
    out = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    pool = [config_dict(c) for c in gemm_configs._prune_configs(gemm.ALL_CONFIGS, {"M": M})]
    names = [gemm_splitk.config_name(c) for c in pool]
    ops = {name: (lambda cfg=cfg: gemm.scaled_mm(a, w, sa, sw, None, "none", torch.bfloat16, config=cfg, out=out,
                                                  kernel="tiled"))
           for name, cfg in zip(names, pool)}
    ref = reference.scaled_mm(a, w, sa, sw, None, "none", torch.float32)
    for name, op in ops.items():  # compile + check before timing
        got = op().float()
        err = ((got - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            raise RuntimeError(f"{name} at M={M} {N}x{K} {dtype_name}: rel. error {err:.2e}")
    samples = {name: [] for name in names}
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(adaptive_graph_ms(ops[name]))
    bench = {name: statistics.median(s) for name, s in samples.items()}
    best = min(bench, key=bench.get)
    result = {"M": M, "N": N, "K": K, "dtype": dtype_name, "pool": names,
              "bench_us": {n: round(v * 1e3, 2) for n, v in bench.items()}, "bench_best": best, "timers": {}}
    for timer_name, timer in TIMERS.items():
        picks, tuned, t0 = [], {name: [] for name in names}, time.time()
        for _ in range(TUNINGS):
            times = {name: timer(ops[name]) for name in names}
            for name, v in times.items():
                tuned[name].append(v * 1e3)
            picks.append(min(times, key=times.get))
        cost = (time.time() - t0) / TUNINGS
        regrets = [bench[p] / bench[best] for p in picks]
        spread = {n: round((max(v) - min(v)) / statistics.median(v), 3) for n, v in tuned.items()}
        result["timers"][timer_name] = {
            "picks": picks, "regret": [round(x, 3) for x in regrets], "mean_regret": round(statistics.mean(regrets), 4),
            "max_regret": round(max(regrets), 3), "s_per_tuning": round(cost, 3),
            "median_us": {n: round(statistics.median(v), 2) for n, v in tuned.items()},
            "spread_rel": spread, "median_spread_rel": round(statistics.median(spread.values()), 3)}
        print(f"M={M:3d} {N:5d}x{K:5d} {dtype_name:4s} {timer_name:8s} best {best} {bench[best] * 1e3:.2f}us | "
              f"regret mean {statistics.mean(regrets):.3f} max {max(regrets):.3f} | spread (max-min)/med "
              f"{statistics.median(spread.values()):.3f} | {cost:.2f}s/tuning | picks {sorted(set(picks))}", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    calls = [(M, N, K, d, False, "none", False) for M, N, K, d in POINTS]
    _, jobs = gemm_script.compile_jobs(calls, torch.cuda.get_device_properties(0).multi_processor_count)
    gemm_script.precompile(jobs, 14, timeout=300)
    meta = environment_metadata()
    meta.update(rounds=ROUNDS, tunings=TUNINGS)
    results = []
    for point in POINTS:
        results.append(run_point(*point))
        (out / "tune_noise.json").write_text(json.dumps({"meta": meta, "points": results}, indent=1))


if __name__ == "__main__":
    main()
