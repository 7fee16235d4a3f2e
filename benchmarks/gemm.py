"""Check the GEMM and quantization kernels on the GPU, then benchmark them.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm.py --out $OUT/gemmstd --deadline 545
    python benchmarks/gemm.py --estimate                  # counts and a runtime estimate, no GPU needed
    TRITON_INTERPRET=1 python benchmarks/gemm.py --out /tmp/g --smoke   # CPU dry run, tiny shapes
    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm.py --split-k --out $OUT/splitk --deadline 540

``--split-k`` runs only the split-K round (quantkit/bench/gemm_splitk.py): the GPU checks of every
split config, then M = 1, 16, 32 and 64 at the Llama-3-8B shapes and the gated MLP, the split
configs the pool admits at each M vs the autotuned pick with and without them vs bf16 F.linear,
and the verdict on
``gemm_configs.SMALL_M_SPLIT_K`` (gemm_splitk.json/.csv); with ``--smoke`` a CPU dry run of it.

Each point's ops (quantkit FP8 / INT8, bf16 F.linear, the torch baselines) are timed in --rounds
rounds whose order rotates by one op per round, medians reported: a GEMM timed right after a
heavy one inherits its clock and power state (H100, 700 W cap: every large FP8 GEMM runs
power-capped, results/gemm_power_s9_h100.txt), so no op keeps one position.

Writes gemm.csv/json/png (GEMMs, gated MLP) and gemm_quant.csv/json (quantization kernels) and
gemm_checks.json under --out, then the issue's targets read from this run's rows (gemm_targets.json
and a table on stdout; ``benchmarks/gemm_targets.py`` reads them from several runs' files). Same
code as ``quantkit bench gemm`` (which runs it serially).

A full run compiles ~200 kernel variants (every autotune config of every tuning key: tiled and
persistent GEMM configs x dtypes x epilogues, the gated kernels, the quantization kernels and
the correctness checks' own variants); compiled one after another that alone took most of the
run. So first a pool of worker processes compiles them into triton's on-disk cache (each job
runs the variant once on a small shape with the same specialization) while one worker runs the
GPU correctness checks (every benchmarked output is also checked against the reference at its
point); the timing process then loads binaries. ``--deadline`` (seconds from start) skips the
points that no longer fit (listed in the JSON meta) and still writes everything timed.
Imports the kernels without running quantkit/__init__.py (the GPU image lacks its pipeline
dependencies).
"""

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402

from quantkit.bench import gemm as bench_gemm  # noqa: E402
from quantkit.bench.gemm import (  # noqa: E402
    CHECK_PARTS, DEFAULT_MS, EPILOGUES, LLAMA3_8B_SHAPES, PROMOTED_PARTS, SPLIT_K_PARTS, adaptive_graph_ms,
    bench_ms, point_seconds, run_gemm_benchmark, run_gpu_checks, timed_ops)
from quantkit.bench import gemm_splitk  # noqa: E402
from quantkit.bench.gemm_targets import write_targets  # noqa: E402
from quantkit.kernels import gemm, gemm_tma, reference  # noqa: E402
from quantkit.kernels.launch import config_dict  # noqa: E402

T0 = time.monotonic()
QUICK_MS = [1, 16, 128, 1024, 4096]
GATED_N, GATED_K = 14336, 4096
QUANT_SHAPES = [(4096, 4096), (16384, 4096), (4096, 14336), (16384, 14336)]
DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


# ---------------------------------------------------------------------------------------------- the run's GEMM calls


def gemm_calls(shapes, ms, epilogues, gated):
    """Every distinct (M, N, K, dtype, bias, activation, gated) quantkit GEMM call of the run."""
    calls = []
    for dtype_name in DTYPES:
        for N, K in shapes:
            for M in ms:
                for epilogue in epilogues:
                    has_bias, activation = EPILOGUES[epilogue]
                    calls.append((M, N, K, dtype_name, has_bias, activation, False))
        if gated:
            for M in ms:
                calls.append((M, GATED_N, GATED_K, dtype_name, False, "silu", True))  # fused [gate; up]
                calls.append((M, GATED_N, GATED_K, dtype_name, False, "silu", False))  # two GEMMs: gate
                calls.append((M, GATED_N, GATED_K, dtype_name, False, "none", False))  # two GEMMs: up
    return calls


