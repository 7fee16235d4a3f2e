"""Session-5 GPU round for issue 3's large-M GEMM targets: the partial last wave split along K.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_s5.py --out $OUT/gemm --deadline 240
    ... --round 2   # FP8 at M >= 4096: the quarter-epilogue pool vs the shipped rule (gemm_s5_round2.json)
    TRITON_INTERPRET=1 python benchmarks/gemm_s5.py --out /tmp/s5 --smoke      # CPU dry run, tiny shapes

Targets: FP8 >= 1.0x torch._scaled_mm rowwise (use_fast_accum=True; ours fast too), INT8 >= 1.5x
bf16 F.linear, at every (N x K, M) point of the Llama-3-8B shapes, M in {1024, 4096, 16384}.
Per point, in one process:
- baselines: bf16 F.linear (cuBLAS), torch._scaled_mm rowwise fast accumulation, torch._int_mm +
  the dequant epilogue done separately;
- quantkit FP8 and INT8: kernel "auto" (the shipped autotune set) and explicit persistent configs,
  each plain and, where ``gemm_tma.tail_split_plan`` splits at this point, with TAIL_SPLIT
  (the tiles of the partial last wave computed as K-slices by more programs; "_ts<max>");
- every quantkit output is checked first: against reference.scaled_mm (fp32) within the
  tolerance, INT8 bit for bit against the reference's bf16 output (exact int32 sums), a second
  call bit-equal to the first (the split sum is deterministic), and the split workspace's arrival
  counters back at zero; a variant that fails is not timed;
- timing: bench_graph_ms (CUDA-graph replay, L2 flushed before each call; repetitions per graph
  scaled to the op's time), every op in 3 interleaved rounds, medians, ratios vs the same run.
Compiles: every (config, split count) variant is compiled first by a pool of worker processes
(triton's on-disk cache), each on a small shape whose plan gives that split count on this GPU.
Results: gemm_s5.json (rows, summary, autotune picks, registers/shared memory), written after
every point so a time-out keeps what finished. Imports the kernels without quantkit/__init__.py.
"""

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.gemm import adaptive_graph_ms, autotune_choices  # noqa: E402
from quantkit.kernels import gemm, gemm_tma, reference  # noqa: E402
from quantkit.kernels.launch import config_dict  # noqa: E402

FP8 = torch.float8_e4m3fn
T0 = time.time()
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
# Most informative first (a deadline cut drops the tail): M=1024 (6144x4096 splits), M=4096
# (28672x4096 splits), then the never-measured M=16384.
POINTS = ([(1024, N, K) for N, K in SHAPES] + [(4096, N, K) for N, K in [(28672, 4096), (6144, 4096), (4096, 4096),
                                                                           (4096, 14336)]]
          + [(16384, N, K) for N, K in SHAPES])
# rel. error vs the fp32 reference: bf16 output rounding (~1.7e-3), FP8 fast accumulation up to
# 3.3e-3 at K=14336 (session 2, same as cuBLAS fast).
TOLERANCE = {torch.int8: 3e-3, FP8: 6e-3}


def left(deadline):
    return deadline - (time.time() - T0)


def pcfg(bm, bn, bk, warps, stages, split=2, group_m=8, ctas=1, tail=1):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "EPILOGUE_SPLIT": split,
            "WARP_SPECIALIZE": False, "CTAS_PER_SM": ctas, "A_IN_REGISTERS": False, "TAIL_SPLIT": tail,
            "num_warps": warps, "num_stages": stages}


# Base configs (in the autotune set), each timed plain and with the TAIL_SPLIT values listed where
# that changes the plan at the point (the plan's split count is capped by TAIL_SPLIT, by the
# programs per tail tile and by the K steps). The split variants of the configs that won session 4.
BASES = {
    FP8: {
        "128x256x128_w8_s4_q4_g16": (pcfg(128, 256, 128, 8, 4, split=4, group_m=16), (2, 4, 8)),
        "128x256x128_w8_s4_q4": (pcfg(128, 256, 128, 8, 4, split=4), ()),
        "128x128x128_w4_s5_h1": (pcfg(128, 128, 128, 4, 5, split=1), ()),
    },
    torch.int8: {
        "128x128x128_w4_s3_q4_x2": (pcfg(128, 128, 128, 4, 3, split=4, ctas=2), (2, 4, 8)),
        "128x256x128_w8_s4_q4_g16": (pcfg(128, 256, 128, 8, 4, split=4, group_m=16), (2, 4)),
    },
}
# "auto_s5": the shipped autotune set with TAIL_SPLIT on the configs that win where a tail is left
# (128x256 quarters GROUP_M=16, INT8 two per SM): the proposed default, autotuned end to end
# (the heuristic's split count, the workspace through the autotuner's path).
PROPOSED_TAIL_SPLIT = 4


