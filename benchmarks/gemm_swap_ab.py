"""Swapped-operand GEMM tiles at decode and medium batch sizes (issue 3), timed on the GPU.

The tiled kernel's SWAP_AB configs (16-token tiles for M <= 16 by default; --block-m 32 / 64 for
larger M, and with --orientations the same tiles unswapped too) against today's autotuned pick and
bf16 F.linear, in one process.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_swap_ab.py --out $OUT/swap --deadline 500
    ... gemm_swap_ab.py --out $OUT/swap32 --ms 32,24 --block-m 32     # swapped tiles at medium M
    ... gemm_swap_ab.py --out $OUT/m64 --ms 64,128 --block-m 64 --orientations swap,plain   # + unswapped splits
    TRITON_INTERPRET=1 python benchmarks/gemm_swap_ab.py --out /tmp/swap --smoke    # CPU dry run

SWAP_AB computes (w @ a.T).T: the weight's BLOCK_N rows fill the MMA's M side (a 64-row wgmma per
warpgroup on Hopper) and the <= 16 tokens its N side, instead of a 16-row token tile on mma.sync.
Per point (M in --ms at the Llama-3-8B projections and the gated MLP front half, FP8 and INT8,
plain dequant epilogue, bf16 out) ``gemm_splitk.time_point`` checks every op against the
reference (INT8 bit for bit against the unsplit pick), then times bf16, the pick without and
with today's split configs ("auto", "auto_split_on"; both may be SWAP_AB configs since they joined
the decode pool: ``--no-swap-picks`` tunes them without, as run s37a did) and every candidate
below with the rotate and flush timers in rotated rounds. Writes gemm_swap_ab.json/.csv under --out.
"""

import argparse
import time
import traceback

import kernels_only  # noqa: F401  (quantkit without its __init__)
import torch

from quantkit.bench.common import environment_metadata
from quantkit.bench.gemm import write_results
from quantkit.bench.gemm_splitk import SPLIT_K_POINTS, TIMERS, print_point, time_point
from quantkit.kernels import gemm_configs
from quantkit.kernels.launch import INTERPRETED

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); BLOCK_M = --block-m tokens (16 by default).
CANDIDATES = [
    (64, 256, 1, 4, 4), (64, 256, 2, 4, 4), (64, 256, 4, 4, 4), (128, 256, 2, 4, 4), (128, 256, 4, 4, 4),
    (128, 128, 4, 4, 6), (128, 256, 8, 4, 3), (64, 512, 4, 4, 3), (256, 128, 4, 8, 4), (128, 256, 4, 8, 4),
    (64, 128, 4, 4, 8), (128, 512, 4, 4, 3),
]
# Shared memory a config's pipeline needs, roughly num_stages x (weight rows + 16 tokens) x BLOCK_K
# bytes; configs over this (the gated form doubles the weight rows) are not timed.
SMEM_LIMIT = 220 * 1024


def candidates(gated: bool, block_m: int = 16, orientations=(True,)) -> list[dict]:
    """The CANDIDATES with ``block_m`` token rows, swapped and / or not (``orientations``: SWAP_AB values)."""
    out = []
    for swap in orientations:
        for bn, bk, split, warps, stages in CANDIDATES:
            if stages * ((2 if gated else 1) * bn + block_m) * bk > SMEM_LIMIT:
                continue
            out.append({"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "SPLIT_K": split,
                        "SWAP_AB": swap, "num_warps": warps, "num_stages": stages})
    return out


def _wall_ms(make, weights) -> float:
    fn = make(weights[0])
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ms", default="16,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--candidates", type=int, default=None,
                        help="time only the first so many candidates (0: bf16 and the two picks only)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds from start; later points are skipped")
    parser.add_argument("--smoke", action="store_true", help="CPU dry run: one tiny point, one candidate")
    parser.add_argument("--block-m", type=int, default=16,
                        help="token rows of the candidates' tiles (32: swapped tiles for 17 <= M <= 32, the "
                             "medium pool's sizes: run s38a, whose picks had no swapped configs there yet)")
    parser.add_argument("--orientations", default="swap",
                        help="comma list of swap,plain: time the candidates swapped and / or not (plain: the "
                             "same tiles and splits with the tokens on the MMA's M side, e.g. split-K at M = 64)")
    parser.add_argument("--no-swap-picks", action="store_true",
                        help="tune the picks without the SWAP_AB configs (the pools before sessions 37 and 38, "
                             "run s37a's baseline); the candidates are timed either way")
    args = parser.parse_args()
    if args.no_swap_picks:
        gemm_configs.SMALL_M_SWAP_AB = False
    start = time.time()
    device = "cpu" if INTERPRETED else "cuda"
    ms = [int(m) for m in args.ms.split(",")]
    names = {"swap": True, "plain": False}
    orientations = tuple(names[o] for o in args.orientations.split(","))
    points, timers, limit = SPLIT_K_POINTS, TIMERS, args.candidates
    if args.smoke:
        points, ms, limit = [("plain", 96, 272), ("gated", 64, 160)], [5 if args.block_m <= 16 else 20], 2
        timers = {"wall": _wall_ms}
    meta = environment_metadata()
    meta.update(timers=list(timers), rounds=args.rounds, skipped=[], errors=[], swap_picks=not args.no_swap_picks,
                block_m=args.block_m, orientations=args.orientations)
    rows = []
    for kind, N, K in points:
        for M in ms:
            for dtype_name in ("fp8", "int8"):
                label = f"{kind} M={M} {N}x{K} {dtype_name}"
                if args.deadline is not None and time.time() - start > args.deadline - 30:
                    meta["skipped"].append(label)
                    continue
                try:
                    point_rows = time_point(kind, M, N, K, dtype_name, timers, args.rounds, device, limit,
                                            candidates(kind == "gated", args.block_m, orientations))
                except Exception:  # noqa: BLE001 - a point that fails is recorded, the rest still run
                    meta["errors"].append(f"{label}: {traceback.format_exc(limit=-3)}")
                    print(f"{label}: FAILED\n{traceback.format_exc()}", flush=True)
                    continue
                print_point(point_rows, timers)
                rows.extend(point_rows)
                write_results(rows, args.out, "gemm_swap_ab", meta)
    meta["seconds"] = time.time() - start
    write_results(rows, args.out, "gemm_swap_ab", meta)
    if torch.cuda.is_available():
        print(f"done in {meta['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
