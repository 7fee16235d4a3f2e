"""Check the GEMM and quantization kernels on the GPU, then benchmark them.

    PYTHONPATH=. python benchmarks/gemm.py [--out benchmarks/results] [--quick] [--no-checks]

Writes gemm.csv/json/png (GEMMs, gated MLP) and gemm_quant.csv/json (quantization kernels) and
gemm_checks.json under --out. Same code as ``quantkit bench gemm``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.bench.gemm import bench_graph_ms, bench_ms, run_gemm_benchmark, run_gpu_checks  # noqa: E402
from quantkit.bench.quant import run_quant_benchmark  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--quick", action="store_true", help="fewer M values (1, 16, 128, 1024, 4096)")
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--checks-first", action="store_true",
                        help="run the correctness checks before the timings (default: after; every "
                             "benchmarked output is checked against the reference either way)")
    parser.add_argument("--epilogues", default="plain,bias_silu")
    parser.add_argument("--eager-timer", action="store_true",
                        help="time eager calls with do_bench (includes Python/launch overhead) instead of CUDA-graph replay")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: gemm,quant,gated")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    timer = bench_ms if args.eager_timer else bench_graph_ms
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.checks_first and not args.no_checks:
        run_checks(args.out)
    if "quant" not in skip:
        run_quant_benchmark(out_dir=args.out, timer=timer)
    if "gemm" not in skip:
        ms = [1, 16, 128, 1024, 4096] if args.quick else None
        run_gemm_benchmark(ms=ms, out_dir=args.out, gated="gated" not in skip, timer=timer,
                           epilogues=tuple(args.epilogues.split(",")))
    if not args.checks_first and not args.no_checks:
        run_checks(args.out)


def run_checks(out):
    checks = run_gpu_checks()
    Path(out, "gemm_checks.json").write_text(json.dumps(checks, indent=1, default=str))
    print(f"all {len(checks)} GPU checks passed", flush=True)


if __name__ == "__main__":
    main()
