"""Does a GEMM's timing depend on the op timed just before it? (session 14, one GPU run)

    PYTHONUNBUFFERED=1 python benchmarks/gemm_order.py --out $OUT/order

The standard benchmark (quantkit/bench/gemm.py) times each point's ops in rounds whose order
rotates by one op per round. A rotation moves each op's position but keeps its predecessor, and
on an H100 every large FP8 / INT8 / bf16 GEMM runs at the 700 W power cap: a kernel timed right
after a hot one may start at a lower clock. Here each target op (cuBLAS FP8 ``_scaled_mm`` with
fast accumulation, quantkit's FP8 GEMM as ``triton_ops.scaled_mm`` runs it) is timed with the
standard benchmark's timer (``adaptive_graph_ms``: CUDA-graph replays of L2 flush + op, minus
the flushes) right after a conditioner that ran for --condition-ms:
- ``idle``: nothing runs (the host sleeps), i.e. the op starts cool;
- ``bf16``: bf16 ``F.linear`` at the same shape, back to back;
- ``int_mm+epi``: ``torch._int_mm`` + its elementwise dequant epilogue (the standard
  benchmark's INT8 baseline);
- ``scaled_mm`` / ``quantkit_fp8``: one of the two targets, back to back (for the op itself: its
  own steady state).
Plain epilogue (no bias, no activation). Every (target, conditioner) pair runs --reps times, the
pairs in a shuffled order per repetition; medians reported. Writes gemm_order.json / .txt.

``--targets`` / ``--conditioners`` pick among the ops above and ``triton_fp8``, quantkit's Triton
persistent FP8 kernel (``gemm.scaled_mm(kernel="persistent")``, autotuned), which kernel="auto"
does not take where the Gluon kernel runs (session 15):

    python benchmarks/gemm_order.py --out $OUT/order --targets scaled_mm,quantkit_fp8,triton_fp8 \
        --conditioners idle,scaled_mm
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.gemm import _bf16_operands, _quantized, adaptive_graph_ms  # noqa: E402
from quantkit.kernels import gemm, triton_ops  # noqa: E402

POINTS = [(16384, 6144, 4096), (4096, 28672, 4096), (16384, 4096, 4096), (1024, 4096, 4096)]
TARGETS = ("scaled_mm", "quantkit_fp8")
CONDITIONERS = ("idle", "bf16", "int_mm+epi", "scaled_mm", "quantkit_fp8")


def point_ops(M, N, K):
    x, w_bf16, _ = _bf16_operands(M, N, K, "cuda")
    ai, asi, wi, wsi = _quantized(x, w_bf16, torch.int8)
    a8, as8, w8, ws8 = _quantized(x, w_bf16, torch.float8_e4m3fn)
    w8_t, wi_t = w8.t(), wi.t()
    sa, sb = as8.view(-1, 1), ws8.view(1, -1)
    sai, sbi = asi.view(-1, 1), wsi.view(1, -1)
    return {
        "bf16": lambda: F.linear(x, w_bf16),
        "int_mm+epi": lambda: ((torch._int_mm(ai, wi_t).float() * sai) * sbi).to(torch.bfloat16),
        "scaled_mm": lambda: torch._scaled_mm(a8, w8_t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                              use_fast_accum=True),
        "quantkit_fp8": lambda: triton_ops.scaled_mm(a8, w8, as8, ws8, None, "none", torch.bfloat16),
        "triton_fp8": lambda: gemm.scaled_mm(a8, w8, as8, ws8, None, "none", torch.bfloat16, kernel="persistent"),
    }


def condition(ops, name, ms):
    """Run ``name`` back to back (or sleep) for about ``ms`` milliseconds of GPU time."""
    torch.cuda.synchronize()
    if name == "idle":
        time.sleep(ms / 1e3)
        return
    fn = ops[name]
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--condition-ms", type=float, default=300.0)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--conditioners", default=",".join(CONDITIONERS))
    args = parser.parse_args()
    targets, conditioners = args.targets.split(","), args.conditioners.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {**environment_metadata(), "condition_ms": args.condition_ms, "reps": args.reps}
    rng = random.Random(14)
    results, lines = [], [f"{meta.get('gpu')} torch {torch.__version__} {meta['date']}  "
                          f"(us, median of {args.reps}; rows: target, columns: what ran before it)"]
    for M, N, K in POINTS:
        ops = point_ops(M, N, K)
        for fn in ops.values():  # compile / autotune, outside the timings
            fn()
        torch.cuda.synchronize()
        samples = {(t, c): [] for t in targets for c in conditioners}
        for _ in range(args.reps):
            pairs = list(samples)
            rng.shuffle(pairs)
            for target, cond in pairs:
                condition(ops, cond, args.condition_ms)
                samples[(target, cond)].append(adaptive_graph_ms(ops[target]) * 1e3)
        us = {f"{t}|{c}": statistics.median(v) for (t, c), v in samples.items()}
        results.append({"M": M, "N": N, "K": K, "us": us,
                        "samples": {f"{t}|{c}": v for (t, c), v in samples.items()}})
        first = len(lines)
        lines.append(f"\nM={M} N={N} K={K}")
        lines.append("target".ljust(14) + "".join(c.rjust(14) for c in conditioners))
        for t in targets:
            lines.append(t.ljust(14) + "".join(f"{us[f'{t}|{c}']:14.1f}" for c in conditioners))
        for t in targets:
            if t != "scaled_mm" and "scaled_mm" in targets:
                lines.append(f"ratio scaled_mm / {t} per conditioner: " + "  ".join(
                    f"{c} {us[f'scaled_mm|{c}'] / us[f'{t}|{c}']:.3f}" for c in conditioners))
                if t in conditioners and "scaled_mm" in conditioners:
                    lines.append(f"self-conditioned (each op after itself): "
                                 f"{us['scaled_mm|scaled_mm'] / us[f'{t}|{t}']:.3f}")
        print("\n".join(lines[first:]), flush=True)
        (args.out / "gemm_order.json").write_text(json.dumps({"meta": meta, "points": results}, indent=1))
        (args.out / "gemm_order.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
