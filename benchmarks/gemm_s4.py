"""Session-4 GPU round for issue 3's large-M GEMM targets (Llama-3-8B shapes, M in {1024, 4096}).

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_s4.py --out $OUT/gemm --deadline 200
    ... --round 2   # follow-up: GROUP_M at M=4096 and the updated autotune set (gemm_s4_round2.json)
    ... --round 3   # auto with graph-timed autotuning + round winners, all 8 points (gemm_s4_round3.json)
    TRITON_INTERPRET=1 python benchmarks/gemm_s4.py --out /tmp/s4 --smoke      # CPU dry run, tiny shapes

Targets: FP8 >= 1.0x torch._scaled_mm rowwise (use_fast_accum=True; ours fast too), INT8 >= 1.5x
bf16 F.linear, at every (N x K, M) point. Per point, in one process:
- baselines: bf16 F.linear (cuBLAS), torch._scaled_mm rowwise fast accumulation, torch._int_mm +
  the dequant epilogue done separately;
- quantkit FP8 and INT8: kernel "auto" (the autotuned default over PERSISTENT_CONFIGS) and explicit
  persistent-kernel candidates (new this session: 4-way epilogue split, two CTAs per SM for the
  128x128 4-warp tiles, 256-deep K steps; see NOTES-gemm.md, session 4);
- every quantkit output is checked against reference.scaled_mm (fp32) before it is timed (INT8
  also bit for bit against the reference's bf16 output); a candidate that fails is not timed;
- timing: bench_graph_ms (CUDA-graph replay, L2 flushed before each call); the baselines, auto
  and the two best candidates per dtype are timed in three interleaved rounds, medians reported.
Compiles: the explicit candidates and the autotune set are compiled first by a pool of worker
processes (triton's on-disk cache), so the timed process mostly loads binaries.
Results: gemm_s4.json (rows per point, summary, autotune picks, registers/shared memory of each
compiled kernel), written after every point so a time-out keeps what finished.
Imports the kernels without running quantkit/__init__.py (no pipeline dependencies needed).
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "quantkit" not in sys.modules:
    _pkg = types.ModuleType("quantkit")
    _pkg.__path__ = [str(ROOT / "quantkit")]
    sys.modules["quantkit"] = _pkg

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.gemm import _rel_err, autotune_choices, bench_graph_ms  # noqa: E402
from quantkit.kernels import gemm, gemm_tma, reference  # noqa: E402
from quantkit.kernels.launch import config_dict  # noqa: E402

FP8 = torch.float8_e4m3fn
T0 = time.time()
SHAPES_1024 = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]
SHAPES_4096 = [(28672, 4096), (6144, 4096), (4096, 4096), (4096, 14336)]
# rel. error vs the fp32 reference: bf16 output rounding (~1.7e-3), FP8 fast accumulation up to
# 3.3e-3 at K=14336 (session 2, same as cuBLAS fast).
TOLERANCE = {torch.int8: 3e-3, FP8: 6e-3}


def left(deadline):
    return deadline - (time.time() - T0)


def pcfg(bm, bn, bk, warps, stages, split=2, group_m=8, ctas=1, a_regs=False):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "EPILOGUE_SPLIT": split,
            "WARP_SPECIALIZE": False, "CTAS_PER_SM": ctas, "A_IN_REGISTERS": a_regs, "num_warps": warps,
            "num_stages": stages}


# Candidates in priority order (a deadline cut drops the tail). "_q4": epilogue stored in quarters;
# "_x2": two CTAs per SM (launch grid 2 x SMs; shared memory per CTA kept under half the SM's);
# "_ar": the A tile reaches wgmma from registers (INT8 only: FP8's dot would lose its async wgmma).
COMMON = {
    "128x256x128_w8_s4_g4": pcfg(128, 256, 128, 8, 4, group_m=4),        # in the autotune set
    "128x128x128_w4_s5_h1": pcfg(128, 128, 128, 4, 5, split=1),          # in the autotune set
}
CANDIDATES = {
    torch.int8: {
        # Triton caps INT8 wgmma at N=224: a 256-wide tile issues two N=128 instructions per K
        # step, each re-reading A from shared memory unless A sits in registers.
        "128x256x128_w8_s4_ar": pcfg(128, 256, 128, 8, 4, a_regs=True),
        "128x256x128_w8_s4_g4_ar": pcfg(128, 256, 128, 8, 4, group_m=4, a_regs=True),
        "128x256x128_w8_s3_ar": pcfg(128, 256, 128, 8, 3, a_regs=True),
        "128x256x256_w8_s2_q4_ar": pcfg(128, 256, 256, 8, 2, split=4, a_regs=True),
        # INT8 wgmma is synchronous in triton 3.6 (wait 0 after every K step): a second CTA per
        # SM issues while the first drains; 256-deep K steps drain half as often.
        "128x128x128_w4_s3_q4_x2": pcfg(128, 128, 128, 4, 3, split=4, ctas=2),
        "128x128x64_w4_s4_x2": pcfg(128, 128, 64, 4, 4, ctas=2),
        "128x128x64_w4_s5_x2": pcfg(128, 128, 64, 4, 5, ctas=2),
        "128x256x256_w8_s2_q4": pcfg(128, 256, 256, 8, 2, split=4),
        "128x128x256_w4_s3_q4": pcfg(128, 128, 256, 4, 3, split=4),
        "64x256x128_w4_s2_x2": pcfg(64, 256, 128, 4, 2, ctas=2),
        "128x256x128_w8_s4_q4": pcfg(128, 256, 128, 8, 4, split=4),
        **COMMON,
    },
    FP8: {
        "128x256x128_w8_s4_q4": pcfg(128, 256, 128, 8, 4, split=4),
        "128x256x128_w8_s4_q4_g16": pcfg(128, 256, 128, 8, 4, split=4, group_m=16),
        "128x256x64_w8_s6_q4": pcfg(128, 256, 64, 8, 6, split=4),
        "128x128x128_w4_s3_q4_x2": pcfg(128, 128, 128, 4, 3, split=4, ctas=2),
        "128x128x64_w4_s5_x2": pcfg(128, 128, 64, 4, 5, ctas=2),
        **COMMON,
    },
}
# Round 2 (--round 2): the weight is re-read from memory num_pid_m / GROUP_M times at M=4096
# (32 row-tiles of 128): GROUP_M 16 beat 8 and 4 at 28672x4096 in round 1, so try grouping all
# row-tiles (32), for FP8 and for INT8's two-CTAs-per-SM config; "auto" is the updated set.
ROUND2 = {
    torch.int8: {
        "128x128x128_w4_s3_q4_x2": pcfg(128, 128, 128, 4, 3, split=4, ctas=2),
        "128x128x128_w4_s3_q4_x2_g16": pcfg(128, 128, 128, 4, 3, split=4, ctas=2, group_m=16),
        "128x128x128_w4_s3_q4_x2_g32": pcfg(128, 128, 128, 4, 3, split=4, ctas=2, group_m=32),
    },
    FP8: {
        "128x256x128_w8_s4_q4_g16": pcfg(128, 256, 128, 8, 4, split=4, group_m=16),
        "128x256x128_w8_s4_q4_g32": pcfg(128, 256, 128, 8, 4, split=4, group_m=32),
        "128x256x128_w8_s3_q4_g32": pcfg(128, 256, 128, 8, 3, split=4, group_m=32),
        "128x256x128_w8_s4_q4": pcfg(128, 256, 128, 8, 4, split=4),
        "256x128x128_w8_s3_q4_g16": pcfg(256, 128, 128, 8, 3, split=4, group_m=16),
    },
}
# Round 3 (--round 3): the updated autotune set as "auto" (autotuned with CUDA-graph timing) at
# all 8 points, next to the configs that won rounds 1-2.
ROUND3 = {
    torch.int8: {"128x128x128_w4_s3_q4_x2": pcfg(128, 128, 128, 4, 3, split=4, ctas=2)},
    FP8: {"128x256x128_w8_s4_q4_g16": pcfg(128, 256, 128, 8, 4, split=4, group_m=16),
          "128x128x128_w4_s5_h1": pcfg(128, 128, 128, 4, 5, split=1)},
}
SMOKE_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 2, "EPILOGUE_SPLIT": 4,
                "WARP_SPECIALIZE": False, "CTAS_PER_SM": 2, "A_IN_REGISTERS": True, "num_warps": 4, "num_stages": 3}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _operands(M, N, K, dtype, seed=0):
    gen = torch.Generator(device=_device()).manual_seed(seed)
    x = torch.randn(M, K, device=_device(), dtype=torch.bfloat16, generator=gen)
    w_bf16 = (torch.randn(N, K, device=_device(), generator=gen) * K**-0.5).to(torch.bfloat16)
    a, a_scale = reference.quantize_per_token(x, dtype)
    w, w_scale = reference.quantize_per_channel(w_bf16, dtype)
    return x, w_bf16, a, a_scale, w, w_scale


# ---------------------------------------------------------------------------------------------- compile pool


def _compile_worker(job):
    """Compile one (dtype, config) by running it once on small operands: the binary lands in
    triton's on-disk cache, where the timing process finds it under the same key."""
    dtype_name, config = job
    dtype = FP8 if dtype_name == "fp8" else torch.int8
    t = time.time()
    try:
        _, _, a, sa, w, sw = _operands(256, 512, 512, dtype)
        gemm.scaled_mm(a, w, sa, sw, None, "none", torch.bfloat16, config=config, kernel="persistent")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"dtype": dtype_name, "config": config, "s": time.time() - t}
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a result here
        return {"dtype": dtype_name, "config": config, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def precompile(jobs, workers, timeout):
    import multiprocessing as mp

    t = time.time()
    # The pool is terminated on leaving the block, also after a timeout (the timing process then
    # compiles what is missing itself).
    with mp.get_context("spawn").Pool(workers) as pool:
        results = pool.map_async(_compile_worker, jobs, chunksize=1).get(timeout=timeout)
    errors = [r for r in results if "error" in r]
    print(f"precompiled {len(jobs)} kernels with {workers} workers in {time.time() - t:.1f}s"
          + (f", {len(errors)} failed: {errors}" if errors else ""), flush=True)
    return {"seconds": time.time() - t, "jobs": len(jobs), "results": results}


# ---------------------------------------------------------------------------------------------- one point


def _wall_ms(fn, reps=2):
    """CPU smoke-run timer (no CUDA graphs)."""
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def run_point(M, N, K, candidates, timer, deadline, rounds=3):
    """Check then time every variant at (M, N, K); returns rows (one per op) with median times."""
    rows, fns, errors = {}, {}, []
    x, w_bf16, *_ = _operands(M, N, K, torch.int8)
    fns["bf16_F.linear"] = (None, lambda: F.linear(x, w_bf16))
    rows["bf16_F.linear"] = {"op": "bf16_F.linear", "dtype": "bf16"}
    for dtype_name, dtype in (("fp8", FP8), ("int8", torch.int8)):
        _, _, a, sa, w, sw = _operands(M, N, K, dtype, seed=1)
        sa_col, sw_row = sa.view(-1, 1), sw.view(1, -1)
        if dtype == FP8:
            name = "torch._scaled_mm_fast"
            base = (lambda a=a, w=w, sa=sa_col, sw=sw_row:
                    torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True))
        else:
            name = "torch._int_mm+epilogue"

            def base(a=a, w=w, sa=sa_col, sw=sw_row):
                return (torch._int_mm(a, w.t()).float() * sa * sw).to(torch.bfloat16)
        try:
            base()
            fns[name] = (None, base)
            rows[name] = {"op": name, "dtype": dtype_name}
        except Exception as e:  # noqa: BLE001 - e.g. no _scaled_mm on the CPU smoke run
            errors.append({"op": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        ref32 = reference.scaled_mm(a, w, sa, sw, None, "none", torch.float32)
        ref16 = reference.scaled_mm(a, w, sa, sw, None, "none", torch.bfloat16) if dtype == torch.int8 else None
        for cand, cfg in [("auto", None)] + list(candidates[dtype].items()):
            if left(deadline) < 12:
                errors.append({"op": f"{dtype_name}_{cand}", "error": "skipped: deadline"})
                continue
            op = f"{dtype_name}_{cand}"
            out = torch.full((M, N), float("nan"), device=a.device, dtype=torch.bfloat16)

            def fn(a=a, w=w, sa=sa, sw=sw, cfg=cfg, out=out):
                return gemm.scaled_mm(a, w, sa, sw, None, "none", torch.bfloat16, config=cfg, out=out,
                                      kernel="auto" if cfg is None else "persistent")
            t_first = time.time()
            try:
                got = fn()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a config that does not compile/launch is a result here
                errors.append({"op": op, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"  {op}: ERROR {errors[-1]['error'][:120]}", flush=True)
                continue
            err = _rel_err(got, ref32)
            # First call: compile or load from the cache (plus autotuning for "auto").
            row = {"op": op, "dtype": dtype_name, "config": cfg or "autotuned", "rel_err": err,
                   "nan": bool(got.isnan().any()), "first_call_s": time.time() - t_first}
            if ref16 is not None:
                row["equal_ref_bf16"] = bool(torch.equal(got, ref16))
            ok = not row["nan"] and err < TOLERANCE[dtype]
            row["check_ok"] = ok
            rows[op] = row
            if ok:
                fns[op] = (dtype_name, fn)
            else:
                print(f"  {op}: CHECK FAILED rel_err={err:.2e} nan={row['nan']}", flush=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()

    def time_op(op):
        try:
            rows[op].setdefault("ms_rounds", []).append(timer(fns[op][1]))
        except Exception as e:  # noqa: BLE001 - keep the other ops' numbers
            rows[op]["time_error"] = f"{type(e).__name__}: {str(e)[:200]}"

    for op in fns:  # round 1: everything that passed its check
        if left(deadline) < 8:
            break
        time_op(op)
    # Rounds 2..: baselines, auto and the two fastest candidates per dtype, interleaved.
    timed = [op for op in fns if rows[op].get("ms_rounds")]
    keep = [op for op in timed if fns[op][0] is None or op.endswith("_auto")]
    for dtype_name in ("fp8", "int8"):
        ranked = sorted((op for op in timed if fns[op][0] == dtype_name and not op.endswith("_auto")),
                        key=lambda op: rows[op]["ms_rounds"][0])
        keep += ranked[:2]
    for _ in range(rounds - 1):
        for op in keep:
            if left(deadline) < 8:
                break
            time_op(op)
    out_rows = []
    for op, row in rows.items():
        if row.get("ms_rounds"):
            row["ms"] = statistics.median(row["ms_rounds"])
            row["tflops"] = 2.0 * M * N * K / (row["ms"] * 1e-3) / 1e12
        out_rows.append({"M": M, "N": N, "K": K, **row})
    _ratios(out_rows)
    return out_rows, errors


def _ratios(rows):
    ms = {r["op"]: r.get("ms") for r in rows}
    for r in rows:
        if r.get("ms") is None:
            continue
        if ms.get("bf16_F.linear"):
            r["x_bf16"] = ms["bf16_F.linear"] / r["ms"]
        if r["dtype"] == "fp8" and ms.get("torch._scaled_mm_fast"):
            r["x_scaled_mm_fast"] = ms["torch._scaled_mm_fast"] / r["ms"]
        if r["dtype"] == "int8" and ms.get("torch._int_mm+epilogue"):
            r["x_int_mm"] = ms["torch._int_mm+epilogue"] / r["ms"]


def summarize(rows):
    """Per point: baselines, ours auto and best candidate per dtype, with the target ratios."""
    out = []
    for M, N, K in sorted({(r["M"], r["N"], r["K"]) for r in rows}):
        pt = [r for r in rows if (r["M"], r["N"], r["K"]) == (M, N, K) and r.get("ms")]
        by_op = {r["op"]: r for r in pt}
        s = {"M": M, "N": N, "K": K}
        for op in ("bf16_F.linear", "torch._scaled_mm_fast", "torch._int_mm+epilogue"):
            if op in by_op:
                s[op + "_us"] = by_op[op]["ms"] * 1e3
        for dtype_name, ratio in (("fp8", "x_scaled_mm_fast"), ("int8", "x_bf16")):
            ours = [r for r in pt if r["dtype"] == dtype_name and r["op"].startswith(dtype_name + "_")]
            if not ours:
                continue
            best = min(ours, key=lambda r: r["ms"])
            auto = by_op.get(f"{dtype_name}_auto")
            s[f"{dtype_name}_best"] = best["op"]
            s[f"{dtype_name}_best_us"] = best["ms"] * 1e3
            s[f"{dtype_name}_best_{ratio}"] = best.get(ratio)
            s[f"{dtype_name}_best_rounds"] = len(best["ms_rounds"])
            if auto:
                s[f"{dtype_name}_auto_us"] = auto["ms"] * 1e3
                s[f"{dtype_name}_auto_{ratio}"] = auto.get(ratio)
        out.append(s)
    return out


def print_summary(summary):
    print("\n   M      N x K     bf16   _sm_fast  fp8 auto (x_sm)  fp8 best (x_sm) name           "
          "| int8 auto (x_bf16) int8 best (x_bf16) name", flush=True)
    for s in summary:
        def f(key, fmt="{:7.1f}"):
            v = s.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else "      -"
        print(f"{s['M']:5d} {s['N']:6d}x{s['K']:<6d} {f('bf16_F.linear_us')} {f('torch._scaled_mm_fast_us')}  "
              f"{f('fp8_auto_us')} ({f('fp8_auto_x_scaled_mm_fast', '{:.3f}')})  "
              f"{f('fp8_best_us')} ({f('fp8_best_x_scaled_mm_fast', '{:.3f}')}) {s.get('fp8_best', '-'):28s} | "
              f"{f('int8_auto_us')} ({f('int8_auto_x_bf16', '{:.3f}')})  "
              f"{f('int8_best_us')} ({f('int8_best_x_bf16', '{:.3f}')}) {s.get('int8_best', '-')}", flush=True)


def compiled_resources():
    """Registers / spills / shared memory of every persistent kernel compiled in this process."""
    out = []
    for (device, key), (compiled, _) in gemm_tma._PERSISTENT.compiled.items():
        info = {"key": str(key)[:400]}
        for attr in ("n_regs", "n_spills", "n_max_threads"):
            info[attr] = getattr(compiled, attr, None)
        info["shared"] = getattr(getattr(compiled, "metadata", None), "shared", None)
        out.append(info)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=200.0)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter dry run on tiny shapes")
    parser.add_argument("--workers", type=int, default=0, help="compile processes (0: from the CPU count)")
    parser.add_argument("--round", type=int, default=1, choices=(1, 2, 3),
                        help="1: all candidates at all 8 points; 2: GROUP_M follow-up (ROUND2) at M=4096 + 2 points; "
                             "3: auto (graph-timed autotuning) and the round winners at all 8 points")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = environment_metadata()
    meta["timer"] = ("bench_graph_ms (CUDA-graph replay, L2 flushed before each call); median of 3 interleaved "
                     "rounds for baselines, auto and the 2 best candidates per dtype, 1 round otherwise")
    meta["deadline_s"] = args.deadline
    meta["round"] = args.round
    print(meta, flush=True)
    result = {"meta": meta, "rows": [], "errors": []}

    def save():
        result["elapsed_s"] = time.time() - T0
        name = "gemm_s4.json" if args.round == 1 else f"gemm_s4_round{args.round}.json"
        Path(out, name).write_text(json.dumps(result, indent=1, default=str))

    if args.smoke:
        candidates = {dt: {"smoke_q4_x2": SMOKE_CONFIG, "smoke_default": dict(gemm_tma.INTERPRETER_CONFIG)}
                      for dt in (torch.int8, FP8)}
        points = [(64, 96, 128), (70, 128, 64)]
        timer = _wall_ms
        jobs = [("int8", SMOKE_CONFIG), ("fp8", SMOKE_CONFIG)]
        workers = 2
    else:
        if args.round == 1:
            candidates = CANDIDATES
            points = [(1024, N, K) for N, K in SHAPES_1024] + [(4096, N, K) for N, K in SHAPES_4096]
        elif args.round == 2:
            candidates = ROUND2
            points = [(4096, N, K) for N, K in SHAPES_4096] + [(1024, 4096, 4096), (1024, 6144, 4096)]
        else:
            candidates = ROUND3
            points = [(1024, N, K) for N, K in SHAPES_1024] + [(4096, N, K) for N, K in SHAPES_4096]
        timer = bench_graph_ms
        jobs = []
        for dtype_name, dtype in (("fp8", FP8), ("int8", torch.int8)):
            cfgs = list(candidates[dtype].values()) + [config_dict(c) for c in gemm_tma.PERSISTENT_CONFIGS]
            seen = []
            for c in cfgs:
                norm = pcfg(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"],
                            c.get("EPILOGUE_SPLIT", 1), c.get("GROUP_M", 8), c.get("CTAS_PER_SM", 1),
                            c.get("A_IN_REGISTERS", False))
                if norm not in seen:
                    seen.append(norm)
                    jobs.append((dtype_name, c))
        workers = args.workers or max(2, min(12, (os.cpu_count() or 4) - 2))
    try:
        result["precompile"] = precompile(jobs, workers, timeout=max(10.0, min(120.0, left(args.deadline) - 90)))
    except Exception:  # noqa: BLE001 - compiling in the timing process instead is only slower
        traceback.print_exc()
        result["precompile"] = {"error": traceback.format_exc()}
    save()

    for M, N, K in points:
        if left(args.deadline) < 20:
            print(f"deadline: skipping M={M} {N}x{K}", flush=True)
            result["errors"].append({"point": [M, N, K], "error": "skipped: deadline"})
            continue
        t = time.time()
        try:
            rows, errors = run_point(M, N, K, candidates, timer, args.deadline)
        except Exception:  # noqa: BLE001 - report and go on to the next point
            traceback.print_exc()
            result["errors"].append({"point": [M, N, K], "error": traceback.format_exc()})
            save()
            continue
        result["rows"] += rows
        result["errors"] += [{"point": [M, N, K], **e} for e in errors]
        for r in rows:
            if r.get("ms"):
                extra = "".join(f" {k}={r[k]:.3f}" for k in ("x_bf16", "x_scaled_mm_fast", "x_int_mm") if k in r)
                err = f" err={r['rel_err']:.1e}" if "rel_err" in r else ""
                print(f"M={M} {N}x{K} {r['op']:34s} {r['ms'] * 1e3:8.1f} us ({len(r['ms_rounds'])}r){extra}{err}",
                      flush=True)
        print(f"point M={M} {N}x{K} done in {time.time() - t:.1f}s (elapsed {time.time() - T0:.0f}s)", flush=True)
        result["summary"] = summarize(result["rows"])
        save()

    result["summary"] = summarize(result["rows"])
    try:
        result["autotune"] = autotune_choices()
        result["compiled"] = compiled_resources()
    except Exception:  # noqa: BLE001 - diagnostics only
        result["autotune_error"] = traceback.format_exc()
    save()
    print_summary(result["summary"])
    print(f"done in {time.time() - T0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
