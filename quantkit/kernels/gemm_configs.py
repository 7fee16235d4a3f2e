"""Launch configs of the tiled GEMM kernel (``gemm._scaled_mm_kernel``): the autotune sets per M
family, the split-K sets (the decode one, the medium ones of M <= 64 and the 128-row one of
64 < M <= 256, in the pools while SMALL_M_SPLIT_K is on), the swapped-operand sets, the split plan
and the autotuner's pruning and heuristics.

A config is a ``triton.Config`` of BLOCK_M / BLOCK_N / BLOCK_K / GROUP_M (+ SPLIT_K for the split
set, + SWAP_AB for the swapped-operand decode configs) with num_warps / num_stages;
``launch.config_dict`` turns one into the explicit-config dict ``gemm.scaled_mm(config=...)`` takes.
"""

from __future__ import annotations

import triton

from quantkit.kernels.launch import SHARED_MEMORY_LIMIT, cdiv, next_power_of_2

# Largest SPLIT_K a config may ask for: the combine unrolls one load of every slice's partial
# tile, and past 16 slices the partials' traffic outgrows what the split gains.
MAX_SPLIT_K = 16


def _cfg(bm, bn, bk, warps, stages, group_m=8, split_k=1, swap_ab=False):
    kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m}
    if split_k > 1:
        kwargs["SPLIT_K"] = split_k
    if swap_ab:
        kwargs["SWAP_AB"] = True
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


# Decode (M <= 16): bandwidth-bound on the weight. A 16-row token tile pads M by at most 15 rows;
# narrow N tiles and long K tiles give 64..512 programs, each with several K-steps of weight in
# flight, so the whole chip streams the weight. Triton runs a 16-row tl.dot on mma.sync, though;
# the SWAP_AB configs (last) put the weight rows on the MMA's M side instead (note below).
SMALL_M_CONFIGS = [
    _cfg(16, 32, 256, 4, 4),
    _cfg(16, 32, 512, 4, 4),
    _cfg(16, 64, 256, 4, 4),
    _cfg(16, 64, 512, 4, 3),
    _cfg(16, 128, 256, 4, 4),
    _cfg(16, 16, 512, 4, 4),
    _cfg(16, 64, 256, 4, 4, swap_ab=True),
]

