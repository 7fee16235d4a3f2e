"""GEMM benchmarks: quantkit's fused INT8/FP8 GEMMs against cuBLAS-backed torch baselines.

Every baseline does the same math as the fused kernel, unfused:
- bf16 ``F.linear`` (cuBLAS; bias folded into the GEMM by torch) + activation,
- FP8 ``torch._scaled_mm`` rowwise scales (dequant inside cuBLAS) + bias + activation,
- INT8 ``torch._int_mm`` (int32 out) + dequant + bias + activation. ``_int_mm`` refuses M <= 16,
  so there the INT8 rows have no ``_int_mm`` ratio (their bf16 ratio stands).

Timing: CUDA-graph replays with the L2 flushed before every call (``bench_graph_ms`` /
``adaptive_graph_ms``), so each call reads its weight from memory (the decode case), without the
eager launch's host time; every point's ops in rotating order over ``rounds`` rounds, medians.
Results: one row per (op, shape, M, epilogue) with time, TFLOP/s and ratios, written to CSV and
JSON with the GPU name, torch/triton versions, commit and date, plus a PNG of TFLOP/s vs M.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from quantkit.bench.common import (CheckFailed, bench_ms, environment_metadata, require_matplotlib, require_within,
                                   write_rows)
from quantkit.bench.common import rel_err as _rel_err  # the name this module's users import
from quantkit.kernels import gemm, gemm_gluon, gemm_tma, reference, triton_ops
from quantkit.kernels.launch import median_replay_ms, rotated_medians

# Llama-3-8B projections (N, K): qkv, o, gate+up (stacked), down.
LLAMA3_8B_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
DEFAULT_MS = [1, 16, 64, 128, 512, 1024, 4096, 16384]
# Llama-3-8B's MLP front half for the gated GEMM: [gate; up] = 2 x 14336 rows over K=4096.
GATED_SHAPE = (14336, 4096)
# "plain": dequant only (Llama's projections); "bias_silu": the full epilogue.
EPILOGUES = {"plain": (False, "none"), "bias_silu": (True, "silu")}
# Where the GEMM is also timed with the bf16 input's per-token quantization in front of it.
QUANTIZE_ROW_EPILOGUES = ("plain",)


def checked_rel_err(what: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, K: int) -> float:
    """Relative error of ``out`` against the fp32 reference; CheckFailed above the dtype's bound."""
    return require_within(what, _rel_err(out, ref), output_bound(dtype, K))


_FLUSH_BYTES = 256 << 20


def bench_graph_ms(fn, reps: int = 10, replays: int = 15) -> float:
    """Milliseconds per call of ``fn`` replayed from a CUDA graph, with a cold L2 each call.

    The graph holds ``reps`` x (L2 flush, fn); a second graph holds the flushes alone, and the
    difference is fn's GPU time. This removes the eager Python/launch overhead (decode runs
    inside CUDA graphs) while every call still reads its operands from memory, like do_bench.
    """
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()  # autotune / compile outside the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        flush.zero_()
    torch.cuda.current_stream().wait_stream(side)
    graphs = {}
    for name, with_fn in (("flush", False), ("both", True)):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        graphs[name] = graph
    times = {name: median_replay_ms(graph, replays) for name, graph in graphs.items()}
    del graphs
    return max(times["both"] - times["flush"], 1e-6) / reps


def adaptive_graph_ms(fn, target_ms: float = 5.0, replays: int = 15) -> float:
    """``bench_graph_ms`` with the calls per graph scaled to the op (2..10, about ``target_ms`` of
    it per replay): the same timer, a shorter run for the 5-15 ms ops at M=16384."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(2, min(10, round(target_ms / max(start.elapsed_time(end), 1e-3))))
    return bench_graph_ms(fn, reps=reps, replays=replays)


def _activation(x, activation):
    return reference.apply_activation(x, activation)


def _bf16_operands(M, N, K, device, seed=0):
    """The point's bf16 activation (M, K), weight (N, K) and bias (N,), seeded."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=gen)
    w_bf16 = (torch.randn(N, K, device=device, dtype=torch.bfloat16, generator=gen) * K**-0.5).to(torch.bfloat16)
    bias = torch.randn(N, device=device, dtype=torch.bfloat16, generator=gen) * 0.1
    return x, w_bf16, bias


