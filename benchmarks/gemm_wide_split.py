"""The 128-row split tiles of 64 < M <= 256 (``gemm_configs.WIDE_M_SPLIT_K_CONFIGS``, session 48) on
the GPU: their checks, then the tiled autotuner's pick with them against its pick without them.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_wide_split.py --out $OUT/wide

Checks first (``gemm_splitk.run_split_k_checks`` on these configs: INT8 accumulators exact at
M = 1 ... 250, FP8 and INT8 outputs within tolerance, plain and gated, a second launch bit-equal,
the arrival counters back at zero). Then per point (M:N:K, plain epilogue, bf16 out) and dtype:
``pick_on`` the tiled kernel's autotuned pick from the pool as it is, ``pick_off`` its pick with
the split configs out of the pool (``SMALL_M_SPLIT_K`` off: at these M that removes only these
two), each launched as an explicit config; beside them ``gemm_medium_pool.point_ops``'s ops: what
``kernel="auto"`` runs (a contest at 129-256 rows, ``gemm._contest``), the tiled and the Gluon
kernel's picks, bf16 ``F.linear``, ``torch._scaled_mm`` rowwise (FP8), every output checked against
the reference first (session 48's run, at c488ef1, had its own copy of those ops without the tiled
and Gluon ones). Timer: the standard benchmark's (CUDA graph of an L2 flush + the call, minus the
flushes), rounds in rotated order, medians. Results: gemm_wide_split.json / .txt.
"""

import argparse
import json
import time
from pathlib import Path

import kernels_only  # noqa: F401  (quantkit without its __init__)
import torch
from gemm_medium_pool import FP8, point_ops

from quantkit.bench.common import environment_metadata
from quantkit.bench.gemm import _make_operands, adaptive_graph_ms
from quantkit.bench.gemm_splitk import config_name, run_split_k_checks, tuned_pick
from quantkit.kernels import gemm, gemm_configs
from quantkit.kernels.launch import config_dict, rotated_medians

POINTS = "96:4096:14336,128:4096:14336,192:4096:14336,256:4096:14336,128:4096:4096,192:4096:4096,128:6144:4096"


def run_checks() -> list[dict]:
    results = []

    def record(name, ok, **info):
        results.append({"check": name, "ok": bool(ok), **info})

    run_split_k_checks(record, configs=[config_dict(c) for c in gemm_configs.WIDE_M_SPLIT_K_CONFIGS])
    return results


def tiled_picks(M: int, N: int, K: int, dtype: torch.dtype) -> dict:
    """The tiled autotuner's pick at the point with the split configs in its pool ("pick_on") and
    without them ("pick_off"); the caches are as before afterwards."""
    _, _, _, a, a_scale, w, w_scale = _make_operands(M, N, K, dtype, "cuda")
    call = lambda: gemm.scaled_mm(a, w, a_scale, w_scale, kernel="tiled")  # noqa: E731
    return {name: tuned_pick(call, on) for name, on in (("pick_on", True), ("pick_off", False))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default=POINTS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--deadline", type=float, default=450.0, help="no new point past this many seconds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    checks = run_checks()
    failed = [c for c in checks if not c["ok"]]
    print(f"checks: {len(checks) - len(failed)}/{len(checks)} passed", flush=True)
    rows, skipped = [], []
    for point in [] if failed else args.points.split(","):
        M, N, K = (int(v) for v in point.split(":"))
        for dtype in (FP8, torch.int8):
            if time.time() - began > args.deadline:
                skipped.append([M, N, K, str(dtype)])
                continue
            picks = tiled_picks(M, N, K, dtype)
            ops, errors, _ = point_ops(M, N, K, dtype, explicit_configs=False, named=picks)
            picks = {name: config_name(cfg) for name, cfg in picks.items()}
            us, samples = rotated_medians(ops, lambda fn: adaptive_graph_ms(fn) * 1e3, args.rounds)
            row = {"M": M, "N": N, "K": K, "dtype": str(dtype).removeprefix("torch."), "us": us, "rounds_us": samples,
                   "picks": picks, "errors": errors}
            if "pick_on" in us and "pick_off" in us:
                row["on_vs_off"] = us["pick_off"] / us["pick_on"]
            rows.append(row)
            print(f"M={M} N={N} K={K} {row['dtype']}: " + "  ".join(f"{n}={t:.1f}" for n, t in us.items())
                  + f"  picks {picks}" + (f"  errors {errors}" if errors else ""), flush=True)
    meta = {**environment_metadata(), "rounds": args.rounds, "skipped": skipped,
            "wide_split_configs": [config_name(config_dict(c)) for c in gemm_configs.WIDE_M_SPLIT_K_CONFIGS]}
    (args.out / "gemm_wide_split.json").write_text(json.dumps({"meta": meta, "checks": checks, "rows": rows},
                                                              indent=1))
    lines = [f"{meta.get('gpu')} torch {meta.get('torch')} triton {meta.get('triton')} commit {meta.get('commit')} "
             f"{meta.get('date')}", f"checks: {len(checks) - len(failed)}/{len(checks)} passed", "",
             "| M | N x K | dtype | pick with the split tiles (us) | pick without (us) | ratio | auto | bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        us, picks = row["us"], row["picks"]
        cell = (lambda n: f"{us[n]:.1f}" if n in us else "-")
        lines.append(f"| {row['M']} | {row['N']}x{row['K']} | {row['dtype']} | "
                     f"{cell('pick_on')} ({picks['pick_on']}) | "
                     f"{cell('pick_off')} ({picks['pick_off']}) | {row.get('on_vs_off', float('nan')):.3f} | "
                     f"{cell('auto')} | {cell('bf16')} |")
    (args.out / "gemm_wide_split.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if failed:
        raise SystemExit(f"{len(failed)} checks failed: {failed[:3]}")


if __name__ == "__main__":
    main()