# Decode with split-K (issue 3): the configs above launch N / BLOCK_N programs, 32..256 at
# N = 4096, each walking all of K; on an H100 (132 SMs) 4096 x 14336 at M = 1 then reads the
# weight at 1.7 TB/s of the 3.0 copy rate. SPLIT_K slices of K per output tile multiply the
# programs. Shared memory per program is (num_stages - 1) x (BLOCK_N + 16) x BLOCK_K bytes
# (triton's pipeline buffers; twice the weight tile when gated) and about (num_stages - 1) x
# BLOCK_N x BLOCK_K bytes of weight are in flight per program. Little's law at 3.35 TB/s and
# ~0.8 us loaded DRAM latency wants ~2.7 MB in flight chip-wide, ~20 KB per SM: every config
# below has that with one resident program per SM, so what decides is that all 132 SMs get
# programs (>= ~264, so a last partial wave is short) while each slice keeps enough K steps to
# amortize its pipeline fill and the combine (store the partial rows < M, one atomic, and for
# the last slice a re-read of S partials from L2). Programs (N / BLOCK_N x SPLIT_K) and K steps
# per slice, for 4096x4096 / 6144x4096 / 28672x4096 / 4096x14336 (K steps per slice: 4096 / 14336):
#   16x32x256 s4, S=4  (36 KB smem, 24 KB in flight):  512 /  768 / 3584 /  512; 4 / 14
#   16x64x256 s4, S=2  (60 KB, 48 KB):                  128 /  192 /  896 /  128; 8 / 28
#   16x64x256 s4, S=4:                                  256 /  384 / 1792 /  256; 4 / 14
#   16x64x256 s4, S=8:                                  512 /  768 / 3584 /  512; 2 / 7
#   16x64x512 s3, S=4  (80 KB, 64 KB):                  256 /  384 / 1792 /  256; 2 / 7
#   16x128x256 s4, S=4 (108 KB, 96 KB):                 128 /  192 /  896 /  128; 4 / 14
#   16x128x256 s3, S=8 (72 KB, 64 KB):                  256 /  384 / 1792 /  256; 2 / 7
#   16x32x512 s3, S=8  (48 KB, 32 KB):                 1024 / 1536 / 7168 / 1024; 1 / 3-4
# Expected: the long-K 4096x14336 gains most (64 unsplit programs of BLOCK_N 64 -> 256-512);
# 28672x4096 already has 448-896 unsplit programs, so the split should not win there; at
# K = 4096 the slices are short (1-4 steps) and the combine's fixed latency may eat the gain.
SMALL_M_SPLIT_K_CONFIGS = [
    _cfg(16, 32, 256, 4, 4, split_k=4),
    _cfg(16, 64, 256, 4, 4, split_k=2),
    _cfg(16, 64, 256, 4, 4, split_k=4),
    _cfg(16, 64, 256, 4, 4, split_k=8),
    _cfg(16, 64, 512, 4, 3, split_k=4),
    _cfg(16, 128, 256, 4, 4, split_k=4),
    _cfg(16, 128, 256, 4, 3, split_k=8),
    _cfg(16, 32, 512, 4, 3, split_k=8),
    _cfg(16, 64, 256, 4, 4, split_k=2, swap_ab=True),
    _cfg(16, 64, 256, 4, 4, split_k=4, swap_ab=True),
    _cfg(16, 128, 128, 4, 6, split_k=4, swap_ab=True),
]
# Measured on an H100 (2026-11-24, `benchmarks/gemm.py --split-k`, results/gemm_splitk_s7_h100.*):
# every split config passed the GPU checks (INT8 exact, counters back at zero, repeats bit-equal).
# At M = 1 the autotuner's pick with them admitted, against its pick without them: 1.06-1.28x
# (L2 rotated) / 0.99-1.16x (L2 flushed) at 4096x14336, 4096x4096 and 6144x4096, 0.97-1.03x at
# 28672x4096 (already 448+ unsplit programs) and the gated 14336x4096. At M = 16 the unsplit tiles
# already fill the GPU: 0.95-1.02x, split configs picked on noise. So the pool admitted them for
# M <= 8 only. On an H200 (2026-11-28, session 36, results/gemm_splitk_s36{a,b}_h200.*) at M = 16 the
# unsplit pick at 4096x14336 FP8 took 25.3 us (rotate) / 26.9 us (flush), 1.27x / 1.47x bf16, and
# the 4-way split configs 19.1-20.0 / 23.3-24.2 us (1.61-1.70x bf16); at the other points the best
# split config was 0.89-1.05x the unsplit pick (the tuner keeps the faster). So the pool admits them
# up to M = 16.
# Explicit ``config={..., "SPLIT_K": s}`` works at every M.
# Session 38 (below) added split configs for 17 <= M <= 64 (swapped ones up to 32, one 64-row one),
# so the pool admits split configs up to M = 64. The verdict round at M = 1, 16, 32 and 64 (session
# 39, results/gemm_splitk_s39a_h200.*): where the picks differ (22 of 40 points), the pick with the
# split configs against the pick without them reads 1.01-1.37x at 4096x14336, 1.01-1.27x at
# 4096x4096 but for INT8 M = 16 (0.93 / 0.98x), 0.88 / 0.94x at FP8 6144x4096 M = 32 and 0.98-1.14x
# elsewhere. The two losses were single tunings: tuned seven times apart (results/tune_noise_s39_h200.*)
# the tuner picked the fastest config at the first 7 of 7 times and was at most 1.6 % off at the
# second. So the switch stays on.
SMALL_M_SPLIT_K = True
SPLIT_K_MAX_M = 64
# SWAP_AB (the last config of SMALL_M_CONFIGS and the last three above): the tile is computed as
# (w @ a.T).T, BLOCK_N weight rows on the MMA's M side (Hopper's wgmma takes 64 rows per
# warpgroup instruction) and the BLOCK_M = 16 token rows on its N side, where the other decode
# configs give triton a 16-row token tile and so mma.sync. Measured on an H200 (2026-11-29, session 37,
# `benchmarks/gemm_swap_ab.py`, results/gemm_swap_ab_s37a_h200.*; rotate / flush timers), FP8 at
# M = 16 against bf16: 6144x4096 1.71 / 1.68x (16x64x256 unsplit) where the pick without them read
# 1.49 / 1.55x; 4096x4096 1.71 / 1.78x (S2) against 1.54 / 1.70x; 28672x4096 1.84 / 1.76x (unsplit)
# against 1.70 / 1.67x; 4096x14336 1.78 / 1.74x (S2 / S4) against 1.68 / 1.71x. The best swapped
# candidate against the pick, M = 16 and 4: FP8 1.02-1.15x, INT8 0.98-1.09x, the gated MLP front
# half 0.98-1.05x. These four were the best of twelve candidates; the autotuner times them beside
# the others (standard run s37: it picked one at 15 of the M = 16 keys). SMALL_M_SWAP_AB = False
# takes them out of the pool (benchmarks/gemm_swap_ab.py --no-swap-picks: the baseline of s37a),
# with the medium ones below; explicit ``config={..., "SWAP_AB": True}`` works at every M.
SMALL_M_SWAP_AB = True