def proposed_configs(configs):
    out = []
    for c in configs:
        kw = dict(c.kwargs)
        if (kw["BLOCK_M"], kw["BLOCK_N"], kw["EPILOGUE_SPLIT"], kw["GROUP_M"]) == (128, 256, 4, 16) or kw["CTAS_PER_SM"] == 2:
            kw["TAIL_SPLIT"] = PROPOSED_TAIL_SPLIT
        out.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=c.pre_hook))
    return out


class AutotuneSet:
    """Runs a call with another persistent autotune set (own tuner and own tuned-config caches)."""

    def __init__(self, configs, prune=None):
        self.configs = configs
        self.tuner = gemm_tma.make_autotuner(configs, prune=prune)
        self.tuned, self.plans = {}, {}

    def __call__(self, fn):
        saved = (gemm_tma._autotuned, gemm_tma._TUNED, gemm_tma._PLANS)
        gemm_tma._autotuned = lambda gated=False: self.tuner if not gated else saved[0](True)
        gemm_tma._TUNED, gemm_tma._PLANS = self.tuned, self.plans
        try:
            return fn()
        finally:
            gemm_tma._autotuned, gemm_tma._TUNED, gemm_tma._PLANS = saved


# Round 2 (--round 2): FP8 at M >= 4096 autotuned over only the two quarter-epilogue 128x256
# configs ("auto_q4pool", an AutotuneSet with q4_pool_prune) vs the shipped rule ("auto"), next to
# those two configs; INT8 (auto, the two configs it picks). 5 rounds. (The device run of
# 2026-11-23, commit 976bd49, had this rule in gemm_tma as the default: its JSON names the pool
# "fp8_auto" and the shipped rule "fp8_auto_old"; NOTES-gemm.md session 5. Not kept.)
Q4_POOL_MIN_BUCKET = 4096


def q4_pool_prune(configs, named_args, **kwargs):
    pool = gemm_tma._prune_by_dtype(configs, named_args, **kwargs)
    if named_args.get("IS_INT8", kwargs.get("IS_INT8")) or named_args.get("M_BUCKET", 0) < Q4_POOL_MIN_BUCKET:
        return pool
    q4 = [c for c in pool if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["EPILOGUE_SPLIT"], c.num_stages)
          == (128, 256, 4, 4) and c.kwargs["GROUP_M"] in (8, 16)]
    return q4 or pool
ROUND2_POINTS = [(4096, N, K) for N, K in SHAPES] + [(16384, N, K) for N, K in SHAPES]
ROUND2_BASES = {
    FP8: {"128x256x128_w8_s4_q4_g16": (pcfg(128, 256, 128, 8, 4, split=4, group_m=16), ()),
          "128x256x128_w8_s4_q4": (pcfg(128, 256, 128, 8, 4, split=4), ())},
    torch.int8: {"128x128x128_w4_s3_q4_x2": (pcfg(128, 128, 128, 4, 3, split=4, ctas=2), ()),
                 "128x256x128_w8_s4_q4_g16": (pcfg(128, 256, 128, 8, 4, split=4, group_m=16), ())},
}


SMOKE_BASES = {dt: {"smoke_q4_x2": (pcfg(64, 64, 64, 4, 3, split=4, group_m=2, ctas=2), (2,)),
                    "smoke_h2": (pcfg(64, 64, 64, 4, 3, split=2, group_m=2), (2, 4))} for dt in (torch.int8, FP8)}


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _programs(cfg, sms):
    return sms * cfg["CTAS_PER_SM"]


def _splits(cfg, M, N, K, sms):
    return gemm_tma.tail_split_plan(M, N, K, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], _programs(cfg, sms),
                                    cfg["TAIL_SPLIT"])


def variants_at(bases, M, N, K, sms):
    """{name: (config, split count)}: each base plain, plus each TAIL_SPLIT whose plan splits here
    and differs from a smaller TAIL_SPLIT's plan."""
    out = {}
    for name, (cfg, tail_splits) in bases.items():
        out[name] = (cfg, 1)
        seen = {1}
        for ts in tail_splits:
            c = {**cfg, "TAIL_SPLIT": ts}
            s = _splits(c, M, N, K, sms)
            if s not in seen:
                seen.add(s)
                out[f"{name}_ts{ts}"] = (c, s)
    return out