def _family(M, dtype_name, gated):
    # The Triton kernel kernel="auto" (gemm._pick_kernel) takes where the Gluon kernel does not run
    # (gemm.persistent_sized). On an sm_90 GPU with triton 3.6 or 3.9 the Gluon kernel takes the
    # sizes gemm.gluon_sized names, and the contested sizes (gemm.contested) it wins, and compiles
    # in the timing process (gemm_gluon.tuned_call); the Triton jobs of those calls are then
    # compiled unused (a contest times the tiled kernel too).
    return "persistent" if gemm.persistent_sized(M, dtype_name == "int8", gated) else "tiled"


def _configs(family, M, dtype_name, gated, N=None):
    if family == "tiled":
        return gemm._prune_configs(gemm.ALL_CONFIGS, {"M": M, "N": N, "GATED": gated})
    if gated:
        return list(gemm_tma.GATED_CONFIGS)
    return gemm_tma._prune_by_dtype(gemm_tma.PERSISTENT_CONFIGS, {}, IS_INT8=dtype_name == "int8")


def compile_jobs(calls, sms, extra_tiled=None):
    """(tuning keys, unique compile jobs) for the calls: each tuning key autotunes every config of
    its pool (plus, for tiled calls, the config dicts ``extra_tiled(M, gated)`` returns, e.g. the
    split configs the split-K round times explicitly), and each (config, flags, dtype,
    specialization) compiles once."""
    keys, jobs, seen = set(), [], set()
    for M, N, K, dtype_name, has_bias, activation, gated in calls:
        family = _family(M, dtype_name, gated)
        keys.add((family, N, K, gemm.m_bucket(M), dtype_name, has_bias, activation, gated))
        extra = extra_tiled(M, gated) if extra_tiled is not None and family == "tiled" else []
        for cfg in [config_dict(c) for c in _configs(family, M, dtype_name, gated, N)] + extra:
            if family == "tiled":
                spec = ("even_k", K % cfg["BLOCK_K"] == 0, "split", gemm.split_k_plan(K, cfg["BLOCK_K"],
                                                                                      cfg.get("SPLIT_K", 1)))
            else:
                spec = ("splits", gemm_tma.tail_split_plan(M, N, K, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"],
                                                           sms * cfg["CTAS_PER_SM"], cfg.get("TAIL_SPLIT", 1)))
            key = (family, dtype_name, has_bias, activation, gated, json.dumps(cfg, sort_keys=True), spec,
                   N % 16 == 0, K % 16 == 0)
            if key not in seen:
                seen.add(key)
                jobs.append({"kind": "gemm", "family": family, "M": M, "N": N, "K": K, "dtype": dtype_name,
                             "has_bias": has_bias, "activation": activation, "gated": gated, "config": cfg,
                             "splits": spec[1] if family == "persistent" else None, "sms": sms})
    return sorted(keys), jobs


def _compile_shape(job):
    """A small (M, N, K) compiling the same binary as the job's call: M is not specialized; N and
    K keep their divisibility (by 16, and K by the tiled config's BLOCK_K); the persistent split
    count, which is a constexpr, comes from a tail of ``programs // splits`` tiles."""
    cfg, M, N, K = job["config"], job["M"], job["N"], job["K"]
    if job["family"] == "tiled":
        return min(M, 64), N, K
    programs = job["sms"] * cfg["CTAS_PER_SM"]
    if not job["splits"] or job["splits"] == 1:
        return 256, N, K
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = programs // job["splits"]
    return bm, tiles * bn, bk * max(job["splits"], 4)