# 17 <= M <= 32: the medium pool's tiles have 32 or 64 token rows, and a 32-row tl.dot again runs on
# mma.sync. Swapped 32-token tiles (wgmma n = 32), measured on an H200 (2026-11-29, session 38,
# `benchmarks/gemm_swap_ab.py --ms 32,24 --block-m 32`, results/gemm_swap_ab_s38a_h200.*; twelve
# candidates, rotate / flush timers) against the medium pool's pick (64x64x256 or 64x128x128):
# 1.04-1.07x at 6144x4096, 1.08-1.18x at 4096x4096 (S2), 1.23-1.33x at 4096x14336 (S2 / S4), FP8 and
# INT8; 0.99-1.03x at 28672x4096 and on the gated MLP front half (the pick already streams the
# weight). At the first three shapes the best reads 1.61-1.77x bf16 where the pick read 1.27-1.60x.
# These three were the fastest candidates at every point.
MEDIUM_M_SWAP_CONFIGS = [
    _cfg(32, 64, 256, 4, 4, swap_ab=True),
    _cfg(32, 64, 256, 4, 4, split_k=2, swap_ab=True),
    _cfg(32, 64, 256, 4, 4, split_k=4, swap_ab=True),
]
SWAP_AB_MAX_M = 32
# 33 <= M <= 64: the 64-row tiles already run on wgmma (the best swapped 64-token tile read
# 0.98-1.03x the best unswapped one in session 38), but 64x64x256 launches N / 64 programs, 64 at
# N = 4096, on 132 SMs. A 2-way split (session 38, run s38b, results/gemm_swap_ab_s38b_h200.*,
# M = 64) against the medium pick: 1.18-1.27x at 4096x14336 and 1.00-1.07x at 4096x4096, FP8 and
# INT8; at M = 128 no candidate beat the pick with both timers, so the pool keeps it to M <= 64.
MEDIUM_M_SPLIT_K_CONFIGS = [
    _cfg(64, 64, 256, 4, 4, split_k=2),
]
# 64 < M <= 256, not gated (session 48): a 128-row tile covers M = 65-128 in one row tile, so the
# weight is read once, and split over K it puts 4096 columns on 128-256 programs. Measured on an
# H200 (benchmarks/gemm_medium_pool.py --split, results/gemm_medium_pool_s48_split_h200.*; eleven
# 64- and 128-row split candidates beside the picks, L2 flushed), against the pick of the pools
# as they were (FP8 / INT8): 4096x14336 at M = 96 1.07 / 1.11x (28.6 against 30.7 us, S = 4), M = 128
# 1.02 / 1.06x (S = 4), M = 192 1.10 / 1.05x (36.5 against 40.0, S = 2; there the Gluon kernel's
# pick took 40.4 / 40.2). At K = 4096 (4096, 6144 and 28672 columns; M = 128, 192, 256) every split
# candidate lost to the pick (0.75-0.97x), the larger tiles by more: the slice that arrives last
# reads every slice's partial tile alone, S x 32-128 KB on one SM. The tuner keeps the faster.
# The pool holds them for outputs narrower than WIDE_SPLIT_MAX_N (wider ones take the Gluon kernel
# from M = 96 on Hopper), the 4-way one up to M = 128 (where it won; the 2-way one won above): the
# split workspace, S x 128-row tiles x N x 4 bytes, stays under 17 MB.
WIDE_M_SPLIT_K_CONFIGS = [
    _cfg(128, 64, 128, 4, 4, split_k=2),
    _cfg(128, 64, 128, 4, 4, split_k=4),
]
WIDE_SPLIT_MAX_N = 8192