def _quantized(x, w_bf16, dtype):
    """(a, a_scale, w, w_scale): x per token and the weight per channel in ``dtype``."""
    a, a_scale = reference.quantize_per_token(x, dtype)
    w, w_scale = reference.quantize_per_channel(w_bf16, dtype)
    return a, a_scale, w, w_scale


def _make_operands(M, N, K, dtype, device, seed=0):
    x, w_bf16, bias = _bf16_operands(M, N, K, device, seed)
    return (x, w_bf16, bias) + _quantized(x, w_bf16, dtype)


def _tflops(M, N, K, ms):
    return 2.0 * M * N * K / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


ROUNDS = 3  # timing rounds per point (launch.rotated_medians)


def bench_scaled_mm_point(M, N, K, epilogue, device="cuda", timer=bench_ms, rounds: int = ROUNDS) -> list[dict]:
    """Time quantkit FP8/INT8 and the three baselines at one (M, N, K, epilogue), in rotated rounds."""
    has_bias, activation = EPILOGUES[epilogue]
    x, w_bf16, bias = _bf16_operands(M, N, K, device)
    bias_arg = bias if has_bias else None
    ops = {"bf16_F.linear": lambda: _activation(F.linear(x, w_bf16, bias_arg), activation)}
    ours_of, baseline_of, checks = {}, {}, {}

    for dtype_name, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        a, a_scale, w, w_scale = _quantized(x, w_bf16, dtype)
        w_t = w.t()
        a_scale_col, w_scale_row = a_scale.view(-1, 1), w_scale.view(1, -1)

        def ours(a=a, w=w, a_scale=a_scale, w_scale=w_scale):
            return triton_ops.scaled_mm(a, w, a_scale, w_scale, bias_arg, activation, torch.bfloat16)

        if dtype == torch.float8_e4m3fn:
            # Like for like: quantkit's default FP8 mode is fast accumulation (gemm.py), so the
            # baseline is cuBLAS's fast-accumulation mode; the promoted mode is timed as well.
            def scaled(fast_accum, a=a, w_t=w_t, a_scale_col=a_scale_col, w_scale_row=w_scale_row):
                out = torch._scaled_mm(a, w_t, scale_a=a_scale_col, scale_b=w_scale_row, out_dtype=torch.bfloat16,
                                       use_fast_accum=fast_accum)
                if has_bias:
                    out = out + bias
                return _activation(out, activation)

            baseline_name = "torch._scaled_mm_rowwise_fast_accum+epilogue"
            ops["torch._scaled_mm_rowwise_promoted+epilogue"] = lambda scaled=scaled: scaled(False)
            ops[baseline_name] = lambda scaled=scaled: scaled(True)
        else:
            def int_mm(a=a, w_t=w_t, a_scale_col=a_scale_col, w_scale_row=w_scale_row):
                acc = torch._int_mm(a, w_t)
                out = acc.float() * a_scale_col * w_scale_row
                if has_bias:
                    out = out + bias.float()
                return _activation(out, activation).to(torch.bfloat16)

            baseline_name = "torch._int_mm+epilogue"
            if M > 16:  # _int_mm's own restriction
                ops[baseline_name] = int_mm
        ops[f"quantkit_{dtype_name}"] = ours
        if epilogue in QUANTIZE_ROW_EPILOGUES:
            # What a QuantLinear whose input is not quantized by the norm before it (o_proj,
            # down_proj) runs on the bf16 input: the per-token quantization kernel, then the GEMM.
            def quantize_then_ours(w=w, w_scale=w_scale, dtype=dtype):
                q, q_scale = triton_ops.quantize_per_token(x, dtype)
                return triton_ops.scaled_mm(q, w, q_scale, w_scale, bias_arg, activation, torch.bfloat16)

            ops[f"quantkit_{dtype_name}+quantize"] = quantize_then_ours
        ours_of[dtype_name], baseline_of[dtype_name] = ours, baseline_name
        checks[dtype_name] = (a, w, a_scale, w_scale)

    ms, _ = rotated_medians(ops, timer, rounds)
    base = {"M": M, "N": N, "K": K, "epilogue": epilogue}
    rows = [{**base, "op": name, "ms": t, "tflops": _tflops(M, N, K, t)} for name, t in ms.items()
            if not name.startswith("quantkit_")]
    for dtype_name, ours in ours_of.items():
        a, w, a_scale, w_scale = checks[dtype_name]
        t_ours, t_base = ms[f"quantkit_{dtype_name}"], ms.get(baseline_of[dtype_name], float("nan"))
        # The autotuner's pick at this very shape (tuned inside the timing, as in every run),
        # checked against the reference twin before its time is reported.
        rel_err = checked_rel_err(f"quantkit_{dtype_name} at M={M} N={N} K={K} {epilogue}", ours(),
                                  reference.scaled_mm(a, w, a_scale, w_scale, bias_arg, activation, torch.float32),
                                  a.dtype, K)
        rows.append({
            **base, "op": f"quantkit_{dtype_name}", "ms": t_ours, "tflops": _tflops(M, N, K, t_ours), "rel_err": rel_err,
            "baseline": baseline_of[dtype_name], "baseline_ms": t_base, "speedup_vs_baseline": t_base / t_ours,
            "speedup_vs_bf16": ms["bf16_F.linear"] / t_ours,
        })
        with_quant = f"quantkit_{dtype_name}+quantize"
        if with_quant in ms:
            t = ms[with_quant]
            rows.append({**base, "op": with_quant, "ms": t, "tflops": _tflops(M, N, K, t),
                         "speedup_vs_bf16": ms["bf16_F.linear"] / t})
    return rows