def run_job(job):
    """One pool job: compile a GEMM variant, run the quantization kernels of a shape, or run the
    GPU checks. Returns a dict (errors included, never raised: the pool must finish)."""
    t = time.time()
    try:
        if job["kind"] == "checks":
            small = job.get("small", False)
            results = run_gpu_checks(small=small, device="cpu" if small else "cuda", parts=(job["part"],))
            return {"kind": "checks", "part": job["part"], "results": results, "s": time.time() - t}
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if job["kind"] == "quant":
            from quantkit.kernels import triton_ops

            M, K = job["M"], job["K"]
            dtype = DTYPES[job["dtype"]]
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            weight = torch.randn(K, device=device, dtype=torch.bfloat16)
            triton_ops.quantize_per_token(x, dtype)
            triton_ops.quantize_per_tensor(x, torch.tensor([0.05], device=device), dtype)
            triton_ops.rms_norm_quant_per_token(x, weight, 1e-6, dtype)
            triton_ops.rms_norm_quant_per_token(x, weight, 1e-6, dtype, torch.randn_like(x))
        else:
            M, N, K = _compile_shape(job)
            dtype = DTYPES[job["dtype"]]
            gen = torch.Generator(device=device).manual_seed(0)
            a, sa = reference.quantize_per_token(torch.randn(M, K, device=device, generator=gen), dtype)
            rows = 2 * N if job["gated"] else N
            w, sw = reference.quantize_per_channel(torch.randn(rows, K, device=device, generator=gen), dtype)
            bias = torch.randn(N, device=device, dtype=torch.bfloat16) if job["has_bias"] else None
            if job["gated"]:
                gemm.gated_scaled_mm(a, w, sa, sw, job["activation"], torch.bfloat16, config=job["config"],
                                     kernel=job["family"])
            else:
                gemm.scaled_mm(a, w, sa, sw, bias, job["activation"], torch.bfloat16, config=job["config"],
                               kernel=job["family"])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"kind": job["kind"], "s": time.time() - t}
    except Exception as e:  # noqa: BLE001 - reported by the parent
        return {"kind": job["kind"], "job": {k: v for k, v in job.items() if k != "results"},
                "error": f"{type(e).__name__}: {str(e)[:400]}", "traceback": traceback.format_exc()[-2000:]}


def precompile(jobs, workers, timeout):
    import multiprocessing as mp

    t = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        results = pool.map_async(run_job, jobs, chunksize=1).get(timeout=timeout)
    errors = [r for r in results if "error" in r]
    print(f"precompile: {len(jobs)} jobs on {workers} workers in {time.time() - t:.1f}s"
          + (f", {len(errors)} failed" if errors else ""), flush=True)
    for r in errors:
        print(f"  failed: {r['job']} {r['error']}", flush=True)
    return results


# ---------------------------------------------------------------------------------------------- estimate


# Per-unit costs on the H100 host (session-4/5 logs): a persistent compile ~3 s, a tiled one ~1.5 s;
# one autotune trial ~40 ms (tiled, do_bench 5+25 ms) / ~100 ms (persistent, two graph captures).
COMPILE_S = {"persistent": 3.0, "tiled": 1.5}
TRIAL_S = {"persistent": 0.10, "tiled": 0.04}
CHECKS_S = 45.0  # the longest of the check parts (its own compiles), serially in one worker