# 17 <= M <= 128: still mostly weight-bound; tiles that cover M in one or two row-tiles.
MEDIUM_M_CONFIGS = [
    _cfg(32, 64, 256, 4, 4),
    _cfg(64, 64, 256, 4, 4),
    _cfg(64, 128, 128, 4, 4),
    _cfg(64, 128, 256, 4, 3),
    _cfg(128, 128, 128, 8, 4),
    _cfg(64, 256, 128, 8, 3),
]
# M > 128: compute-bound; large wgmma tiles, 3-4 stage pipelines (with the medium set up to 256).
LARGE_M_CONFIGS = [
    _cfg(128, 256, 128, 8, 3),
    _cfg(256, 128, 128, 8, 3),
    _cfg(128, 128, 128, 8, 4),
    _cfg(128, 128, 128, 4, 4),
    _cfg(128, 256, 64, 8, 4),
    _cfg(128, 64, 128, 4, 4),
]
# 129 <= M <= 256 (one tuning bucket): both sets. Measured on an H200 (session 40,
# benchmarks/gemm_medium_pool.py, results/gemm_medium_pool_s40_h200.*) at M = 192, every config of
# both given explicitly, the best medium config against the best large one, FP8 / INT8: 1.38x / 1.39x
# at 640x2048 (Gemma-3-270M's down projection; 64x64x256: 5.9 / 6.4 us, the large set's autotuned
# pick 8.4 / 9.0), 1.07x / 1.03x at 4096x4096 (64x128x256), 1.00x / 1.01x at 6144x4096. Larger
# weights run on the Gluon kernel there (gemm.gluon_sized).
MEDIUM_LARGE_MAX_M = 256
# Every config the autotuner knows; _prune_configs picks each call's family.
ALL_CONFIGS = (SMALL_M_CONFIGS + SMALL_M_SPLIT_K_CONFIGS + MEDIUM_M_CONFIGS + LARGE_M_CONFIGS
               + MEDIUM_M_SWAP_CONFIGS + MEDIUM_M_SPLIT_K_CONFIGS + WIDE_M_SPLIT_K_CONFIGS)

# One config under the interpreter: big tiles (cost is per program), K tile 64 so test shapes
# exercise both the multi-step K loop and the masked K tail.
INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4}


def m_bucket(M: int) -> int:
    """Autotune key for M: a new batch size retunes only when it crosses a power of two."""
    return next_power_of_2(max(1, min(M, 4096)))


def split_k_plan(K: int, block_k: int, split_k: int) -> int:
    """K-slices per output tile for a config's SPLIT_K: at most one slice per K step (so every
    slice has >= 1 step; a slice without one would only add a partial tile of zeros), at least 1.

    Example: K = 4096 in 512-wide steps is 8 steps: SPLIT_K = 16 -> 8 slices of one step.
    """
    if not (isinstance(split_k, int) and not isinstance(split_k, bool) and 1 <= split_k <= MAX_SPLIT_K):
        raise ValueError(f"SPLIT_K={split_k!r} must be an int in 1..{MAX_SPLIT_K} (K-slices per output tile; 1: off)")
    return max(1, min(split_k, cdiv(K, block_k)))


def split_k_programs(M: int, N: int, K: int, config: dict) -> tuple[int, int]:
    """(K-slices, programs) of a tiled launch with ``config``: one program per output tile and slice."""
    splits = split_k_plan(K, config["BLOCK_K"], config.get("SPLIT_K", 1))
    return splits, cdiv(M, config["BLOCK_M"]) * cdiv(N, config["BLOCK_N"]) * splits


def _signature(config) -> tuple:
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


