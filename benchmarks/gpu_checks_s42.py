"""GPU checks and timing of session 42's static (per-tensor) quantization kernel: the scale's
reciprocal with one FMA correction instead of IEEE division, FP8 saturated by the conversion
itself (NaN kept), rows packed back to back taken as one flat range.

1. Bit for bit against the torch twin run on the GPU, INT8 and FP8, bf16 / fp16 / fp32 inputs:
   quotients on and one ulp either side of every rounding boundary, signed zeros, values that
   saturate, overflow or underflow the quotient, infinities and NaN (FP8: NaN must stay NaN; INT8
   NaN has no code and is left out), scales inside the fast range and outside it (2**-70, 7.5e20,
   0, inf, NaN); packed rows (the flat launch) and rows with a gap (the row launch).
2. Random bf16 activations at the benchmark's four shapes, bit for bit.
3. Timing (the quantization benchmark's timer: CUDA-graph replays, L2 flushed each call; ``--rounds``
   rounds in rotated order, medians): the new kernel, the previous one (``--old``: that commit's
   quant.py, loaded as a module of its own) and a copy of the same bytes, at the four shapes.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_checks_s42.py --old old_quant.py --out $OUT/checks42
"""

import argparse
import json
import math
from pathlib import Path

from kernels_only import load_module  # quantkit without its __init__
import torch

from quantkit.bench.common import environment_metadata
from quantkit.bench.gemm import bench_graph_ms
from quantkit.bench.quant import DEFAULT_SHAPES, static_quant_edge_inputs
from quantkit.kernels import quant, reference

RESULTS = []
SCALES = [0.07, 3.1e-3, 1e-12, 2.0**-70, 7.5e20, 0.0, math.inf, math.nan]


def record(name, ok, **info):
    RESULTS.append({"check": name, "ok": bool(ok), **info})
    print(f"[{'ok' if ok else 'FAILED'}] {name} {info}", flush=True)


def compare(got, want, qdtype):
    """(ok, mismatches): INT8 outside NaN quotients; FP8 bit for bit, NaN where the twin has NaN."""
    if qdtype == torch.int8:
        return bool(torch.equal(got, want)), int((got != want).sum())
    got_nan, want_nan = torch.isnan(got.float()), torch.isnan(want.float())
    keep = ~want_nan
    bad = int((got_nan != want_nan).sum()) + int((got.view(torch.int8)[keep] != want.view(torch.int8)[keep]).sum())
    return bad == 0, bad


def check_edges():
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        for xdtype in (torch.bfloat16, torch.float16, torch.float32):
            for scale in SCALES:
                x = static_quant_edge_inputs(scale, qdtype, nan=True).to(xdtype).cuda()
                s = torch.tensor([scale], dtype=torch.float32, device="cuda")
                for form, inputs in (("flat", x), ("rows", torch.cat([x, x], dim=1)[:, :x.shape[1]])):
                    got = quant.quantize_per_tensor(inputs, s, qdtype)
                    want = reference.quantize_per_tensor(inputs, s, qdtype)
                    if qdtype == torch.int8:  # NaN quotients have no int8 code (torch's is the platform's)
                        finite = ~torch.isnan(inputs.float() / s)
                        got, want = got[finite], want[finite]
                    ok, bad = compare(got, want, qdtype)
                    nan_kept = None
                    if qdtype == torch.float8_e4m3fn:
                        nan_in = torch.isnan(inputs.float() / s)
                        nan_kept = bool(torch.isnan(quant.quantize_per_tensor(inputs, s, qdtype).float())[nan_in].all())
                        ok = ok and nan_kept
                    record(f"edges {str(qdtype)[6:]} {str(xdtype)[6:]} scale={scale:g} {form}", ok, mismatches=bad,
                           nan_kept=nan_kept, elements=inputs.numel())


def check_random():
    for M, K in DEFAULT_SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
        s = torch.tensor([0.05], device="cuda")
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            ok, bad = compare(quant.quantize_per_tensor(x, s, qdtype), reference.quantize_per_tensor(x, s, qdtype),
                              qdtype)
            record(f"random {str(qdtype)[6:]} {M}x{K}", ok, mismatches=bad)


def time_kernels(old, rounds):
    rows = []
    for M, K in DEFAULT_SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        s = torch.tensor([0.05], device="cuda")
        src = torch.empty(M * K * 3 // 2, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            ops = {"new": lambda: quant.quantize_per_tensor(x, s, qdtype), "copy": lambda: dst.copy_(src)}
            if old is not None:
                ops["old"] = lambda: old.quantize_per_tensor(x, s, qdtype)
            names = list(ops)
            samples = {name: [] for name in names}
            for r in range(rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    samples[name].append(bench_graph_ms(ops[name]))
            med = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
            row = {"M": M, "K": K, "dtype": str(qdtype)[6:], "us": {k: v * 1e3 for k, v in med.items()},
                   "samples_us": {k: [t * 1e3 for t in v] for k, v in samples.items()},
                   "new_of_copy": med["copy"] / med["new"]}
            if old is not None:
                row.update(old_of_copy=med["copy"] / med["old"], new_vs_old=med["old"] / med["new"])
            rows.append(row)
            print(f"time {row['dtype']:14s} {M}x{K}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row["us"].items())
                  + f"; new {100 * row['new_of_copy']:.1f} % of copy"
                  + (f", old {100 * row['old_of_copy']:.1f} %, new/old speed {row['new_vs_old']:.3f}x" if old else ""),
                  flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--old", help="the previous quant.py, timed beside the new kernel")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    check_edges()
    check_random()
    timing = time_kernels(load_module(args.old, "quant_old") if args.old else None, args.rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    passed = sum(r["ok"] for r in RESULTS)
    (out / "gpu_checks_s42.json").write_text(json.dumps(
        {"meta": environment_metadata(), "passed": passed, "checks": RESULTS, "timing": timing}, indent=1))
    print(f"{passed}/{len(RESULTS)} checks passed")


if __name__ == "__main__":
    main()
