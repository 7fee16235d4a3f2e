"""Does the Gluon GEMM's tuner pick by the order it times its candidates in? (session 24, one GPU run)

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_tune_bias.py --out $OUT/bias --deadline 450

``gemm_gluon.tuned_call`` times the FP8 candidates in TUNE_ROUNDS rounds whose order rotates by one
per round, so each candidate follows the same candidate in every round. Session 14
(``gemm_order.py``) measured the op before a power-capped GEMM move its time by up to 10 %. At each
point (FP8, plain epilogue):
1. ``tuner``: the tuner as shipped, --tunings times (its memo cleared in between): the pick and
   every candidate's time.
2. ``conditioned``: every candidate (``gluon_scaled_mm(config=...)``) and ``_scaled_mm`` (fast
   accumulation), each timed with the standard benchmark's timer (``adaptive_graph_ms``) right
   after --condition-ms of a conditioner: ``scaled_mm`` (what the standard benchmark times ours
   after) or ``self`` (the op itself, its own steady state). Pairs shuffled per rep, medians.
Writes gemm_tune_bias.json / .txt, rewritten after every point.
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402

from gemm_order import condition  # noqa: E402
from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.gemm import _bf16_operands, _quantized, adaptive_graph_ms  # noqa: E402
from quantkit.kernels import gemm_gluon  # noqa: E402

POINTS = [(16384, 6144, 4096), (16384, 4096, 4096), (4096, 28672, 4096), (16384, 4096, 14336)]
CONDITIONERS = ("scaled_mm", "self")


def point_ops(M: int, N: int, K: int) -> tuple[dict, tuple]:
    x, w_bf16, _ = _bf16_operands(M, N, K, "cuda")
    a, a_scale, w, w_scale = _quantized(x, w_bf16, torch.float8_e4m3fn)
    w_t, sa, sb = w.t(), a_scale.view(-1, 1), w_scale.view(1, -1)
    ops = {"scaled_mm": lambda: torch._scaled_mm(a, w_t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                                  use_fast_accum=True)}
    for name in gemm_gluon.candidates(torch.float8_e4m3fn, gated=False):
        ops[name] = lambda name=name: gemm_gluon.gluon_scaled_mm(a, w, a_scale, w_scale, config=name)
    return ops, (a, w, a_scale, w_scale)


def tunings(operands: tuple, count: int) -> list[dict]:
    """The shipped tuner ``count`` times at this point: its pick and candidate times (us) each time."""
    a, w, a_scale, w_scale = operands  # scales (M,) and (N,) fp32, as tuned_call takes them
    out = torch.empty((a.shape[0], w.shape[0]), device=a.device, dtype=torch.bfloat16)
    runs = []
    for _ in range(count):
        gemm_gluon._TUNED.clear()
        gemm_gluon.TUNE_TIMES.clear()
        gemm_gluon.tuned_call(a, w, out, a_scale, w_scale, None, "none")
        torch.cuda.synchronize()
        (_, times), = gemm_gluon.TUNE_TIMES.items()
        us = {name: t * 1e3 for name, t in times.items()}
        runs.append({"pick": min(us, key=us.get), "us": us})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tunings", type=int, default=3)
    parser.add_argument("--condition-ms", type=float, default=300.0)
    parser.add_argument("--deadline", type=float, default=450.0, help="no new point starts past this many seconds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    meta = {**environment_metadata(), "condition_ms": args.condition_ms, "reps": args.reps, "tunings": args.tunings,
            "tune_rounds": gemm_gluon.TUNE_ROUNDS}
    rng = random.Random(24)
    results, lines = [], [f"{meta.get('gpu')} torch {torch.__version__} triton {meta.get('triton')} {meta['date']}"]
    for M, N, K in POINTS:
        if time.perf_counter() - began > args.deadline:
            lines.append(f"\nskipped (deadline): {M}x{N}x{K}")
            break
        ops, operands = point_ops(M, N, K)
        for fn in ops.values():  # compile outside the timings
            fn()
        torch.cuda.synchronize()
        tuned = tunings(operands, args.tunings)
        samples = {(t, c): [] for t in ops for c in CONDITIONERS}
        for _ in range(args.reps):
            pairs = list(samples)
            rng.shuffle(pairs)
            for target, cond in pairs:
                condition(ops, target if cond == "self" else cond, args.condition_ms)
                samples[(target, cond)].append(adaptive_graph_ms(ops[target]) * 1e3)
        us = {f"{t}|{c}": statistics.median(v) for (t, c), v in samples.items()}
        results.append({"M": M, "N": N, "K": K, "tunings": tuned, "us": us,
                        "samples": {f"{t}|{c}": v for (t, c), v in samples.items()}})

        first = len(lines)
        lines.append(f"\nM={M} N={N} K={K}  (us; tuner: its own times, each column one tuning; "
                     f"conditioned: median of {args.reps} after {args.condition_ms:.0f} ms of the conditioner)")
        header = "op".ljust(40) + "".join(f"tune{i}".rjust(9) for i in range(len(tuned)))
        lines.append(header + "".join(f"after {c}".rjust(17) for c in CONDITIONERS))
        for name in ops:
            row = name.ljust(40) + "".join(f"{run['us'][name]:9.1f}" if name in run["us"] else " " * 9 for run in tuned)
            lines.append(row + "".join(f"{us[f'{name}|{c}']:17.1f}" for c in CONDITIONERS))
        lines.append("tuner picks: " + ", ".join(run["pick"] for run in tuned))
        for c in CONDITIONERS:
            best = min((n for n in ops if n != "scaled_mm"), key=lambda n: us[f"{n}|{c}"])
            lines.append(f"after {c}: fastest candidate {best}, scaled_mm / it = "
                         f"{us[f'scaled_mm|{c}'] / us[f'{best}|{c}']:.3f}; scaled_mm / each pick = " + ", ".join(
                             f"{us[f'scaled_mm|{c}'] / us[run['pick'] + '|' + c]:.3f}" for run in tuned))
        print("\n".join(lines[first:]), flush=True)
        (args.out / "gemm_tune_bias.json").write_text(json.dumps({"meta": meta, "points": results}, indent=1))
        (args.out / "gemm_tune_bias.txt").write_text("\n".join(lines) + "\n")
    (args.out / "gemm_tune_bias.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