def bench_gated_point(M, N, K, dtype_name, activation="silu", device="cuda", timer=bench_ms,
                      rounds: int = ROUNDS) -> list[dict]:
    """Fused gated GEMM (N output columns from a 2N x K weight) vs two GEMMs + elementwise, in rotated rounds."""
    dtype = torch.float8_e4m3fn if dtype_name == "fp8" else torch.int8
    x, w_bf16, _, a, a_scale, w, w_scale = _make_operands(M, 2 * N, K, dtype, device)
    w_gate, w_up = w[:N], w[N:]
    s_gate, s_up = w_scale[:N], w_scale[N:]

    def fused():
        return triton_ops.gated_scaled_mm(a, w, a_scale, w_scale, activation, torch.bfloat16)

    def two_gemms():
        gate = triton_ops.scaled_mm(a, w_gate, a_scale, s_gate, None, activation, torch.bfloat16)
        up = triton_ops.scaled_mm(a, w_up, a_scale, s_up, None, "none", torch.bfloat16)
        return gate * up

    def bf16_two_gemms():
        gate, up = F.linear(x, w_bf16).chunk(2, dim=-1)
        return _activation(gate, activation) * up

    ms, _ = rotated_medians({"fused": fused, "two": two_gemms, "bf16": bf16_two_gemms}, timer, rounds)
    t_fused, t_two, t_bf16 = ms["fused"], ms["two"], ms["bf16"]
    rel_err = checked_rel_err(f"quantkit_gated_{dtype_name} at M={M} N={N} K={K}", fused(),
                              reference.gated_scaled_mm(a, w, a_scale, w_scale, activation, torch.float32), dtype, K)
    flops_k = 2 * N  # the GEMM is M x 2N x K
    base = {"M": M, "N": N, "K": K, "epilogue": f"gated_{activation}", "dtype": dtype_name}
    return [
        {**base, "op": f"quantkit_gated_{dtype_name}", "ms": t_fused, "tflops": _tflops(M, flops_k, K, t_fused),
         "rel_err": rel_err,
         "baseline": "quantkit 2 GEMMs + act*mul", "baseline_ms": t_two, "speedup_vs_baseline": t_two / t_fused,
         "speedup_vs_bf16": t_bf16 / t_fused},
        {**base, "op": f"two_gemms_{dtype_name}", "ms": t_two, "tflops": _tflops(M, flops_k, K, t_two)},
        {**base, "op": "bf16_gate_up+act*mul", "ms": t_bf16, "tflops": _tflops(M, flops_k, K, t_bf16)},
    ]