def estimate(shapes, ms, epilogues, gated, workers, sms=132, checks=True):
    calls = gemm_calls(shapes, ms, epilogues, gated)
    keys, jobs = compile_jobs(calls, sms)
    compile_s = sum(COMPILE_S[j["family"]] for j in jobs)
    trials = {}
    for family, N, K, bucket, dtype_name, has_bias, activation, gated_key in keys:
        n = len(_configs(family, bucket, dtype_name, gated_key, N))
        trials[family] = trials.get(family, 0) + n
    tune_s = sum(TRIAL_S[f] * n for f, n in trials.items())
    timing_s = sum(point_seconds(M, N, K, timed_ops(epilogues)) for N, K in shapes for M in ms)
    if gated:
        timing_s += sum(2 * point_seconds(M, 2 * GATED_N, GATED_K, 3) for M in ms)
    quant_s = 15.0
    parallel_compile_s = max(compile_s / workers, CHECKS_S if checks else 0.0) + 10.0  # + worker start-up
    return {
        "gemm_calls": len(calls), "tuning_keys": len(keys), "autotune_trials": trials,
        "compile_jobs": len(jobs), "compile_serial_s": round(compile_s), "autotune_s": round(tune_s),
        "timing_s": round(timing_s), "quant_s": quant_s,
        "total_serial_s": round(compile_s + (2 * CHECKS_S if checks else 0) + tune_s + timing_s + quant_s),
        "total_with_precompile_s": round(parallel_compile_s + tune_s + timing_s + quant_s + 15),
        "workers": workers,
    }


# ---------------------------------------------------------------------------------------------- main