def pool_configs(M: int, gated: bool = False, split_k: bool | None = None, N: int | None = None) -> list:
    """The configs the autotuner times at ``M`` (a family of ALL_CONFIGS, in its order): the
    decode, medium or large set, the split configs of M's range (the decode ones, the medium ones
    up to SPLIT_K_MAX_M, the 128-row ones above it up to MEDIUM_LARGE_MAX_M, not gated and for
    ``N`` < WIDE_SPLIT_MAX_N output columns when N is given) while ``split_k`` (default:
    SMALL_M_SPLIT_K) is on, the swapped ones while SMALL_M_SWAP_AB is on."""
    wide_split = [] if gated or (N is not None and N >= WIDE_SPLIT_MAX_N) else [
        c for c in WIDE_M_SPLIT_K_CONFIGS if c.kwargs["SPLIT_K"] <= (4 if M <= 128 else 2)]
    if M <= 16:
        family = SMALL_M_CONFIGS + SMALL_M_SPLIT_K_CONFIGS
    elif M <= SPLIT_K_MAX_M:
        family = MEDIUM_M_CONFIGS + (MEDIUM_M_SWAP_CONFIGS if M <= SWAP_AB_MAX_M else []) + MEDIUM_M_SPLIT_K_CONFIGS
    elif M <= 128:
        family = MEDIUM_M_CONFIGS + wide_split
    elif M <= MEDIUM_LARGE_MAX_M:
        medium = {_signature(c) for c in MEDIUM_M_CONFIGS}
        family = MEDIUM_M_CONFIGS + [c for c in LARGE_M_CONFIGS if _signature(c) not in medium] + wide_split
    else:
        family = LARGE_M_CONFIGS
    if not (SMALL_M_SPLIT_K if split_k is None else split_k):
        family = [c for c in family if c.kwargs.get("SPLIT_K", 1) == 1]
    if not SMALL_M_SWAP_AB:
        family = [c for c in family if not c.kwargs.get("SWAP_AB")]
    if gated:
        # Two accumulators: keep the tile's registers (and shared memory) in budget.
        family = [c for c in family if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128] or family[:1]
    # A config over sm_90's shared memory fails to compile everywhere.
    return [c for c in family if pipeline_shared_memory(c, gated) <= SHARED_MEMORY_LIMIT] or family[:1]


def pipeline_shared_memory(config, gated: bool = False) -> int:
    """Bytes of triton's pipeline buffers for a tiled config: per stage the 1-byte A tile and the
    weight tile (twice when gated). A tile whose MMA side has 64 rows (BLOCK_M, or BLOCK_N when
    SWAP_AB) runs on wgmma and keeps num_stages buffers; 16- and 32-row tiles run on mma.sync and
    keep num_stages - 1. Checked against triton 3.6 on an H200: the gated 64x128x256 s3 asked for
    245760 bytes (3 x 80 KB) and failed in every precompile of sessions 36-40, while the gated
    16x128x256 s4 (68 KB a stage: 272 KB with num_stages buffers, 204 KB with one less) compiles."""
    kw = config.kwargs
    mma_rows = kw["BLOCK_N"] if kw.get("SWAP_AB") else kw["BLOCK_M"]
    buffers = config.num_stages if mma_rows >= 64 else config.num_stages - 1
    return buffers * kw["BLOCK_K"] * (kw["BLOCK_M"] + (2 if gated else 1) * kw["BLOCK_N"])


def _prune_configs(configs, named_args, **kwargs):
    """The autotuner's early prune: ``configs`` narrowed to ``pool_configs`` of the call's M (and N)."""
    gated = named_args.get("GATED", kwargs.get("GATED", False))
    wanted = {id(c) for c in pool_configs(named_args["M"], gated, N=named_args.get("N"))}
    return [c for c in configs if id(c) in wanted]


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


def _fp8_promote_k(args):
    return min(args["BLOCK_K"], 128)


def _split_k(args):
    # The config's SPLIT_K (1 when it has none), clipped as on the cached launch path.
    return split_k_plan(args["K"], args["BLOCK_K"], args.get("SPLIT_K", 1))


def _swap_ab(args):
    # The config's SWAP_AB (False when it has none).
    return bool(args.get("SWAP_AB", False))


HEURISTICS = {"EVEN_K": _even_k, "FP8_PROMOTE_K": _fp8_promote_k, "SPLIT_K": _split_k, "SWAP_AB": _swap_ab}
