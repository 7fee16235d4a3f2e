"""The GEMM issue's targets from benchmark result files (quantkit.bench.gemm_targets).

    python benchmarks/gemm_targets.py --gemm results/gemm_s43a_std_h200.json results/gemm_s43b_std_h200.json \\
        --quant results/gemm_quant_s43c_h200.json [--out targets.json]

Rows of several GEMM files (a standard run taken in parts with ``--m``) are read together; the
markdown table goes to stdout, the summary with its sources to ``--out``.
"""

import argparse
import json
from pathlib import Path

from quantkit.bench.gemm_targets import summarize_targets, targets_markdown


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemm", nargs="*", default=[], help="gemm.json files")
    parser.add_argument("--quant", nargs="*", default=[], help="gemm_quant.json files")
    parser.add_argument("--out", help="write the summary and the files' meta here (JSON)")
    args = parser.parse_args()
    if not args.gemm and not args.quant:
        parser.error("give --gemm and/or --quant result files")
    loaded = {}
    for path in args.gemm + args.quant:
        try:
            loaded[path] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise SystemExit(f"error: cannot read {path}: {err}") from None
        if not isinstance(loaded[path], dict) or "rows" not in loaded[path]:
            raise SystemExit(f"error: {path} is not a benchmark result file (no 'rows'); pass gemm.json / gemm_quant.json")
    summary = summarize_targets([r for p in args.gemm for r in loaded[p]["rows"]],
                                [r for p in args.quant for r in loaded[p]["rows"]])
    print(targets_markdown(summary))
    if args.out:
        sources = {p: {k: loaded[p]["meta"].get(k) for k in ("gpu", "torch", "triton", "commit", "date", "ms", "complete")}
                   for p in loaded}
        Path(args.out).write_text(json.dumps({"sources": sources, "targets": summary}, indent=1))


if __name__ == "__main__":
    main()
