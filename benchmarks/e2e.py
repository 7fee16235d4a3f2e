"""End-to-end benchmark (HF bf16 vs quantkit fp8/int8, Llama-3-8B shape) + fast-path checks on the GPU.

    PYTHONPATH=. python benchmarks/e2e.py [--out benchmarks/results] [--no-checks] [--no-inexact]
        [--variants hf-bf16,fp8-fast,...] [--deadline S] [--same-process] [--compare-norm-quant]

Same code as ``quantkit bench model``: ``quantkit.bench.e2e.run_e2e_benchmark``. Writes
e2e.json (meta, rows, targets, checks), e2e.csv and e2e.png under --out.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.bench.e2e import run_e2e_benchmark  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--no-checks", action="store_true", help="skip the fast-path vs plain greedy checks")
    parser.add_argument("--no-inexact", action="store_true", help="skip the exact=False variants")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which the variants not yet started are skipped")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants in run order (default: hf-bf16, then per scheme "
                             "plain, fast-exact, fast)")
    parser.add_argument("--same-process", action="store_true",
                        help="measure every variant in this process (memory numbers then mix variants)")
    parser.add_argument("--compare-norm-quant", action="store_true",
                        help="also run <scheme>-fast-no-norm-quant (exact=False with the RMSNorm + quantization "
                             "fusion off) after each <scheme>-fast, report the ratios, and check the fusion on small "
                             "models (logits, greedy tokens, CUDA-graph vs eager decode) when checks run")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: the end-to-end benchmark needs a CUDA GPU; run it on the GPU machine")
    run_e2e_benchmark(args.out, plot=not args.no_plot, checks=not args.no_checks,
                      fast_inexact=not args.no_inexact, deadline_s=args.deadline, isolate=not args.same_process,
                      variants=args.variants.split(",") if args.variants else None,
                      compare_norm_quant=args.compare_norm_quant)


if __name__ == "__main__":
    main()
