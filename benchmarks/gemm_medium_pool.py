"""Medium batch sizes (64 < M < 256) on the GPU: which kernel and which tiled configs win there.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_medium_pool.py --out $OUT/medium \
        --points 192:4096:4096,192:6144:4096,192:2048:640:g

Per point (M:N:K, plain epilogue, bf16 out; M:N:K:g the gated GEMM, N outputs of a stacked 2N x K
weight, SiLU) and dtype (FP8 fast accumulation, INT8): bf16 (F.linear; gated: on 2N rows, then
silu(gate) * up), ``torch._scaled_mm`` rowwise (FP8, plain), what ``kernel="auto"`` runs (called
first, so a contested size's contest, ``gemm._contest``, runs in it: its times and winner are
recorded), the tiled kernel's autotuned pick (``kernel="tiled"``), the Gluon kernel's tuned pick
(``kernel="gluon"``, where it runs) and every config of the medium and the large tiled pools given
explicitly (plain, not with ``--picks-only``). Every quantkit op's output is checked against
``reference.scaled_mm`` / ``gated_scaled_mm`` first (relative Frobenius error <= 5e-3 FP8 / 2.5e-3
INT8); an op that fails to compile or to match is reported and not timed.
Timer: the standard benchmark's
(CUDA graph of L2 flush + call, minus the flushes), rounds in rotated order, medians.
Results: gemm_medium_pool.json / .txt under --out.
"""

import argparse
import json
import re
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
# --split: split-K tiles for 64 < M <= 256 (session 48), none of them in the pools there. At M = 128
# the pools' tiles leave narrow outputs on a few dozen programs (4096 columns: 32 of 128x128, or
# 64x64 ones that read the activations 64 times over), where a 128-row tile split over K reads the
# weight once on about 128 programs.
SPLIT_CANDIDATES = [config_dict(gemm_configs._cfg(bm, bn, bk, w, st, split_k=s))
                    for bm, bn, bk, w, st, s in [(128, 128, 128, 8, 4, 2), (128, 128, 128, 8, 4, 4),
                                                 (128, 128, 128, 4, 4, 4), (128, 64, 128, 4, 4, 2),
                                                 (128, 64, 128, 4, 4, 4), (128, 256, 128, 8, 3, 4),
                                                 (128, 256, 128, 8, 3, 8), (64, 128, 128, 4, 4, 2),
                                                 (64, 128, 256, 4, 3, 2), (64, 64, 256, 4, 4, 2),
                                                 (128, 128, 256, 8, 3, 4)]]


def parse_configs(text: str) -> dict:
    """``--configs``: comma-separated tiled configs as BMxBNxBK wW sS [SK] (e.g. "128x256x128w8s3S2"),
    each named by ``config_name``."""
    named = {}
    for spec in filter(None, text.split(",")):
        match = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:S(\d+))?", spec.strip())
        if match is None:
            raise SystemExit(f"--configs: {spec!r} is not BMxBNxBKwWsS[SK], e.g. 128x256x128w8s3S2")
        bm, bn, bk, warps, stages, split = (int(v) if v else 1 for v in match.groups())
        cfg = config_dict(gemm_configs._cfg(bm, bn, bk, warps, stages, split_k=split))
        named[PREFIX + config_name(cfg)] = cfg
    return named