def _smoke_timer(fn):
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _m_list(text: str) -> list[int]:
    try:
        ms = [int(m) for m in text.split(",")]
    except ValueError:
        ms = []
    if not ms or min(ms) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of positive row counts, e.g. 1024,4096")
    return ms


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    m_values = parser.add_mutually_exclusive_group()
    m_values.add_argument("--quick", action="store_true", help=f"fewer M values {QUICK_MS}")
    m_values.add_argument("--m", type=_m_list, default=None, metavar="M,M,...",
                          help=f"these M values instead of {DEFAULT_MS} (a run in parts, each within a time limit)")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--epilogues", default="plain,bias_silu")
    parser.add_argument("--eager-timer", action="store_true",
                        help="time eager calls with do_bench (includes Python/launch overhead) instead of CUDA-graph replay")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: gemm,quant,gated")
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="seconds from start: skip the points that no longer fit, write what was timed (0: none)")
    parser.add_argument("--workers", type=int, default=0, help="compile processes (0: from the CPU count)")
    parser.add_argument("--no-precompile", action="store_true", help="compile in the timing process (serial)")
    parser.add_argument("--estimate", action="store_true", help="print the run's size and time estimate and exit")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter dry run on tiny shapes")
    parser.add_argument("--rounds", type=int, default=bench_gemm.ROUNDS,
                        help="timing rounds per point, the op order rotated each round (medians reported)")
    parser.add_argument("--split-k", action="store_true",
                        help="only the small-M split-K round: its checks, timings and verdict (gemm_splitk.json)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    epilogues = tuple(args.epilogues.split(","))
    ms = QUICK_MS if args.quick else args.m or DEFAULT_MS
    shapes = LLAMA3_8B_SHAPES
    workers = args.workers or max(2, min(14, (os.cpu_count() or 4) - 2))
    if args.estimate:
        print(json.dumps(estimate(shapes, ms, epilogues, "gated" not in skip, workers,
                                  checks=not args.no_checks), indent=1))
        return
    device = "cuda"
    timer = bench_ms if args.eager_timer else adaptive_graph_ms
    if args.smoke:
        global GATED_N, GATED_K
        device, timer, workers = "cpu", _smoke_timer, 2
        shapes, ms = [(64, 128)], [4, 1024]
        GATED_N, GATED_K = 64, 128
        bench_gemm.GATED_SHAPE = (GATED_N, GATED_K)
        skip.add("quant")  # the quantization benchmark needs CUDA
    elif not torch.cuda.is_available():
        raise SystemExit("error: the GEMM benchmark needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1, "
                         "or --estimate)")
    deadline_at = T0 + args.deadline if args.deadline > 0 else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    check_parts = (*SPLIT_K_PARTS, *PROMOTED_PARTS) if args.split_k else CHECK_PARTS
    if args.split_k:
        skip.update({"quant", "gemm", "gated"})  # the split-K round only
    split_points, split_extra = gemm_splitk.SPLIT_K_POINTS, {}
    if args.split_k and args.smoke:
        # Two split configs, one tiny plain and one gated shape, the wall clock, one round.
        split_points = [("plain", 64, 1024), ("gated", 64, 1024)]
        split_extra = {"config_limit": 2, "rounds": 1,
                       "timers": {"wall": lambda make, weights: _smoke_timer(make(weights[0]))}}
    jobs = []
    if not args.no_checks and not args.no_precompile:
        # The checks side by side with the compile jobs (the longest jobs first), except the
        # torch.compile one: inductor starts compile workers, which a pool's (daemonic) worker may not.
        jobs += [{"kind": "checks", "small": args.smoke, "part": part} for part in check_parts if part != "compile"]
    if not args.no_precompile:
        sms = gemm_tma.INTERPRETER_NUM_SMS if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
        if args.split_k:
            # Every call of the split-K round: the pool at each M (its "auto") and the split configs it admits.
            calls = [(M, N, K, d, False, "silu" if kind == "gated" else "none", kind == "gated")
                     for kind, N, K in split_points for M in gemm_splitk.SPLIT_K_MS for d in DTYPES]
            _, gemm_jobs = compile_jobs(calls, sms, extra_tiled=gemm_splitk.split_candidates)
        else:
            calls = gemm_calls(shapes if "gemm" not in skip else [], ms, epilogues, "gated" not in skip)
            _, gemm_jobs = compile_jobs(calls, sms)
        jobs += gemm_jobs[:4] if args.smoke else gemm_jobs
        if "quant" not in skip:
            jobs += [{"kind": "quant", "M": M, "K": K, "dtype": d} for M, K in QUANT_SHAPES for d in DTYPES]
    checks = None
    if jobs and not args.no_precompile:
        budget = (deadline_at - time.monotonic() - 60) if deadline_at else 300.0
        try:
            results = precompile(jobs, workers, timeout=max(30.0, budget))
            parts = [r for r in results if r["kind"] == "checks"]
            if parts:
                failed = [r for r in parts if "error" in r]
                if failed:
                    checks = failed[0]
                else:
                    compiled = (run_gpu_checks(small=args.smoke, device=device, parts=("compile",))
                                if "compile" in check_parts else [])
                    checks = {"results": [x for r in parts for x in r["results"]] + compiled}
        except Exception:  # noqa: BLE001 - compiling in the timing process instead is only slower
            traceback.print_exc()
    if not args.no_checks:
        if checks is None or "error" in checks:
            if checks is not None:
                print(f"GPU checks failed in the pool: {checks['error']}\n{checks.get('traceback', '')}", flush=True)
            # Raises on the first failure.
            checks = {"results": run_gpu_checks(small=args.smoke, device=device, parts=check_parts)}
        Path(out, "gemm_checks.json").write_text(json.dumps(checks["results"], indent=1, default=str))
        print(f"all {len(checks['results'])} GPU checks passed", flush=True)
    if args.split_k:
        gemm_splitk.run_split_k_benchmark(out, device=device, points=split_points,
                                          deadline_left=lambda: deadline_at - time.monotonic() if deadline_at
                                          else float("inf"), **split_extra)

    if "quant" not in skip and (deadline_at is None or deadline_at - time.monotonic() > 60):
        from quantkit.bench.quant import run_quant_benchmark

        quant_rows = run_quant_benchmark(shapes=QUANT_SHAPES, out_dir=out, timer=timer)
    else:
        quant_rows = []
    gemm_rows = []
    if "gemm" not in skip:
        gemm_rows = run_gemm_benchmark(shapes=shapes, ms=ms, out_dir=out, gated="gated" not in skip, timer=timer,
                                       epilogues=epilogues, device=device, deadline_at=deadline_at,
                                       plot=not args.smoke, rounds=args.rounds)
    if not args.split_k and (gemm_rows or quant_rows):
        write_targets(out, gemm_rows, quant_rows)
    print(f"done in {time.monotonic() - T0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
