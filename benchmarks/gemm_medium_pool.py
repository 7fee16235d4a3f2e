"""Medium batch sizes (64 < M < 256) on the GPU: which kernel and which tiled configs win there.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_medium_pool.py --out $OUT/medium \
        --points 192:4096:4096,192:6144:4096

Per point (M:N:K; plain epilogue, bf16 out) and dtype (FP8 fast accumulation, INT8): bf16 F.linear,
``torch._scaled_mm`` rowwise (FP8), what ``kernel="auto"`` runs, the tiled kernel's autotuned pick
(``kernel="tiled"``), the Gluon kernel's tuned pick (``kernel="gluon"``, where it runs) and every
config of the medium and the large tiled pools given explicitly (not with ``--picks-only``). Every
quantkit op's output is checked against ``reference.scaled_mm`` first (relative Frobenius error
<= 5e-3 FP8 / 2.5e-3 INT8); an op that fails to compile or to match is reported and not timed.
Timer: the standard benchmark's
(CUDA graph of L2 flush + call, minus the flushes), rounds in rotated order, medians.
Results: gemm_medium_pool.json / .txt under --out.
"""

import argparse
import json
import time
from pathlib import Path

import kernels_only  # noqa: F401  (quantkit without its __init__)
import torch
import torch.nn.functional as F

from quantkit.bench.common import environment_metadata, rel_err
from quantkit.bench.gemm import _make_operands, adaptive_graph_ms
from quantkit.bench.gemm_splitk import config_name
from quantkit.kernels import gemm, gemm_configs, reference
from quantkit.kernels.launch import config_dict, rotated_medians

FP8 = torch.float8_e4m3fn
TOLERANCE = {FP8: 5e-3, torch.int8: 2.5e-3}
PREFIX = "cfg "  # explicit tiled configs: PREFIX + gemm_splitk.config_name (s40 result files: cfg_64x64x256_w4_s4)


def point_ops(M: int, N: int, K: int, dtype: torch.dtype, explicit_configs: bool = True) -> tuple[dict, dict]:
    """(name -> callable, name -> error message) for one point and dtype, outputs checked."""
    x, w_bf16, _, a, a_scale, w, w_scale = _make_operands(M, N, K, dtype, "cuda")
    expected = reference.scaled_mm(a, w, a_scale, w_scale).float()
    ops = {"bf16": lambda: F.linear(x, w_bf16)}
    if dtype == FP8:
        w_t, sa, sw = w.t(), a_scale[:, None].contiguous(), w_scale[None, :].contiguous()
        ops["scaled_mm"] = lambda: torch._scaled_mm(a, w_t, scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True)
    mine = {f"{kind}": (lambda kind=kind: gemm.scaled_mm(a, w, a_scale, w_scale, kernel=kind))
            for kind in ("auto", "tiled", "gluon")}
    configs = {}
    for cfg in (gemm_configs.MEDIUM_M_CONFIGS + gemm_configs.LARGE_M_CONFIGS) if explicit_configs else []:
        explicit = config_dict(cfg)
        configs.setdefault(PREFIX + config_name(explicit), explicit)
    for name, explicit in configs.items():
        mine[name] = lambda c=explicit: gemm.scaled_mm(a, w, a_scale, w_scale, config=c, kernel="tiled")
    errors = {}
    for name, fn in mine.items():
        try:
            out = fn().float()
            torch.cuda.synchronize()
        except Exception as error:  # a config that does not fit, the Gluon kernel where it cannot run
            errors[name] = f"{type(error).__name__}: {error}"[:300]
            continue
        rel = rel_err(out, expected)
        if not rel <= TOLERANCE[dtype]:
            errors[name] = f"relative error {rel:.3g} > {TOLERANCE[dtype]}"
            continue
        ops[name] = fn
    return ops, errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default="192:4096:4096,192:6144:4096,192:640:2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--picks-only", action="store_true", help="no explicit tiled configs (the picks alone)")
    parser.add_argument("--deadline", type=float, default=400.0, help="no new point past this many seconds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    rows, skipped = [], []
    for point in args.points.split(","):
        M, N, K = (int(v) for v in point.split(":"))
        for dtype in (FP8, torch.int8):
            if time.time() - began > args.deadline:
                skipped.append([M, N, K, str(dtype)])
                continue
            ops, errors = point_ops(M, N, K, dtype, not args.picks_only)
            us, samples = rotated_medians(ops, lambda fn: adaptive_graph_ms(fn) * 1e3, args.rounds)
            rows.append({"M": M, "N": N, "K": K, "dtype": str(dtype).removeprefix("torch."), "us": us,
                         "rounds_us": samples, "errors": errors})
            ranked = sorted(us.items(), key=lambda item: item[1])
            print(f"M={M} N={N} K={K} {rows[-1]['dtype']}: " + "  ".join(f"{n}={t:.1f}" for n, t in ranked), flush=True)
            for name, message in errors.items():
                print(f"  {name}: {message}", flush=True)
    meta = {**environment_metadata(), "rounds": args.rounds, "skipped": skipped,
            "gluon_min_m": gemm.GLUON_MIN_M}
    (args.out / "gemm_medium_pool.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{meta.get('gpu')} torch {meta.get('torch')} triton {meta.get('triton')} commit {meta.get('commit')} "
             f"{meta.get('date')}", "", "| M | N x K | dtype | auto | tiled pick | gluon pick | best tiled config | "
             "scaled_mm | bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        us = row["us"]
        cfgs = {n: t for n, t in us.items() if n.startswith(PREFIX)}
        best = min(cfgs, key=cfgs.get) if cfgs else None
        cell = (lambda n: f"{us[n]:.1f}" if n in us else "-")
        lines.append(f"| {row['M']} | {row['N']}x{row['K']} | {row['dtype']} | {cell('auto')} | {cell('tiled')} | "
                     f"{cell('gluon')} | {f'{cfgs[best]:.1f} ({best})' if best else '-'} | {cell('scaled_mm')} | "
                     f"{cell('bf16')} |")
    (args.out / "gemm_medium_pool.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