def point_ops(M: int, N: int, K: int, dtype: torch.dtype, explicit_configs: bool = True,
              gated: bool = False, split: bool = False, named: dict | None = None) -> tuple[dict, dict, dict | None]:
    """(name -> callable, name -> error message, the contest ``auto`` ran or None) for one point and
    dtype, outputs checked. ``named``: more tiled configs, each timed under its given name (the
    explicit sets under PREFIX + their config's name, once each)."""
    x, w_bf16, _, a, a_scale, w, w_scale = _make_operands(M, 2 * N if gated else N, K, dtype, "cuda")
    if gated:
        expected = reference.gated_scaled_mm(a, w, a_scale, w_scale, "silu").float()

        def bf16():
            gate, up = F.linear(x, w_bf16).chunk(2, dim=-1)
            return F.silu(gate) * up

        ops = {"bf16": bf16}
        call = lambda **kw: gemm.gated_scaled_mm(a, w, a_scale, w_scale, "silu", **kw)  # noqa: E731
    else:
        expected = reference.scaled_mm(a, w, a_scale, w_scale).float()
        ops = {"bf16": lambda: F.linear(x, w_bf16)}
        call = lambda **kw: gemm.scaled_mm(a, w, a_scale, w_scale, **kw)  # noqa: E731
    mine = {kind: (lambda kind=kind: call(kernel=kind)) for kind in ("auto", "tiled", "gluon")}
    if dtype == FP8 and not gated:
        w_t, sa, sw = w.t(), a_scale[:, None].contiguous(), w_scale[None, :].contiguous()
        ops["scaled_mm"] = lambda: torch._scaled_mm(a, w_t, scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16,
                                                    use_fast_accum=True)
    configs = {}
    for cfg in (gemm_configs.MEDIUM_M_CONFIGS + gemm_configs.LARGE_M_CONFIGS) if explicit_configs and not gated else []:
        explicit = config_dict(cfg)
        configs.setdefault(PREFIX + config_name(explicit), explicit)
    for explicit in SPLIT_CANDIDATES if split and not gated else []:
        configs.setdefault(PREFIX + config_name(explicit), explicit)
    for name, explicit in {**configs, **(named or {})}.items():
        mine[name] = lambda c=explicit: call(config=c, kernel="tiled")
    errors, contests_before = {}, dict(gemm.CONTEST_TIMES)
    for name, fn in mine.items():  # "auto" first: a contest runs in its first call
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
    new = [times for key, times in gemm.CONTEST_TIMES.items() if key not in contests_before]
    contest = {"ms": new[0], "winner": min(new[0], key=new[0].get)} if new else None
    return ops, errors, contest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--points", default="192:4096:4096,192:6144:4096,192:640:2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--picks-only", action="store_true", help="no explicit tiled configs (the picks alone)")
    parser.add_argument("--split", action="store_true", help="also the split-K candidates (SPLIT_CANDIDATES)")
    parser.add_argument("--deadline", type=float, default=400.0, help="no new point past this many seconds")
    parser.add_argument("--configs", default="", help="more tiled configs, e.g. 128x256x128w8s3S2,256x128x128w8s3")
    args = parser.parse_args()
    named = parse_configs(args.configs)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    rows, skipped = [], []
    for point in args.points.split(","):
        fields = point.split(":")
        M, N, K = (int(v) for v in fields[:3])
        gated = fields[3:] == ["g"]
        for dtype in (FP8, torch.int8):
            if time.time() - began > args.deadline:
                skipped.append([M, N, K, gated, str(dtype)])
                continue
            ops, errors, contest = point_ops(M, N, K, dtype, not args.picks_only, gated, args.split, named)
            us, samples = rotated_medians(ops, lambda fn: adaptive_graph_ms(fn) * 1e3, args.rounds)
            rows.append({"M": M, "N": N, "K": K, "gated": gated, "dtype": str(dtype).removeprefix("torch."),
                         "us": us, "rounds_us": samples, "errors": errors, "contest": contest})
            ranked = sorted(us.items(), key=lambda item: item[1])
            print(f"M={M} N={N} K={K}{' gated' if gated else ''} {rows[-1]['dtype']}: "
                  + "  ".join(f"{n}={t:.1f}" for n, t in ranked)
                  + (f"  contest={contest['winner']} {contest['ms']}" if contest else ""), flush=True)
            for name, message in errors.items():
                print(f"  {name}: {message}", flush=True)
    meta = {**environment_metadata(), "rounds": args.rounds, "skipped": skipped,
            "gluon_min_m": gemm.GLUON_MIN_M, "contest_min_m": gemm.CONTEST_MIN_M}
    (args.out / "gemm_medium_pool.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"{meta.get('gpu')} torch {meta.get('torch')} triton {meta.get('triton')} commit {meta.get('commit')} "
             f"{meta.get('date')}", "", "| M | N x K | dtype | auto | contest (tiled / gluon us) | tiled pick | gluon pick | "
             "best tiled config | scaled_mm | bf16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        us = row["us"]
        cfgs = {n: t for n, t in us.items() if n.startswith(PREFIX)}
        best = min(cfgs, key=cfgs.get) if cfgs else None
        cell = (lambda n: f"{us[n]:.1f}" if n in us else "-")
        contest = row["contest"]
        fight = (f"{contest['winner']} ({contest['ms']['tiled'] * 1e3:.1f} / {contest['ms']['gluon'] * 1e3:.1f})"
                 if contest else "-")
        shape = f"{'2x' if row['gated'] else ''}{row['N']}x{row['K']}{' gated' if row['gated'] else ''}"
        lines.append(f"| {row['M']} | {shape} | {row['dtype']} | {cell('auto')} | {fight} | {cell('tiled')} | "
                     f"{cell('gluon')} | {f'{cfgs[best]:.1f} ({best})' if best else '-'} | {cell('scaled_mm')} | "
                     f"{cell('bf16')} |")
    (args.out / "gemm_medium_pool.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