def _operands(M, N, K, dtype, seed=0):
    gen = torch.Generator(device=_device()).manual_seed(seed)
    x = torch.randn(M, K, device=_device(), dtype=torch.bfloat16, generator=gen)
    w_bf16 = (torch.randn(N, K, device=_device(), generator=gen) * K**-0.5).to(torch.bfloat16)
    a, a_scale = reference.quantize_per_token(x, dtype)
    w, w_scale = reference.quantize_per_channel(w_bf16, dtype)
    return x, w_bf16, a, a_scale, w, w_scale


# ---------------------------------------------------------------------------------------------- compile pool


def compile_shape(cfg, splits, sms):
    """A small (M, N, K) whose tail plan gives ``splits`` for ``cfg`` on ``sms`` SMs (the compiled
    binary depends on the split count, not on M, N or K beyond their divisibility by 16)."""
    bm, bn, bk, programs = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], _programs(cfg, sms)
    if splits == 1:
        tiles, K = programs, 4 * bk  # whole waves: no tail
    else:
        tiles, K = programs // splits, bk * max(splits, 4)  # a tail of programs // splits tiles
    M, N = bm, tiles * bn
    got = gemm_tma.tail_split_plan(M, N, K, bm, bn, bk, programs, cfg["TAIL_SPLIT"])
    if got != splits:
        raise ValueError(f"compile shape {M}x{N}x{K} plans {got} splits, wanted {splits}")
    return M, N, K