def autotune_choices() -> dict:
    """The autotuner's pick per key, to record which configs won."""
    picks = {}
    # launch_persistent calls _autotuned(gated) positionally: the same lru_cache entries.
    for name, tuner in (("tiled", gemm._scaled_mm_autotuned), ("persistent", gemm_tma._autotuned(False)),
                        ("persistent_gated", gemm_tma._autotuned(True))):
        picks.update({f"{name} {key}": str(cfg) for key, cfg in getattr(tuner, "cache", {}).items()})
    # The launchers' own record (what later calls launch), keyed by their tuning keys.
    picks.update({f"persistent_tuned {key}": str(cfg) for key, cfg in gemm_tma._TUNED.items()})
    # The Gluon kernel's picks (by candidate name), with every candidate's time on the tuning call.
    for key, cfg in gemm_gluon._TUNED.items():
        times = gemm_gluon.TUNE_TIMES.get(key)
        picks[f"gluon_tuned {key}"] = f"{min(times, key=times.get)} from {times}" if times else cfg.name
    return picks


def write_results(rows: list[dict], out_dir, name: str, meta: dict) -> tuple[Path, Path]:
    return write_rows(out_dir, name, rows, meta, lead=("op", "M", "N", "K", "epilogue"))


def plot_tflops(rows: list[dict], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["N"], r["K"]) for r in rows})
    # One colour per op, one line style per epilogue: no two lines look alike.
    ops = sorted({r["op"] for r in rows})
    colours = {op: plt.get_cmap("tab20")(i % 20) for i, op in enumerate(ops)}
    styles = dict(zip(sorted({r["epilogue"] for r in rows}), ("-", "--", ":", "-.")))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, (N, K) in zip(axes[0], shapes):
        for epilogue, style in styles.items():
            for op in ops:
                pts = sorted((r["M"], r["tflops"]) for r in rows
                             if (r["N"], r["K"], r["op"], r["epilogue"]) == (N, K, op, epilogue)
                             and not math.isnan(r["tflops"]))
                if pts:
                    ax.plot(*zip(*pts), style, color=colours[op], marker="o", ms=3, label=f"{op} [{epilogue}]")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"N={N} K={K}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def point_seconds(M: int, N: int, K: int, ops: int, replays: int = 16, rounds: int = ROUNDS) -> float:
    """Rough GPU seconds of timing ``ops`` ops of one (M, N, K) point with ``adaptive_graph_ms`` in
    ``rounds`` rounds: two graphs (op + flush, flush) x ``replays`` x at least ~5 ms, at ~400 TFLOP/s
    on average over bf16, FP8, INT8 and the unfused baselines, plus ~60 ms of capture per op."""
    op_ms = 2.0 * M * N * K / 400e12 * 1e3 + 0.1
    per_replay_ms = max(5.0, 2 * op_ms)  # at least 2 calls per graph
    return rounds * ops * (2 * replays * per_replay_ms * 1e-3 + 0.06)


def timed_ops(epilogues) -> int:
    """Ops timed per (M, N, K) over ``epilogues``: quantkit FP8 and INT8, bf16, two ``_scaled_mm``
    modes and ``_int_mm``, plus quantization + GEMM for FP8 and INT8 where that row is timed."""
    return sum(6 + 2 * (epilogue in QUANTIZE_ROW_EPILOGUES) for epilogue in epilogues)


def _time_left(deadline_at):
    return float("inf") if deadline_at is None else deadline_at - time.monotonic()


