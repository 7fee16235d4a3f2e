"""The GEMV (gemv.py) against the tiled decode pick at M = 2 and 4 on the GPU: does ``gemm.GEMV_MAX_M``
(1) stay? Per Llama-3-8B projection, FP8 and INT8, plain epilogue, bf16 out: bf16 F.linear, the GEMV
(``kernel="gemv"``) and the tiled kernel's autotuned pick (``kernel="tiled"``), outputs checked against
the reference first, then timed by gemm_splitk's rotate and flush timers in rotated rounds.

    PYTHONUNBUFFERED=1 python benchmarks/gemv_m2.py --out $OUT/gemv_m2
"""

import argparse

import kernels_only  # noqa: F401  (quantkit without its __init__)
import torch
import torch.nn.functional as F

from quantkit.bench.common import environment_metadata
from quantkit.bench.gemm import _rel_err, output_bound, write_results
from quantkit.bench.gemm_splitk import ROTATE_BYTES, SPLIT_K_POINTS, TIMERS, _operands
from quantkit.kernels import gemm, reference
from quantkit.kernels.launch import rotated_medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ms", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for kind, N, K in [p for p in SPLIT_K_POINTS if p[0] == "plain"]:
        for M in [int(m) for m in args.ms.split(",")]:
            for dtype_name, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
                copies = max(2, -(-ROTATE_BYTES // (N * K)))
                x, bf16_weights, a, sa, weights, sw = _operands(kind, M, N, K, dtype, "cuda", copies)
                ops = {"bf16": (lambda w: lambda: F.linear(x, w), bf16_weights)}
                for kernel in ("gemv", "tiled"):
                    make = (lambda k: lambda w: lambda: gemm.scaled_mm(a, w, sa, sw, kernel=k))(kernel)
                    ops[kernel] = (make, weights)
                ref = reference.scaled_mm(a, weights[0], sa, sw, None, "none", torch.float32)
                errs = {k: _rel_err(ops[k][0](weights[0])(), ref) for k in ("gemv", "tiled")}
                bound = output_bound(dtype, K)
                bad = [k for k, err in errs.items() if not err < bound]
                if bad:  # a wrong kernel is not timed
                    raise SystemExit(f"M={M} {N}x{K} {dtype_name}: rel. error of {bad} above {bound:.1e}: {errs}")
                row = {"M": M, "N": N, "K": K, "dtype": dtype_name, **{f"rel_err_{k}": v for k, v in errs.items()}}
                for t, timer in TIMERS.items():
                    medians, _ = rotated_medians(ops, lambda op: timer(*op), args.rounds)
                    for n, ms in medians.items():
                        row[f"{n}_ms_{t}"] = ms
                    for n in ("gemv", "tiled"):
                        row[f"{n}_x_bf16_{t}"] = row[f"bf16_ms_{t}"] / row[f"{n}_ms_{t}"]
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
                rows.append(row)
                write_results(rows, args.out, "gemv_m2", environment_metadata())


if __name__ == "__main__":
    main()