def _compile_worker(job):
    """Compile one (dtype, config, splits) by running it once: the binary lands in triton's
    on-disk cache, where the timing process finds it under the same key."""
    dtype_name, config, splits, sms = job
    dtype = FP8 if dtype_name == "fp8" else torch.int8
    t = time.time()
    try:
        M, N, K = compile_shape(config, splits, sms) if splits else (256, 512, 512)
        _, _, a, sa, w, sw = _operands(M, N, K, dtype)
        gemm.scaled_mm(a, w, sa, sw, None, "none", torch.bfloat16, config=config, kernel="persistent")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"dtype": dtype_name, "config": config, "splits": splits, "s": time.time() - t}
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a result here
        return {"dtype": dtype_name, "config": config, "splits": splits, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def precompile(jobs, workers, timeout):
    import multiprocessing as mp

    t = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        results = pool.map_async(_compile_worker, jobs, chunksize=1).get(timeout=timeout)
    errors = [r for r in results if "error" in r]
    print(f"precompiled {len(jobs)} kernels with {workers} workers in {time.time() - t:.1f}s"
          + (f", {len(errors)} failed: {errors}" if errors else ""), flush=True)
    return {"seconds": time.time() - t, "jobs": len(jobs), "results": results}


# ---------------------------------------------------------------------------------------------- timing


def _wall_ms(fn):
    """CPU smoke-run timer (no CUDA graphs)."""
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def graph_timer(fn):
    """bench_graph_ms with about 3 ms of the op per graph replay (2..10 calls), 7 replays."""
    return adaptive_graph_ms(fn, target_ms=3.0, replays=7)


def _rel_err(out, ref32):
    return ((out.float() - ref32).norm() / ref32.norm().clamp_min(1e-30)).item()


def _arrivals_zero():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return all(not bool(arrivals.any()) for _, arrivals in gemm_tma._SPLIT_WORKSPACE.values())


# ---------------------------------------------------------------------------------------------- one point


def run_point(M, N, K, bases, timer, deadline, sms, autos, rounds=3, int_mm=True):
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
            if not int_mm and dtype == torch.int8:
                raise RuntimeError("not timed in this round")
            base()
            fns[name] = (None, base)
            rows[name] = {"op": name, "dtype": dtype_name}
        except Exception as e:  # noqa: BLE001 - e.g. no _scaled_mm on the CPU smoke run
            errors.append({"op": name, "error": f"{type(e).__name__}: {str(e)[:200]}"})
        ref32 = reference.scaled_mm(a, w, sa, sw, None, "none", torch.float32)
        ref16 = ref32.to(torch.bfloat16) if dtype == torch.int8 else None
        variants = ([("auto", (None, None))] + [(name, (None, None)) for name in autos]
                    + list(variants_at(bases[dtype], M, N, K, sms).items()))
        for cand, (cfg, splits) in variants:
            if left(deadline) < 15:
                errors.append({"op": f"{dtype_name}_{cand}", "error": "skipped: deadline"})
                continue
            op = f"{dtype_name}_{cand}"
            out = torch.full((M, N), float("nan"), device=a.device, dtype=torch.bfloat16)

            def call(a=a, w=w, sa=sa, sw=sw, cfg=cfg, out=out):
                return gemm.scaled_mm(a, w, sa, sw, None, "none", torch.bfloat16, config=cfg, out=out,
                                      kernel="auto" if cfg is None else "persistent")
            fn = (lambda call=call, tuner_set=autos[cand]: tuner_set(call)) if cand in autos else call
            t_first = time.time()
            try:
                got = fn().clone()
                again = fn()
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a config that does not compile/launch is a result here
                errors.append({"op": op, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"  {op}: ERROR {errors[-1]['error'][:160]}", flush=True)
                continue
            err = _rel_err(got, ref32)
            row = {"op": op, "dtype": dtype_name, "config": cfg or "autotuned", "splits": splits, "rel_err": err,
                   "nan": bool(got.isnan().any()), "repeat_equal": bool(torch.equal(got, again)),
                   "arrivals_zero": _arrivals_zero(), "first_call_s": time.time() - t_first}
            if ref16 is not None:
                row["equal_ref_bf16"] = bool(torch.equal(got, ref16))
            ok = (not row["nan"] and err < TOLERANCE[dtype] and row["repeat_equal"] and row["arrivals_zero"]
                  and row.get("equal_ref_bf16", True))
            row["check_ok"] = ok
            rows[op] = row
            del got, again
            if ok:
                fns[op] = (dtype_name, fn)
            else:
                print(f"  {op}: CHECK FAILED {row}", flush=True)
        del ref32, ref16
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    for _ in range(rounds):  # interleaved rounds: every op once per round
        for op in fns:
            if left(deadline) < 10:
                break
            try:
                rows[op].setdefault("ms_rounds", []).append(timer(fns[op][1]))
            except Exception as e:  # noqa: BLE001 - keep the other ops' numbers
                rows[op]["time_error"] = f"{type(e).__name__}: {str(e)[:200]}"
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
        base = r["op"].rsplit("_ts", 1)[0] if "_ts" in r["op"] else None
        if base and ms.get(base):
            r["x_plain"] = ms[base] / r["ms"]  # speed-up of the split over the same config unsplit


def summarize(rows):
    """Per point: baselines, ours auto and best per dtype, with the target ratios."""
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
            split = [r for r in ours if "_ts" in r["op"]]
            if split:
                bs = min(split, key=lambda r: r["ms"])
                s[f"{dtype_name}_best_split"] = bs["op"]
                s[f"{dtype_name}_best_split_us"] = bs["ms"] * 1e3
                s[f"{dtype_name}_best_split_{ratio}"] = bs.get(ratio)
                s[f"{dtype_name}_best_split_x_plain"] = bs.get("x_plain")
            if auto:
                s[f"{dtype_name}_auto_us"] = auto["ms"] * 1e3
                s[f"{dtype_name}_auto_{ratio}"] = auto.get(ratio)
        out.append(s)
    return out


def print_summary(summary):
    print("\n    M      N x K      bf16  _sm_fast | fp8 auto (x_sm)   best (x_sm) name                        | "
          "int8 auto (x_bf16)  best (x_bf16) name", flush=True)
    for s in summary:
        def f(key, fmt="{:7.1f}"):
            v = s.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else "      -"
        print(f"{s['M']:5d} {s['N']:6d}x{s['K']:<6d} {f('bf16_F.linear_us')} {f('torch._scaled_mm_fast_us')} | "
              f"{f('fp8_auto_us')} ({f('fp8_auto_x_scaled_mm_fast', '{:.3f}')}) "
              f"{f('fp8_best_us')} ({f('fp8_best_x_scaled_mm_fast', '{:.3f}')}) {s.get('fp8_best', '-'):34s} | "
              f"{f('int8_auto_us')} ({f('int8_auto_x_bf16', '{:.3f}')}) "
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


def _jobs(bases, points, sms, proposed):
    """Unique (dtype, config, splits) compile jobs: every variant at every point, the proposed set's
    split configs at every point, and the shipped autotune set."""
    jobs, seen = [], set()
    for dtype_name, dtype in (("fp8", FP8), ("int8", torch.int8)):
        for M, N, K in points:
            todo = list(variants_at(bases[dtype], M, N, K, sms).values())
            for c in proposed:
                cfg = config_dict(c)
                if cfg["TAIL_SPLIT"] > 1 and (dtype == torch.int8 or cfg["CTAS_PER_SM"] == 1):
                    todo.append((cfg, _splits(cfg, M, N, K, sms)))
            for cfg, splits in todo:
                key = (dtype_name, json.dumps(cfg, sort_keys=True), splits)
                if key not in seen:
                    seen.add(key)
                    jobs.append((dtype_name, cfg, splits, sms))
        for c in gemm_tma.PERSISTENT_CONFIGS:
            if dtype == torch.int8 or c.kwargs.get("CTAS_PER_SM", 1) == 1:
                cfg = {"TAIL_SPLIT": 1, **config_dict(c)}
                key = (dtype_name, json.dumps(cfg, sort_keys=True), 1)
                if key not in seen:
                    seen.add(key)
                    jobs.append((dtype_name, cfg, None, sms))
    return jobs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=240.0)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter dry run on tiny shapes")
    parser.add_argument("--workers", type=int, default=0, help="compile processes (0: from the CPU count)")
    parser.add_argument("--round", type=int, default=1, choices=(1, 2),
                        help="1: split-tail variants at 12 points; 2: the FP8 large-M pool vs the old rule at M 4096/16384")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = environment_metadata()
    meta["timer"] = ("bench_graph_ms (CUDA-graph replay, L2 flushed before each call, 2-10 calls per graph, "
                     "7 replays); median of 3 interleaved rounds for every op")
    meta["deadline_s"] = args.deadline
    print(meta, flush=True)
    result = {"meta": meta, "rows": [], "errors": []}

    def save():
        result["elapsed_s"] = time.time() - T0
        name = "gemm_s5.json" if args.round == 1 else f"gemm_s5_round{args.round}.json"
        Path(out, name).write_text(json.dumps(result, indent=1, default=str))

    if args.smoke:
        sms = gemm_tma.INTERPRETER_NUM_SMS
        bases, timer, workers = SMOKE_BASES, _wall_ms, 2
        # 64x64 tiles on 3 (6) programs: 4 tiles = 1 wave + 1 (3 slices at TAIL_SPLIT 4); 6 tiles.
        points = [(256, 64, 256), (128, 192, 128)]
    else:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        bases, timer = BASES, graph_timer
        points = POINTS
        workers = args.workers or max(2, min(14, (os.cpu_count() or 4) - 2))
    meta["sms"] = sms
    if args.round == 1:
        autos = {"auto_s5": AutotuneSet(proposed_configs(gemm_tma.PERSISTENT_CONFIGS))}
        rounds, int_mm = 3, True
    else:
        autos = {"auto_q4pool": AutotuneSet(gemm_tma.PERSISTENT_CONFIGS, prune=q4_pool_prune)}
        rounds, int_mm = 5, False
        if not args.smoke:
            bases, points = ROUND2_BASES, ROUND2_POINTS
    meta["round"] = args.round
    jobs = _jobs(bases, points, sms, [c for tuner_set in autos.values() for c in tuner_set.configs])
    if args.smoke:
        jobs = jobs[:3]
    try:
        result["precompile"] = precompile(jobs, workers, timeout=max(10.0, min(100.0, left(args.deadline) - 120)))
    except Exception:  # noqa: BLE001 - compiling in the timing process instead is only slower
        traceback.print_exc()
        result["precompile"] = {"error": traceback.format_exc()}
    save()

    for M, N, K in points:
        if left(args.deadline) < 25:
            print(f"deadline: skipping M={M} {N}x{K}", flush=True)
            result["errors"].append({"point": [M, N, K], "error": "skipped: deadline"})
            continue
        t = time.time()
        try:
            rows, errors = run_point(M, N, K, bases, timer, args.deadline, sms, autos, rounds=rounds, int_mm=int_mm)
        except Exception:  # noqa: BLE001 - report and go on to the next point
            traceback.print_exc()
            result["errors"].append({"point": [M, N, K], "error": traceback.format_exc()})
            save()
            continue
        result["rows"] += rows
        result["errors"] += [{"point": [M, N, K], **e} for e in errors]
        for r in rows:
            if r.get("ms"):
                extra = "".join(f" {k}={r[k]:.3f}" for k in ("x_bf16", "x_scaled_mm_fast", "x_int_mm", "x_plain")
                                if k in r)
                err = f" err={r['rel_err']:.1e}" if "rel_err" in r else ""
                samples = "/".join(f"{v * 1e3:.1f}" for v in r["ms_rounds"])
                print(f"M={M} {N}x{K} {r['op']:38s} {r['ms'] * 1e3:8.1f} us [{samples}]{extra}{err}", flush=True)
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