def run_gemm_benchmark(shapes=None, ms=None, out_dir="benchmarks/results", plot=True,
                       epilogues=("plain", "bias_silu"), gated=True, timer=bench_graph_ms, device="cuda",
                       deadline_at=None, rounds: int = ROUNDS) -> list[dict]:
    """Benchmark quantkit's GEMMs on the current GPU; writes gemm.csv/.json (+ gemm.png).

    shapes: list of (N, K), default Llama-3-8B's projections; ms: list of M values. Each point's ops
    are timed in ``rounds`` rounds of rotated order (``rotated_medians``), medians reported.
    ``deadline_at`` (a ``time.monotonic()`` value): points whose estimated time (``point_seconds``,
    x 1.5) no longer fits are skipped and listed in the JSON's meta; the results written are complete
    for every point timed. Returns the rows written.
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("the GEMM benchmark needs a CUDA GPU; run it on the GPU machine")
    shapes = list(shapes or LLAMA3_8B_SHAPES)
    ms = list(ms or DEFAULT_MS)
    if plot:
        require_matplotlib()
    meta = environment_metadata()
    meta["timer"] = getattr(timer, "__name__", str(timer))
    meta["rounds"] = rounds
    meta["ms"], meta["shapes"] = ms, [list(shape) for shape in shapes]
    meta["skipped_for_deadline"] = skipped = []
    # False until every point is written: a run cut short (an error, the device's time limit)
    # leaves files that say so. The previous run's plot goes first, so no stale PNG sits beside them.
    meta["complete"] = False
    Path(out_dir, "gemm.png").unlink(missing_ok=True)
    rows = []

    def fits(what, seconds):
        if _time_left(deadline_at) >= 1.5 * seconds + 5:
            return True
        skipped.append(what)
        print(f"deadline: skipping {what}", flush=True)
        return False

    if gated:
        N_gated, K_gated = GATED_SHAPE
        for M in ms:
            if not fits(f"gated M={M}", 2 * point_seconds(M, 2 * N_gated, K_gated, 3, rounds=rounds)):
                continue
            for dtype_name in ("fp8", "int8"):
                rows.extend(bench_gated_point(M, N_gated, K_gated, dtype_name, timer=timer, device=device,
                                              rounds=rounds))
            r = [x for x in rows if x["op"].startswith("quantkit_gated") and x["M"] == M]
            print("gated M=%d " % M + " ".join(f"{x['op']}: {x['ms']*1e3:.1f}us x{x['speedup_vs_baseline']:.2f} vs 2 GEMMs"
                                                f" x{x['speedup_vs_bf16']:.2f} vs bf16 err {x['rel_err']:.1e}"
                                                for x in r), flush=True)
        write_results(rows, out_dir, "gemm", meta)
    for N, K in shapes:
        for M in ms:
            if not fits(f"M={M} N={N} K={K}", point_seconds(M, N, K, timed_ops(epilogues), rounds=rounds)):
                continue
            for epilogue in epilogues:
                rows.extend(bench_scaled_mm_point(M, N, K, epilogue, timer=timer, device=device, rounds=rounds))
            print_point(rows, M, N, K)
            write_results(rows, out_dir, "gemm", meta)  # partial results survive a time-out
    meta["autotune"] = autotune_choices()
    meta["complete"] = True
    write_results(rows, out_dir, "gemm", meta)
    if plot:
        plot_tflops([r for r in rows if not r["epilogue"].startswith("gated")], Path(out_dir) / "gemm.png",
                    f"quantkit W8A8 GEMM vs torch, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
                    f"commit {meta['commit'][:12]}, {meta['date'][:10]}")
    return rows


def run_all(out_dir="benchmarks/results", timer=adaptive_graph_ms, rounds: int = ROUNDS) -> list[dict]:
    """``quantkit bench gemm``: what benchmarks/gemm.py runs, in one process. The GPU checks
    first (gemm_checks.json; CheckFailed / RuntimeError stops the run), then the quantization
    kernels (gemm_quant.*), then the GEMMs (gemm.*), then the issue's targets read from their
    rows (gemm_targets.json, and a table on stdout)."""
    from quantkit.bench.gemm_targets import write_targets
    from quantkit.bench.quant import run_quant_benchmark

    if not torch.cuda.is_available():
        raise ValueError("the GEMM benchmark needs a CUDA GPU; run it on the GPU machine")
    require_matplotlib()
    checks = run_gpu_checks()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_checks.json").write_text(json.dumps(checks, indent=1, default=str))
    quant_rows = run_quant_benchmark(out_dir=out, timer=timer)
    rows = run_gemm_benchmark(out_dir=out, timer=timer, rounds=rounds)
    write_targets(out, rows, quant_rows)
    return rows


def print_point(rows, M, N, K):
    for r in rows:
        if (r["M"], r["N"], r["K"]) != (M, N, K) or not r["op"].startswith("quantkit"):
            continue
        if "baseline" not in r:  # quantization + GEMM: against bf16 only
            print(f"M={M:5d} N={N:5d} K={K:5d} {r['epilogue']:9s} {r['op']:23s} {r['ms']*1e3:9.1f}us "
                  f"x{r['speedup_vs_bf16']:.2f} vs bf16", flush=True)
        else:
            print(f"M={M:5d} N={N:5d} K={K:5d} {r['epilogue']:9s} {r['op']:14s} {r['ms']*1e3:9.1f}us "
                  f"{r['tflops']:7.1f} TFLOP/s  x{r['speedup_vs_baseline']:.2f} vs {r['baseline']}, err {r['rel_err']:.1e} "
                  f"x{r['speedup_vs_bf16']:.2f} vs bf16", flush=True)


# ----------------------------------------------------------------------------------------------
# GPU correctness checks at real shapes (run before the timings, in the same process)
# ----------------------------------------------------------------------------------------------


EXACT_ACCUM_BOUND = 4e-3  # INT8 (exact int32 accumulation) and promoted FP8: bf16 output rounding


def output_bound(dtype: torch.dtype, K: int) -> float:
    """The relative-error bound of a GEMM output of ``dtype`` operands over ``K``."""
    return EXACT_ACCUM_BOUND if dtype == torch.int8 else fp8_fast_accum_tolerance(K)


def fp8_fast_accum_tolerance(K: int) -> float:
    """Relative-error bound for FP8 outputs with fast accumulation (the default).

    Hopper's FP8 wgmma accumulates with reduced precision, so the error against the fp32
    reference grows with K (H100, session 4: 2.1e-3 at K=4096, 3.3e-3 at K=14336 for one GEMM;
    4.8e-3 for the gated product at K=14336 in session 5): 4e-3 at K <= 4096, growing as sqrt(K).
    INT8 and promoted FP8 stay at the tight bounds.
    """
    return 4e-3 * max(1.0, (K / 4096) ** 0.5)


def _grid_steps(q, ref_q):
    """How many representable values apart two quantized tensors are, elementwise."""
    if q.dtype == torch.int8:
        return (q.int() - ref_q.int()).abs()
    # e4m3fn bit patterns are ordered like the values within one sign: compare as sign-magnitude.
    def ordinal(t):
        bits = t.view(torch.uint8).int()
        return torch.where(bits >= 128, -(bits - 128), bits)
    return (ordinal(q) - ordinal(ref_q)).abs()


# The split-K checks compile every pool split config five times (14 configs since session 38), the
# promoted-FP8 checks every decode config once (22): each in three parts (configs[i::3]), so the
# standard run's check workers finish beside its compile jobs (the promoted checks in one part took
# ~100 s on the H200).
SPLIT_K_PARTS = tuple(f"configs_split_k{i}" for i in range(3))
PROMOTED_PARTS = tuple(f"configs_promoted{i}" for i in range(3))
CHECK_PARTS = ("grid", "configs_int8", "configs_fp8", *SPLIT_K_PARTS, *PROMOTED_PARTS, "compile")


def run_gpu_checks(all_configs=True, device="cuda", small=False, parts=CHECK_PARTS) -> list[dict]:
    """Poisoned outputs, every epilogue, both dtypes, vs the reference twin and float64.

    Raises RuntimeError on the first failure (so a broken kernel never gets benchmarked).
    Also compiles a small quantize -> GEMM module with torch.compile(fullgraph=True) and
    replays it inside a CUDA graph. ``parts`` (of CHECK_PARTS: the epilogue/shape grid with the
    quantization kernels, every autotune config for INT8 / FP8, every small-M split-K config
    (``gemm_splitk.run_split_k_checks``) and every decode config in the promoted FP8 mode
    (``gemm_splitk.run_promoted_checks``), each in three shares, torch.compile + CUDA graph) lets separate processes run
    them side by side.
    """
    from quantkit.kernels import quant

    results = []
    gemm_shapes = ((1, 4096, 4096), (13, 1000, 4112), (257, 4096, 14336), (4096, 6144, 4096))
    quant_shapes = ((1, 4096), (257, 14336), (4096, 4096), (3, 20000))
    if small:  # a dry run of this code under the CPU interpreter
        gemm_shapes, quant_shapes = ((1, 64, 64), (13, 64, 80)), ((3, 300), (2, 17000))

    def record(name, ok, **info):
        results.append({"check": name, "ok": bool(ok), **info})
        print(f"[{'ok' if ok else 'FAIL'}] {name} {info}", flush=True)
        if not ok:
            raise CheckFailed(f"GPU check failed: {name} {info}")

    torch.manual_seed(0)
    # One fixed config for the epilogue grid (the autotuned path is checked at every benchmark
    # point instead): autotuning each flag combination would compile dozens of variants.
    fixed = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    for dtype in (torch.int8, torch.float8_e4m3fn) if "grid" in parts else ():
        for M, N, K in gemm_shapes:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            w_f = torch.randn(N, K, device=device) * K**-0.5
            a, sa = reference.quantize_per_token(x, dtype)
            w, sw = reference.quantize_per_channel(w_f, dtype)
            bias = torch.randn(N, device=device, dtype=torch.bfloat16)
            if dtype == torch.int8:
                acc = gemm.int8_matmul_accumulator(a, w, out=torch.full((M, N), -7, dtype=torch.int32, device=device))
                record("int8_acc_exact", torch.equal(acc, reference.int8_matmul_exact(a, w)), M=M, N=N, K=K)
            full_grid = (M, N, K) == gemm_shapes[1]
            for has_bias in (False, True) if full_grid else (True,):
                for activation in reference.ACTIVATIONS if full_grid else ("gelu",):
                    b = bias if has_bias else None
                    out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
                    gemm.scaled_mm(a, w, sa, sw, b, activation, torch.bfloat16, out=out,
                                   config=None if small else fixed)
                    ref = reference.scaled_mm(a, w, sa, sw, b, activation, torch.float32)
                    exact = reference.fp64_scaled_mm(a, w, sa, sw, b, activation)
                    err_ref, err_64 = _rel_err(out, ref), _rel_err(out, exact)
                    bound = output_bound(dtype, K)
                    record(f"scaled_mm_{dtype}", not out.isnan().any() and err_ref < bound and err_64 < bound,
                           M=M, N=N, K=K, bias=has_bias, act=activation, rel_err_ref=err_ref, rel_err_fp64=err_64,
                           bound=bound)
            w2, sw2 = reference.quantize_per_channel(torch.randn(2 * N, K, device=device) * K**-0.5, dtype)
            out = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
            gemm.gated_scaled_mm(a, w2, sa, sw2, "silu", torch.bfloat16, out=out, config=None if small else fixed)
            err = _rel_err(out, reference.gated_scaled_mm(a, w2, sa, sw2, "silu", torch.float32))
            bound = output_bound(dtype, K)
            record(f"gated_{dtype}", not out.isnan().any() and err < bound, M=M, N=N, K=K, rel_err=err, bound=bound)

        # Quantization kernels: bit-exact except RMSNorm, whose reduction order may move a value
        # across a rounding boundary (at most one step, rarely).
        for M, K in quant_shapes:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16) * 3
            q, s = quant.quantize_per_token(x, dtype, out=torch.full((M, K), 5, device=device).to(dtype),
                                            out_scale=torch.full((M,), float("nan"), device=device))
            rq, rs = reference.quantize_per_token(x, dtype)
            record(f"quantize_per_token_{dtype}", torch.equal(q.float(), rq.float()) and torch.equal(s, rs), M=M, K=K)
            st = torch.tensor([0.02], device=device)
            q = quant.quantize_per_tensor(x, st, dtype)
            record(f"quantize_per_tensor_{dtype}", torch.equal(q.float(), reference.quantize_per_tensor(x, st, dtype).float()),
                   M=M, K=K)
            if K <= quant.MAX_SINGLE_PASS_K:
                wn = torch.randn(K, device=device, dtype=torch.bfloat16)
                res = torch.randn_like(x)
                q, s, nr = quant.rms_norm_quant_per_token(x, wn, 1e-6, dtype, res, 1.0)
                rq, rs, rnr = reference.rms_norm_quant_per_token(x, wn, 1e-6, dtype, res, 1.0)
                # Reduction order (and torch's approximate rsqrt on CUDA) may move a value on a
                # rounding boundary by one step of the quantized grid, rarely; more is a bug.
                steps = _grid_steps(q, rq)
                flipped = (steps > 0).float().mean().item()
                scale_diff = ((s - rs).abs() / rs).max().item()
                record(f"rms_norm_quant_{dtype}", torch.equal(nr, rnr) and steps.max().item() <= 1
                       and flipped < 0.01 and scale_diff < 1e-5, M=M, K=K, max_steps=steps.max().item(),
                       flipped_fraction=flipped, scale_rel_diff=scale_diff)

    if all_configs:
        # Every autotune config on one masked-K shape: a config-specific indexing bug shows here.
        # Plain GEMM for int8, gated for fp8: each config compiles once per variant, and
        # compiling all four would cost minutes of device time.
        M, N, K = (37, 200, 4160) if not small else (5, 20, 48)
        for dtype, gated in ((torch.int8, False), (torch.float8_e4m3fn, True)):
            if ("configs_int8" if dtype == torch.int8 else "configs_fp8") not in parts:
                continue
            a, sa = reference.quantize_per_token(torch.randn(M, K, device=device), dtype)
            w, sw = reference.quantize_per_channel(torch.randn(N, K, device=device), dtype)
            w2, sw2 = torch.cat([w, w.flip(0)]), torch.cat([sw, sw.flip(0)])
            persistent = [] if gated else gemm_tma.PERSISTENT_CONFIGS
            # The split configs have their own checks (configs_split_k*).
            unsplit = [c for c in gemm.ALL_CONFIGS if c.kwargs.get("SPLIT_K", 1) == 1]
            for cfg in unsplit + persistent if not small else []:
                # Persistent configs carry EPILOGUE_SPLIT, which routes them to the TMA kernel.
                config = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}

                def run(out_dtype):
                    if gated:
                        return (gemm.gated_scaled_mm(a, w2, sa, sw2, "silu", out_dtype, config=config),
                                reference.gated_scaled_mm(a, w2, sa, sw2, "silu", torch.float32))
                    return (gemm.scaled_mm(a, w, sa, sw, None, "gelu_tanh", out_dtype, config=config),
                            reference.scaled_mm(a, w, sa, sw, None, "gelu_tanh", torch.float32))

                out_dtype = torch.float32
                try:
                    out, ref = run(out_dtype)
                    bound = 1e-5 if dtype == torch.int8 else fp8_fast_accum_tolerance(K)
                except triton.runtime.errors.OutOfResources:
                    # The fp32 output's staging buffer does not fit this config's shared memory (the
                    # autotuner skips it for fp32 too): check it with the bf16 output the models use,
                    # whose rounding (2**-9 relative at most) sets the bound.
                    out_dtype = torch.bfloat16
                    try:
                        out, ref = run(out_dtype)
                    except triton.runtime.errors.OutOfResources as error:
                        # Its operand pipeline alone overflows shared memory (gated: two weight
                        # tiles per stage): the autotuner skips it the same way; nothing to check.
                        results.append({"check": f"config_{dtype}_gated={gated}", "ok": True, "skipped": str(error),
                                        "config": str(cfg)})
                        print(f"[skip] config_{dtype}_gated={gated} {cfg}: {error}", flush=True)
                        continue
                    bound = output_bound(dtype, K)
                record(f"config_{dtype}_gated={gated}", _rel_err(out, ref) < bound, config=str(cfg),
                       out_dtype=str(out_dtype), rel_err=_rel_err(out, ref), bound=bound)

    from quantkit.bench.gemm_splitk import run_promoted_checks, run_split_k_checks

    for index, part in enumerate(SPLIT_K_PARTS):
        if part in parts:
            run_split_k_checks(record, device=device, small=small, share=(index, len(SPLIT_K_PARTS)))
    for index, part in enumerate(PROMOTED_PARTS):
        if part in parts:
            run_promoted_checks(record, device=device, small=small, share=(index, len(PROMOTED_PARTS)))

    # torch.compile(fullgraph=True) + CUDA graph capture of quantize -> GEMM.
    for dtype in (torch.int8, torch.float8_e4m3fn) if device == "cuda" and "compile" in parts else ():
        w, sw = reference.quantize_per_channel(torch.randn(512, 256, device=device), dtype)
        bias = torch.randn(512, device=device, dtype=torch.bfloat16)

        class TinyQuantLinear(torch.nn.Module):
            def forward(self, x):
                a, sa = triton_ops.quantize_per_token(x, dtype)
                return triton_ops.scaled_mm(a, w, sa, sw.view(-1), bias, "silu", torch.bfloat16)

        x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
        eager = TinyQuantLinear()(x)
        compiled = torch.compile(TinyQuantLinear(), fullgraph=True)(x)
        record(f"torch_compile_{dtype}", torch.equal(eager, compiled))
        static_x = x.clone()
        module = TinyQuantLinear()
        module(static_x)  # warm up (autotune) outside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            module(static_x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = module(static_x)
        new_x = torch.randn_like(x)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        record(f"cuda_graph_{dtype}", torch.equal(static_out, module(new_x)))
    return results
