"""INT8 / FP8 scaled GEMM on tensor cores with a fused dequant + bias + activation epilogue.

    out[m, n] = act(acc[m, n] * a_scale[m] * w_scale[n] + bias[n])      (fp32, then cast once)
    acc       = sum_k a[m, k] * w[n, k]      int32 for INT8 (exact), fp32 for FP8 e4m3fn

``a`` is the (M, K) quantized activation, ``w`` the (N, K) weight exactly as a checkpoint stores
it (K contiguous: the "transposed B" layout Hopper's FP8 tensor cores want), so no copy is made.

The gated variant reads a stacked [gate; up] weight of 2N rows and has each program compute the
gate tile of columns [n0, n0 + BLOCK_N) *and* the matching up tile (rows N + n0 ...), sharing
the A tile loaded once per K step; the epilogue writes act(gate) * up, N columns, once.

Layers: ``_scaled_mm_kernel`` (@triton.jit) -> ``scaled_mm`` / ``gated_scaled_mm`` launchers
(validate, allocate, grid) -> registered ops in ``triton_ops.py``. The torch twin is
``reference.scaled_mm``.

Split-K (``SPLIT_K`` config key, tiled kernel): each output tile is computed as SPLIT_K K-slices
by as many programs (more programs streaming the weight at decode sizes, where N / BLOCK_N alone
leaves SMs idle); each slice stores its int32 / fp32 partial tile in gemm_tma's per-device
workspace and the last to arrive sums them in slice order (deterministic, INT8 exact), runs the
epilogue and resets its tile's counter (``gemm_epilogue.split_arrive`` / ``split_sum``, shared
with the persistent kernel's split tail). SPLIT_K = 1 compiles to the unsplit kernel. The autotuner
considers the split configs for M <= ``gemm_configs.SPLIT_K_MAX_M`` (64: measured, M = 1 gains on an
H100; on an H200 FP8 at M = 16 with a long K, swapped split tiles at 17 <= M <= 32 and a 2-way split
of 64-row tiles at M = 64, both with a long K or N = 4096) and 128-row split tiles up to M = 256
(not gated; a long K at M = 96-192); ``gemm_configs.SMALL_M_SPLIT_K`` switches them all off.

Four kernels behind ``kernel="auto"`` (``_pick_kernel``), each with the same semantics and epilogue:
- M <= GEMV_MAX_M (1): the tensor-core-free GEMV of ``gemv.py`` (a weight stream; gated too);
- M >= GLUON_MIN_M (gated: GLUON_GATED_MIN_M), or M >= GLUON_WIDE_MIN_M with >= GLUON_WIDE_N
  output columns (``gluon_sized``), on an sm_90 GPU with triton 3.6 or 3.9: the
  warp-specialized Gluon kernel of ``gemm_gluon.py`` (asynchronous wgmma, int32 for INT8), where
  ``gluon_takes`` allows it: INT8, and FP8 with fast accumulation, plain and gated; from
  CONTEST_MIN_M rows, for the narrower outputs ``gluon_sized`` leaves out (``contested``), whichever
  of it and the tiled kernel timed faster on the tuning key's first call (``_contest``);
- otherwise M >= PERSISTENT_MIN_M with 16-byte aligned operands: the persistent TMA kernel of
  ``gemm_tma.py`` (the gated GEMM: for INT8 only, see PERSISTENT_MIN_M);
- everything else: this file's tiled kernel (one program per output tile, pointer loads, the
  gated variant, every M; the one the raw-accumulator and explicit-config calls use).

Tuning (config sets: ``gemm_configs.py``): autotuned over a few configs per M bucket (key N, K,
M_BUCKET) on the GPU, once per key: the chosen config is then cached with a launch plan and the
compiled kernel is launched directly (``launch.CachedLaunch``: no autotuner or JIT binding pass
per eager call); decode sizes
(M <= 16) get GEMV-like configs (a 16-row tile, narrow N tiles, long K tiles, deep pipelines) so
that enough programs stream the weight to saturate memory bandwidth, among them SWAP_AB configs
that compute the tile as (w @ a.T).T: the weight's BLOCK_N rows on the MMA's M side (a 64-row
wgmma per warpgroup on Hopper) and the <= 16 tokens on its N side (``gemm_configs``; with 32-token
tiles also for 17 <= M <= ``gemm_configs.SWAP_AB_MAX_M``, 32). Under the
interpreter one fixed config is used (autotune with several configs fails there; cost is per program).

FP8 accumulation: ``fp8_fast_accum=True`` (the default) lets Hopper's FP8 tensor cores accumulate
a whole K loop without promotion, like ``torch._scaled_mm(use_fast_accum=True)``, vLLM's and
TensorRT-LLM's FP8 GEMMs; ``False`` promotes to fp32 every 128 products (cuBLAS's default mode).
The default is fast because the extra error (rel. 2.7e-3 vs 1.7e-3 at K=14336) is an order of
magnitude below what FP8 quantization of the operands already costs, while promotion holds a
second accumulator tile in registers and caps the tile size (see benchmarks/NOTES-gemm.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels import gemm_gluon, gemm_tma, gemv
from quantkit.kernels.call_cache import SignatureCache
from quantkit.kernels.gemm_checks import (  # noqa: F401 - re-exported: gemm's API
    ACTIVATION_CODES, K_ALIGNMENT, MAX_INT8_K, OUT_DTYPES, check_scaled_mm_args)
from quantkit.kernels.gemm_configs import (  # noqa: F401 - the config sets are part of gemm's API
    ALL_CONFIGS, HEURISTICS, INTERPRETER_CONFIG, LARGE_M_CONFIGS, MEDIUM_M_CONFIGS, MEDIUM_M_SPLIT_K_CONFIGS,
    MEDIUM_M_SWAP_CONFIGS, SMALL_M_CONFIGS, SMALL_M_SPLIT_K_CONFIGS, WIDE_M_SPLIT_K_CONFIGS, _prune_configs,
    m_bucket, split_k_plan, split_k_programs)
from quantkit.kernels.gemm_epilogue import grouped_tile, split_arrive, split_sum, store_tile, tile_mainloop
from quantkit.kernels.launch import (INTERPRETED, CachedLaunch, aligned, cdiv, check_runnable, config_dict,
                                    on_its_gpu, rotated_medians)

# M is not specialized (divisibility by 16, == 1): rows are wrapped, not aligned, so it would only
# multiply the compiled variants per batch size.
@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _scaled_mm_kernel(
    a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, partials_ptr, arrivals_ptr,
    M, N, K, M_BUCKET,
    stride_am, stride_wn, stride_om,
    IS_INT8: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    W_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    GATED: tl.constexpr,
    RAW_ACC: tl.constexpr,
    INTERPRETED: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8_FAST_ACCUM: tl.constexpr,
    FP8_PROMOTE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
):
    if SPLIT_K == 1:
        tile_id = tl.program_id(0)
    else:
        # SPLIT_K programs per output tile, adjacent in launch order (the slices of a tile run
        # side by side, so its combine is not left to the last wave).
        tile_id = tl.program_id(0) // SPLIT_K
        split_id = tl.program_id(0) % SPLIT_K
    pid_m, pid_n = grouped_tile(tile_id, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N are wrapped onto valid rows instead of masked: the loads stay unmasked
    # (vectorized) and the extra results are simply not stored.
    rows_a = offs_m % M
    rows_w = offs_n % N
    if SWAP_AB:
        # Decode: the product is computed transposed, (w @ a.T).T, so the weight's BLOCK_N rows
        # fill the MMA's M side (64 rows per warpgroup instruction on Hopper) and the BLOCK_M
        # (<= 16) tokens its N side; the weight tile is the (BLOCK_N, BLOCK_K) first operand, the
        # activation a K-contiguous (BLOCK_K, BLOCK_M) second operand.
        a_ptrs = a_ptr + rows_a.to(tl.int64)[None, :] * stride_am + offs_k[:, None]
        w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    else:
        a_ptrs = a_ptr + rows_a.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        # Loaded as a (BLOCK_K, BLOCK_N) tile of the (N, K) weight: K-contiguous B for tl.dot.
        w_ptrs = w_ptr + rows_w.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    if SPLIT_K == 1:
        k_begin = 0
        k_end = K
    else:
        # Slice s covers the K steps [s * k_tiles // SPLIT_K, (s + 1) * k_tiles // SPLIT_K): at
        # least one each (split_k_plan); the masked K tail falls in the last slice.
        k_tiles = tl.cdiv(K, BLOCK_K)
        k_begin = split_id * k_tiles // SPLIT_K * BLOCK_K
        k_end = (split_id + 1) * k_tiles // SPLIT_K * BLOCK_K
        a_ptrs += k_begin
        w_ptrs += k_begin
    if SWAP_AB:
        acc_t, acc_up_t = tile_mainloop(w_ptrs, a_ptrs, N * stride_wn, offs_k, K, k_begin, k_end, BLOCK_N, BLOCK_M,
                                        BLOCK_K, IS_INT8, GATED, EVEN_K, FP8_FAST_ACCUM, FP8_PROMOTE_K, True)
        acc = tl.trans(acc_t)
        acc_up = tl.trans(acc_up_t)
    else:
        acc, acc_up = tile_mainloop(a_ptrs, w_ptrs, N * stride_wn, offs_k, K, k_begin, k_end, BLOCK_M, BLOCK_N,
                                    BLOCK_K, IS_INT8, GATED, EVEN_K, FP8_FAST_ACCUM, FP8_PROMOTE_K, False)

    if SPLIT_K == 1:
        store_tile(acc, acc_up, offs_m, offs_n, M, N, out_ptr, stride_om, a_scale_ptr, w_scale_ptr, bias_ptr,
                   A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS, ACTIVATION, GATED, RAW_ACC, INTERPRETED)
    else:
        # One slot of TILE (gate) or 2 x TILE (gate, up) elements per program, the slices of a
        # tile side by side; only the rows < M are stored and summed (at M = 1 a sixteenth of
        # the tile: the combine's traffic stays small next to the weight's).
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        SLOT: tl.constexpr = 2 * TILE if GATED else TILE
        tile_slots = partials_ptr + (tile_id * SPLIT_K).to(tl.int64) * SLOT
        offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        row_mask = (offs_m < M)[:, None]
        tl.store(tile_slots + split_id * SLOT + offsets, acc, mask=row_mask)
        if GATED:
            tl.store(tile_slots + split_id * SLOT + TILE + offsets, acc_up, mask=row_mask)
        if split_arrive(arrivals_ptr + tile_id, SPLIT_K):
            acc = split_sum(tile_slots, offsets, row_mask, SLOT, SPLIT_K)
            if GATED:
                acc_up = split_sum(tile_slots + TILE, offsets, row_mask, SLOT, SPLIT_K)
            store_tile(acc, acc_up, offs_m, offs_n, M, N, out_ptr, stride_om, a_scale_ptr, w_scale_ptr,
                       bias_ptr, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS, ACTIVATION, GATED, RAW_ACC, INTERPRETED)
            tl.store(arrivals_ptr + tile_id, 0)


# ----------------------------------------------------------------------------------------------
# Autotuning (the config sets, pruning and heuristics live in gemm_configs.py)
# ----------------------------------------------------------------------------------------------

# Configs are timed by gemm_tma's autotune timer (CUDA-graph replay, L2 flushed per call), as
# the persistent kernel's are. The split-K configs are always among the autotuner's configs;
# _prune_configs admits them by M (gemm_configs.pool_configs) while gemm_configs.SMALL_M_SPLIT_K is on.
_scaled_mm_autotuned = triton.autotune(
    configs=ALL_CONFIGS,
    key=["N", "K", "M_BUCKET", "IS_INT8", "FP8_FAST_ACCUM", "GATED", "HAS_BIAS", "ACTIVATION"],
    prune_configs_by={"early_config_prune": _prune_configs},
    **gemm_tma.AUTOTUNE_EXTRA,
)(triton.heuristics(HEURISTICS)(_scaled_mm_kernel))


def _check_runnable(a: torch.Tensor) -> None:
    check_runnable(a, "a")


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


KERNELS = ("auto", "tiled", "persistent", "gluon", "gemv")
# kernel="auto" takes the persistent TMA kernel from this M on (measured on an H100 at
# M = 1024 and 4096, all four Llama-3-8B shapes, INT8 and both FP8 modes: persistent 2-15 %
# faster than tiled everywhere); below it the GEMM is partly weight-bandwidth bound and the
# tiled kernel's small/medium-M configs apply. The gated GEMM takes it for INT8 only (H100,
# gate_up 2 x 14336 x 4096, M = 1024 / 4096 / 8192: INT8 persistent 6-9 % faster than tiled,
# FP8 persistent 5-13 % slower; benchmarks/NOTES-gemm.md, session 3).
PERSISTENT_MIN_M = 1024
# kernel="auto" takes the warp-specialized Gluon kernel (gemm_gluon) for INT8 and FP8 (fast
# accumulation) from this M on, where it runs (sm_90, triton 3.6 or 3.9): asynchronous wgmma (int32 for
# INT8, which triton 3.6 does not generate for tl.dot), and a 128x128 ping-pong config for partial
# last waves, tuned per shape among gemm_gluon.candidates. Measured on an H100, the four
# Llama-3-8B shapes, plain epilogue (benchmarks/NOTES-gemm.md): INT8 1.03-1.55x the Triton INT8
# kernel at M = 1024 / 4096 / 16384 (session 8); FP8 1.004-1.082x the Triton FP8 kernel there
# (session 10); at M = 256 and 512 the fastest candidate beat the tiled Triton kernel at all 8
# points, FP8 1.05-1.29x and INT8 1.04-1.48x (session 10, results/gemm_gluon_s10_m256_512_h100.*).
# Promoted FP8 stays on Triton (the Gluon kernel accumulates in the fast mode only). From session 48
# M = 256 itself is contested (below): it is the top of the tiled kernel's tuning bucket of
# 129-256, whose pool gained 128-row split tiles, and at M = 256 they took 37.4 / 38.7 us against
# the Gluon kernel's 40.4 / 40.1 at 4096x14336 FP8 / INT8 (results/gemm_wide_split_s48_h200.*), the
# tiled pick 14.4 against 15.5 at 4096x4096 FP8 (gemm_medium_pool_s48_split_h200.*; INT8 15.9
# against 15.3: there the contest keeps the Gluon kernel). With the contest at M = 256
# (results/gemm_medium_pool_s48_m256_h200.*): tiled kept at 4096x14336 (37.7 / 38.8 us, the Gluon
# pick 40.6 / 40.4), 4096x4096 FP8 (14.6 against 15.4) and Gemma-3-270M's 640x2048 (5.9 / 6.3 us
# against 9.2 / 9.3, where bf16 takes 6.6), Gluon kept at 6144x4096 and 4096x4096 INT8.
GLUON_MIN_M = 257
# The gated GEMM (gated_scaled_mm) takes the Gluon kernel's gated mode for INT8 from this M:
# gate_up 2 x 14336 x 4096 on an H100, tuned gated Gluon vs the Triton gated kernel "auto" used
# otherwise: 1.13x / 1.36x at M = 256 / 512 (tiled; session 10,
# results/gemm_gluon_gated_s10_m256_512_h100.*) and 1.20-1.34x at M = 1024 / 4096 / 16384
# (persistent; session 8, results/gemm_gluon_gated_s8_h100.json). Gated FP8 (fast accumulation)
# too since session 11: its fastest gated config against the tiled Triton gated FP8 kernel was
# 1.06x / 1.15x at M = 256 / 512 (session 10) and 1.14x / 1.14x / 1.05x at M = 1024 / 4096 / 16384
# (results/gemm_gluon_gated_s11_h100.*), both with the Triton kernel tuned by eager do_bench; against
# it tuned by the graph timer 1.05x / 1.13x / 1.18x at M = 256 / 1024 / 4096 (session 13,
# results/gemm_gluon_gated_s13_fp8_pinned_h100.*). From session 49 M = 256 itself is contested for
# outputs narrower than GLUON_WIDE_N, as the plain GEMM's: on an H200 at M = 256 the tiled gated
# kernel's pick took 7.0 / 7.3 us against the Gluon pick's 8.1 / 8.1 at Gemma-3-270M's 2 x 2048 x 640
# (FP8 / INT8), while the Gluon pick won at 2 x 4864 x 896, 2 x 6912 x 1152, 2 x 4096 x 4096 and
# 2 x 6144 x 4096 (1.07-1.28x; results/gemm_medium_pool_s49_gated256_h200.*).
GLUON_GATED_MIN_M = 257
# Below those, from GLUON_WIDE_MIN_M rows on, kernel="auto" takes the Gluon kernel for an output of
# at least GLUON_WIDE_N columns (gated: N, the outputs), plain and gated: enough 128-column tiles
# to spread over the SMs at these few rows. Measured on an H200 (session 40, benchmarks/gemm_gluon.py,
# results/gemm_gluon_s40_medium_h200.*, gemm_gluon_gated_s40_medium_h200.*), the Gluon kernel's tuned
# pick against the tiled kernel's autotuned one, FP8 / INT8, at M = 96 and 128: 1.06-1.08x /
# 1.09-1.11x at 28672x4096, 1.02x / 1.05x at 14336x4096, the gated 2 x 14336 x 4096 1.03-1.04x /
# 1.02-1.03x; gated M = 64 0.92x / 0.94x (so from 96). At M = 129..255 against the large-M tiled
# pool of then: 1.10-1.22x / 1.27-1.36x at 28672x4096, gated 1.10-1.11x / 1.25-1.26x. Narrow outputs
# lose on it: at M = 128, 4096x14336 (32 tiles) 0.78x (session 38, results/gemm_gluon_s38_m128_h200.*;
# a first form of this rule, by weight size, took it there: 39.9 us in session 40's standard run
# against 30.9 us tiled in session 39's), 4096x4096 0.73x, 6144x4096 0.99x, and the Gemma-3-270M
# sizes (640x2048, 1024x640, gated 2 x 2048 x 640) 0.69-1.02x.
GLUON_WIDE_MIN_M = 96
GLUON_WIDE_N = 8192
# From CONTEST_MIN_M rows up to GLUON_MIN_M, an output that gluon_sized leaves to the tiled kernel
# (fewer than GLUON_WIDE_N columns) can go either way, so kernel="auto" times the two kernels'
# tuned calls on a tuning key's first call and keeps the faster (``_contest``; CONTEST_TIMES holds
# the times). Measured on an H200 at M = 192 (session 41, results/gemm_medium_pool_s41_h200.*): the
# Gluon kernel won 6 of 16 contests, auto then 1.04-1.24x the tiled pick (INT8 4096x14336 1.13x,
# 6144x4096 FP8 1.07x / INT8 1.12x, gated 2 x 4096 x 4096 1.12x / 1.24x); the tiled kernel kept the
# Gemma-3-270M sizes, where the Gluon kernel took 1.12-1.58x as long. At M = 128 the Gluon kernel
# lost at every narrow output measured (session 38: 0.73-0.99x), hence 129: the contest covers the
# tiled kernel's M bucket of 256 only (129-256, M = 256 included since session 48).
CONTEST_MIN_M = 129
CONTEST_ROUNDS = 3
# Per tuning key, the contest's winner ("tiled" or "gluon") and its times (ms) per kernel.
_CONTESTS: dict[tuple, str] = {}
CONTEST_TIMES: dict[tuple, dict[str, float]] = {}
# kernel="auto" takes the tensor-core-free GEMV (gemv.py) up to this M: measured on an H100 at
# M = 1, the four Llama-3-8B shapes, both dtypes: 1.18-1.33x the tiled split-K kernel with the L2
# flushed, 1.09-1.41x with rotated weights; at M = 4 it was slower (0.65-0.87x), M = 2 unmeasured
# (benchmarks/NOTES-gemm.md, session 8). The gated GEMM too (gate and up rows in one program);
# not for the raw accumulator.
GEMV_MAX_M = 1


_TILED = CachedLaunch(_scaled_mm_kernel)
# Autotuned configs per tuning key, read back from the autotuner after its first run for a key:
# later calls launch the plain JIT kernel with it (no Autotuner/Heuristics pass per call).
_TUNED_TILED: dict = {}
# Per tuning key, everything a launch with the tuned config needs (built once).
_TILED_PLANS: dict = {}
# Order of the epilogue flags in the tuple _launch builds (kernel parameter names, both kernels).
FLAG_NAMES = gemm_tma.FLAG_NAMES


def _tiled_plan(config: dict, flags: tuple, gated: bool, fp8_fast_accum: bool, K: int) -> tuple:
    cfg = dict(config)
    num_warps = cfg.pop("num_warps", 4)
    num_stages = cfg.pop("num_stages", 3)
    # The config's SPLIT_K is a request; the kernel gets the plan's count (a constexpr: K, and so
    # the count, is part of every key this plan is cached under).
    constexprs = dict(zip(FLAG_NAMES, flags), GATED=gated, INTERPRETED=INTERPRETED, EVEN_K=K % cfg["BLOCK_K"] == 0,
                      FP8_FAST_ACCUM=fp8_fast_accum, FP8_PROMOTE_K=min(cfg["BLOCK_K"], 128),
                      **{**cfg, "SPLIT_K": split_k_plan(K, cfg["BLOCK_K"], cfg.get("SPLIT_K", 1)),
                         "SWAP_AB": HEURISTICS["SWAP_AB"](cfg)})
    # Sorted: two configs with the same values under different keys must not share a binary.
    config_key = (*sorted(cfg.items()), num_warps, num_stages)
    return cfg["BLOCK_M"], cfg["BLOCK_N"], constexprs, num_warps, num_stages, config_key


def _launch_tiled(a, w, out, a_scale, w_scale, bias, flags: tuple, gated, fp8_fast_accum, config):
    call = _tiled_call(a, w, out, a_scale, w_scale, bias, flags, gated, fp8_fast_accum, config)
    if call is not None:
        call(a, w, out, a_scale, w_scale, bias if bias is not None else a_scale)
    return out


def _tiled_tune_key(a, out, bias_arg, flags: tuple, gated, fp8_fast_accum) -> tuple:
    """The tiled autotuner's key of a call (``flags`` holds the activation's code and whether there is a bias)."""
    return (out.shape[1], a.shape[1], m_bucket(a.shape[0]), gated, fp8_fast_accum, flags, a.dtype, out.dtype,
            bias_arg.dtype)


def _tiled_call(a, w, out, a_scale, w_scale, bias, flags: tuple, gated, fp8_fast_accum, config) -> TiledCall | None:
    """This call's tiled launch as a ``TiledCall``; None when the autotuner's first call for the
    tuning key has launched it already."""
    K = a.shape[1]
    bias_arg = bias if bias is not None else a_scale
    tune_key = _tiled_tune_key(a, out, bias_arg, flags, gated, fp8_fast_accum)
    if config is None and not INTERPRETED:
        plan = _TILED_PLANS.get(tune_key)
        if plan is None:
            config = _TUNED_TILED.get(tune_key)
            if config is None:
                _autotune_tiled(a, w, out, a_scale, w_scale, bias_arg, flags, gated, fp8_fast_accum, 2 if gated else 1)
                _TUNED_TILED[tune_key] = config_dict(_scaled_mm_autotuned.best_config)
                return None
            plan = _TILED_PLANS[tune_key] = _tiled_plan(config, flags, gated, fp8_fast_accum, K)
    else:
        plan = _tiled_plan(config or INTERPRETER_CONFIG, flags, gated, fp8_fast_accum, K)
    return TiledCall(plan, tune_key, a, w, out, gated)


class TiledCall:
    """A tiled launch minus its addresses (grid, integer arguments, constexprs, the key without
    the pointers' alignment, the no-split workspace), as ``gemm_tma.PersistentCall``."""

    __slots__ = ("key", "grid", "ints", "constexprs", "num_warps", "num_stages", "workspace", "slots", "tile_elems")

    def __init__(self, plan: tuple, tune_key: tuple, a, w, out, gated: bool) -> None:
        block_m, block_n, self.constexprs, self.num_warps, self.num_stages, config_key = plan
        M, K = a.shape
        N = out.shape[1]
        splits = self.constexprs["SPLIT_K"]
        programs = cdiv(M, block_m) * cdiv(N, block_n) * splits
        self.grid = (programs,)
        self.ints = (M, N, K, tune_key[2], a.stride(0), w.stride(0), out.stride(0))
        # N, K and the row strides are specialized by value (N and K are in tune_key); M and
        # M_BUCKET are do_not_specialize'd (only their int64-ness matters).
        self.key = (tune_key, config_key, *self.ints[4:], M >= 2**31)
        # Every launch passes the workspace (unused without a split), so the autotuner's launches
        # and the plans' share one pointer signature, and so one compiled binary. A split slot
        # holds the gate and the up partial tile when gated.
        self.slots, self.tile_elems = (programs if splits > 1 else 0), (2 if gated else 1) * block_m * block_n
        self.workspace = gemm_tma.call_workspace(a, self.slots, self.tile_elems)

    def __call__(self, a, w, out, a_scale, w_scale, bias_arg) -> None:
        partials, arrivals = self.workspace or gemm_tma._workspace_args(a, self.slots, self.tile_elems)
        _TILED((self.key, aligned(a, w, out, a_scale, w_scale, bias_arg, partials, arrivals)), self.grid,
               (a, w, out, a_scale, w_scale, bias_arg, partials, arrivals, *self.ints), self.constexprs,
               self.num_warps, self.num_stages)


def _autotune_tiled(a, w, out, a_scale, w_scale, bias_arg, flags, gated, fp8_fast_accum, tile_copies):
    """First call of a tuning key: the autotuner times its pool (``_prune_configs``) and launches the best."""
    M, K = a.shape
    N = out.shape[1]

    def grid(meta):
        return (split_k_programs(M, N, K, meta)[1],)

    # A workspace for the largest split config of the pool (none: the no-split stand-in).
    pool = [c.all_kwargs() for c in _prune_configs(_scaled_mm_autotuned.configs, {"M": M, "N": N, "GATED": gated})]
    needs = [(split_k_programs(M, N, K, c)[1], tile_copies * c["BLOCK_M"] * c["BLOCK_N"])
             for c in pool if split_k_programs(M, N, K, c)[0] > 1]
    if needs:
        programs = max(p for p, _ in needs)
        partials, arrivals = gemm_tma._workspace_args(a, programs, cdiv(max(p * e for p, e in needs), programs))
    else:
        partials, arrivals = gemm_tma._workspace_args(a, 0, 1)
    _scaled_mm_autotuned[grid](a, w, out, a_scale, w_scale, bias_arg, partials, arrivals, M, N, K, m_bucket(M),
                               a.stride(0), w.stride(0), out.stride(0), **dict(zip(FLAG_NAMES, flags)), GATED=gated,
                               INTERPRETED=False, FP8_FAST_ACCUM=fp8_fast_accum)


def persistent_sized(M: int, is_int8: bool, gated: bool) -> bool:
    """Whether kernel="auto" wants the persistent kernel for M rows, its operands' alignment aside
    (the gated GEMM: for INT8 only). Also the rule the benchmarks precompile and pin Triton by."""
    return M >= PERSISTENT_MIN_M and (is_int8 or not gated)


def _persistent_sized(a, gated) -> bool:
    return persistent_sized(a.shape[0], a.dtype == torch.int8, gated)


def gluon_takes(a, w, out, gated, flags, pointers: bool = True) -> bool:
    """Whether this call can run on the Gluon kernel: INT8 or FP8, plain or gated (its gated mode:
    the stacked [gate; up] weight, two accumulators), no raw accumulator, per-row and per-column
    (gated: per weight row, 2N) scales, a 16-bit output, TMA-compatible operands, a Gluon-capable GPU.
    ``pointers=False``: all of it but the base pointers' alignment (what a call signature fixes)."""
    tma_ok = gemm_tma.descriptors_ok(a, w, out) if pointers else gemm_tma.strides_ok(a, w, out)
    return (not flags[5] and flags[1] and flags[2] and out.dtype in (torch.bfloat16, torch.float16)
            and a.shape[1] % 16 == 0 and tma_ok and gemm_gluon.available())


def gluon_sized(M: int, N: int, gated: bool) -> bool:
    """Whether kernel="auto" wants the Gluon kernel for M rows and N output columns (gated: N
    outputs), where ``gluon_takes`` allows it: from GLUON_MIN_M (gated: GLUON_GATED_MIN_M) rows, and
    from GLUON_WIDE_MIN_M for at least GLUON_WIDE_N columns."""
    if M >= (GLUON_GATED_MIN_M if gated else GLUON_MIN_M):
        return True
    return M >= GLUON_WIDE_MIN_M and N >= GLUON_WIDE_N


def contested(M: int, N: int, gated: bool) -> bool:
    """Whether kernel="auto" times the tiled kernel against the Gluon kernel for M rows and N output
    columns (gated: N outputs): from CONTEST_MIN_M rows where ``gluon_sized`` does not take Gluon."""
    return M >= CONTEST_MIN_M and not gluon_sized(M, N, gated)


def _gluon_form(a, fp8_fast_accum) -> bool:
    """Whether the Gluon kernel has this call's form (INT8, or FP8 with fast accumulation) and runs
    here (not under the interpreter)."""
    return (a.dtype == torch.int8 or fp8_fast_accum) and not INTERPRETED


def _gluon_sized(a, out, gated, fp8_fast_accum) -> bool:
    """``gluon_sized`` for this call (``out``: its (M, N) output), in the forms the Gluon kernel
    has: INT8, and FP8 with fast accumulation, plain and gated."""
    return _gluon_form(a, fp8_fast_accum) and gluon_sized(a.shape[0], out.shape[1], gated)


def _contested(a, out, gated, fp8_fast_accum) -> bool:
    """``contested`` for this call, in the Gluon kernel's forms."""
    return _gluon_form(a, fp8_fast_accum) and contested(a.shape[0], out.shape[1], gated)


def _contest(a, w, a_scale, w_scale, bias, out, activation, gated, flags, fp8_fast_accum) -> str:
    """The faster of "tiled" and "gluon" for this call's tuning key: on its first call, each
    kernel's tuned call (each tuner runs first, on these tensors) timed by the tuners' timer
    (CUDA-graph replays, L2 flushed) in CONTEST_ROUNDS rotated rounds, medians compared. Like the
    tuners, this cannot run inside a graph capture (warm up first)."""
    bias_arg = bias if bias is not None else a_scale
    key = _tiled_tune_key(a, out, bias_arg, flags, gated, fp8_fast_accum) + (a.device,)
    kind = _CONTESTS.get(key)
    if kind is None:
        if a.is_cuda:
            gemm_tma.refuse_tuning_in_capture()
        # The first _tiled_call of a new tuning key runs the autotuner (which launches) and returns
        # None; the second gives the call.
        tiled = _tiled_call(a, w, out, a_scale, w_scale, bias, flags, gated, fp8_fast_accum, None)
        calls = {"tiled": tiled or _tiled_call(a, w, out, a_scale, w_scale, bias, flags, gated, fp8_fast_accum, None),
                 "gluon": gemm_gluon.tuned_call(a, w, out, a_scale, w_scale, bias, activation, gated)}
        times, _ = rotated_medians(calls, lambda call: gemm_tma._graph_bench_ms(
            lambda: call(a, w, out, a_scale, w_scale, bias_arg)), CONTEST_ROUNDS)
        CONTEST_TIMES[key] = times
        kind = _CONTESTS[key] = min(times, key=times.get)
    return kind


def _flags(a, a_scale, w_scale, bias, activation, raw_acc) -> tuple:
    """The epilogue flags in FLAG_NAMES order. A 1-element scale is a broadcast scalar even when M
    or N == 1 (same result either way)."""
    return (a.dtype == torch.int8, a_scale.numel() != 1, w_scale.numel() != 1, bias is not None,
            ACTIVATION_CODES[activation], raw_acc)


def _pick_kernel(kernel, a, w, out, gated, config, flags, fp8_fast_accum: bool) -> str:
    if kernel == "auto" and config is not None:
        # An explicit config names its kernel by its keys (only the persistent one splits its epilogue).
        kernel = "persistent" if "EPILOGUE_SPLIT" in config else "tiled"
    if kernel == "gluon":
        if config is not None or not gluon_takes(a, w, out, gated, flags):
            raise ValueError(
                "kernel='gluon' needs an sm_90 GPU with triton 3.6 or 3.9, no config, per-row and per-column scales, a "
                "bf16/fp16 output, K % 16 == 0 and 16-byte aligned operands: use kernel='auto'"
            )
        return "gluon"
    if kernel == "gemv":
        if config is not None or flags[5] or a.shape[0] > gemv.MAX_M:
            raise ValueError(f"kernel='gemv' takes calls without config and M <= {gemv.MAX_M} rows "
                             f"(M={a.shape[0]}): use kernel='auto'")
        return "gemv"
    if kernel == "auto":
        if a.shape[0] <= GEMV_MAX_M and not flags[5]:
            return "gemv"
        if _gluon_sized(a, out, gated, fp8_fast_accum) and gluon_takes(a, w, out, gated, flags):
            return "gluon"
        return "persistent" if _persistent_sized(a, gated) and gemm_tma.descriptors_ok(a, w, out) else "tiled"
    if kernel == "persistent":
        if not gemm_tma.descriptors_ok(a, w, out):
            raise ValueError(
                "kernel='persistent' needs 16-byte aligned a, w and out (base pointers and row strides; out's row "
                "is N * element size bytes): use kernel='auto' or 'tiled'"
            )
        return "persistent"
    return "tiled"


def _launch(a, w, a_scale, w_scale, bias, out, activation, gated, raw_acc, config=None, fp8_fast_accum=True,
            kernel="auto"):
    picked = _pick(a, w, a_scale, w_scale, bias, out, activation, gated, raw_acc, config, fp8_fast_accum, kernel)
    if picked is not None:
        kind, flags, fp8_fast_accum = picked
        if kind == "gemv":
            gemv._launch(a, w, out, a_scale, w_scale, bias, activation, False, None, gated)
        elif kind == "gluon":
            gemm_gluon.tuned_call(a, w, out, a_scale, w_scale, bias, activation, gated)(
                a, w, out, a_scale, w_scale, bias if bias is not None else w_scale)
        elif kind == "persistent":
            gemm_tma.launch_persistent(a, w, out, a_scale, w_scale, bias, flags, m_bucket(a.shape[0]), fp8_fast_accum,
                                       INTERPRETED, config, gated=gated)
        else:
            _launch_tiled(a, w, out, a_scale, w_scale, bias, flags, gated, fp8_fast_accum, config)
    return out


def _call(a, w, a_scale, w_scale, bias, out, activation, gated, raw_acc, config, fp8_fast_accum, kernel):
    """``_launch``'s launch as an object (a ``TiledCall`` or ``gemm_tma.PersistentCall``); None when
    there is nothing (left) to launch: an empty output, or the autotuner launched it."""
    picked = _pick(a, w, a_scale, w_scale, bias, out, activation, gated, raw_acc, config, fp8_fast_accum, kernel)
    if picked is None:
        return None
    kind, flags, fp8_fast_accum = picked
    if kind == "gemv":
        return _GemvCall(bias is not None, activation, gated)
    if kind == "gluon":
        return gemm_gluon.tuned_call(a, w, out, a_scale, w_scale, bias, activation, gated)
    if kind == "persistent":
        return gemm_tma.persistent_call(a, w, out, a_scale, w_scale, bias, flags, m_bucket(a.shape[0]),
                                        fp8_fast_accum, INTERPRETED, config, gated=gated)
    return _tiled_call(a, w, out, a_scale, w_scale, bias, flags, gated, fp8_fast_accum, config)


class _GemvCall:
    """``gemv``'s launch in the shape of the other cached calls (the GEMV keeps its own plan cache)."""

    __slots__ = ("has_bias", "activation", "gated")

    def __init__(self, has_bias: bool, activation: str, gated: bool) -> None:
        self.has_bias, self.activation, self.gated = has_bias, activation, gated

    def __call__(self, a, w, out, a_scale, w_scale, bias_arg) -> None:
        gemv._launch(a, w, out, a_scale, w_scale, bias_arg if self.has_bias else None, self.activation, False, None,
                     self.gated)


def _pick(a, w, a_scale, w_scale, bias, out, activation, gated, raw_acc, config, fp8_fast_accum, kernel):
    """(kernel kind, epilogue flags, fp8_fast_accum) of a validated call; None for an empty output."""
    M, K = a.shape
    N = out.shape[1]
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}")
    if M == 0 or N == 0:
        return None
    if K == 0:  # check_scaled_mm_args refuses it first (fake and real alike); kept for direct callers
        raise ValueError("K=0: nothing to multiply; the GEMM needs K >= 16")
    is_int8 = a.dtype == torch.int8
    fp8_fast_accum = bool(fp8_fast_accum) and not is_int8  # meaningless for INT8: one compiled variant
    flags = _flags(a, a_scale, w_scale, bias, activation, raw_acc)
    if kernel == "gluon" and not is_int8 and not fp8_fast_accum:
        raise ValueError("kernel='gluon' accumulates FP8 in the tensor cores' fast mode only; "
                         "use kernel='auto' for fp8_fast_accum=False")
    kind = _pick_kernel(kernel, a, w, out, gated, config, flags, fp8_fast_accum)
    if (kind == "tiled" and kernel == "auto" and config is None and _contested(a, out, gated, fp8_fast_accum)
            and gluon_takes(a, w, out, gated, flags)):
        kind = _contest(a, w, a_scale, w_scale, bias, out, activation, gated, flags, fp8_fast_accum)
    return kind, flags, fp8_fast_accum


# Validated calls without config= / out= (GPU path), by signature: every tensor's shape, strides,
# dtype and device, the flags (call_cache.SignatureCache). An entry holds the output's size and
# the call's launch object (TiledCall, gemm_tma.PersistentCall, gemm_gluon.GluonCall, _GemvCall),
# so a repeated call skips validation, the kernel choice, the plan and key lookups (CPU: ~27 ->
# ~12 us per call, benchmarks/NOTES-e2e.md, session 6b). Settings read when an entry is made
# (PERSISTENT_MIN_M, GLUON_MIN_M, GLUON_GATED_MIN_M, GLUON_WIDE_*, CONTEST_MIN_M, GEMV_MAX_M,
# gemm_configs.SMALL_M_SPLIT_K and SMALL_M_SWAP_AB): clear _CALLS after changing them.
_CALLS = SignatureCache()


def _cached_call(entry, a, w, a_scale, w_scale, bias):
    M, N, out_dtype, device, call, persistent, activation, gated, fp8_fast_accum, kernel = entry
    # Sizes as separate ints: torch parses them ~0.7 us faster than a tuple (session 6).
    out = torch.empty(M, N, dtype=out_dtype, device=device)
    if persistent and not gemm_tma.pointers_aligned(a, w, out):
        # TMA descriptors need 16-byte aligned bases, which the signature does not fix: this call
        # picks its kernel anew (tiled for "auto", the error for "persistent").
        return _launch(a, w, a_scale, w_scale, bias, out, activation, gated, False, None, fp8_fast_accum, kernel)
    call(a, w, out, a_scale, w_scale, bias if bias is not None else a_scale)
    return out


def _launch_new(signature, a, w, a_scale, w_scale, bias, out, activation, gated, config, fp8_fast_accum, kernel):
    """The full path of a validated call; keeps its launch under ``signature`` (None: do not)."""
    if signature is None:
        return _launch(a, w, a_scale, w_scale, bias, out, activation, gated, False, config, fp8_fast_accum, kernel)
    call = _call(a, w, a_scale, w_scale, bias, out, activation, gated, False, config, fp8_fast_accum, kernel)
    if call is None:
        return out
    call(a, w, out, a_scale, w_scale, bias if bias is not None else a_scale)
    # Both TMA kernels need 16-byte aligned bases, which the signature does not fix.
    persistent = isinstance(call, (gemm_tma.PersistentCall, gemm_gluon.GluonCall))
    # A tiled pick that only unaligned pointers forced (kernel "auto", an M the persistent or the
    # Gluon kernel would take) is not kept: the next, aligned call of this signature must get that kernel.
    # (A contest's tiled winner, on aligned pointers, is kept.)
    by_pointers = (not persistent and kernel == "auto" and gemm_tma.strides_ok(a, w, out)
                   and not gemm_tma.pointers_aligned(a, w, out)) and (
        _persistent_sized(a, gated) or (
            (_gluon_sized(a, out, gated, fp8_fast_accum) or _contested(a, out, gated, fp8_fast_accum))
            and gluon_takes(a, w, out, gated, _flags(a, a_scale, w_scale, bias, activation, False), pointers=False)))
    if not by_pointers:
        _CALLS.add(signature, (out.shape[0], out.shape[1], out.dtype, out.device, call, persistent, activation, gated,
                               fp8_fast_accum, kernel))
    return out


def _output(out, M, N, dtype, device):
    if out is None:
        return torch.empty(M, N, dtype=dtype, device=device)
    if out.shape != (M, N) or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}; expected a contiguous ({M}, {N}) {dtype} "
            f"tensor on {device}"
        )
    return out


@on_its_gpu
def scaled_mm(a, w, a_scale, w_scale, bias=None, activation="none", out_dtype=torch.bfloat16, config=None, out=None,
              fp8_fast_accum: bool = True, kernel: str = "auto"):
    """``act((a @ w.T) * a_scale[:, None] * w_scale[None, :] + bias)`` -> (M, N) out_dtype.

    ``fp8_fast_accum``: FP8 only; False promotes the accumulator to fp32 every 128 products
    (module docstring). ``kernel``: "auto", "tiled" or "persistent" (TMA; needs 16-byte aligned
    operands). ``config`` (dict of the chosen kernel's BLOCK_M/N/K, GROUP_M, num_warps,
    num_stages, ...) bypasses autotuning and ``out`` receives the result; ``config``, ``out`` and
    ``kernel`` are for benchmarks and tests (the registered op takes none of them). Calls
    without ``config`` / ``out`` are cached per signature (``_CALLS``).
    """
    signature = None
    if config is None and out is None and not INTERPRETED:
        try:
            signature = (a.shape, a.stride(), a.dtype, a.device, w.shape, w.stride(), w.dtype, w.device,
                         a_scale.shape, a_scale.stride(), a_scale.dtype, a_scale.device,
                         w_scale.shape, w_scale.stride(), w_scale.dtype, w_scale.device,
                         None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
                         activation, out_dtype, fp8_fast_accum, kernel, False)
        except AttributeError:  # an argument is not a tensor: the checks below name it
            signature = None
        entry = _CALLS.get(signature)
        if entry is not None:
            return _cached_call(entry, a, w, a_scale, w_scale, bias)
    M, N, _ = check_scaled_mm_args(a, w, a_scale, w_scale, bias, activation, out_dtype)
    _check_runnable(a)
    out = _output(out, M, N, out_dtype, a.device)
    return _launch_new(signature, a, w, a_scale, w_scale, bias, out, activation, False, config, fp8_fast_accum, kernel)


@on_its_gpu
def gated_scaled_mm(a, w_gate_up, a_scale, w_scale, activation="silu", out_dtype=torch.bfloat16, config=None,
                    out=None, fp8_fast_accum: bool = True, kernel: str = "auto"):
    """``act(gate) * up`` for a stacked (2N, K) [gate; up] weight -> (M, N), one GEMM, one write.

    ``kernel`` as for ``scaled_mm``: "auto" takes the Gluon kernel's gated mode for INT8 and for
    FP8 with fast accumulation from GLUON_GATED_MIN_M rows (from GLUON_WIDE_MIN_M for >= GLUON_WIDE_N
    outputs) where it runs (sm_90, triton 3.6 / 3.9; per-row and per-column scales), else the
    persistent TMA kernel from PERSISTENT_MIN_M rows for INT8 (for FP8 the tiled kernel measured
    faster).
    """
    signature = None
    if config is None and out is None and not INTERPRETED:
        try:
            signature = (a.shape, a.stride(), a.dtype, a.device, w_gate_up.shape, w_gate_up.stride(),
                         w_gate_up.dtype, w_gate_up.device, a_scale.shape, a_scale.stride(), a_scale.dtype,
                         a_scale.device, w_scale.shape, w_scale.stride(), w_scale.dtype, w_scale.device, None,
                         activation, out_dtype, fp8_fast_accum, kernel, True)
        except AttributeError:  # an argument is not a tensor: the checks below name it
            signature = None
        entry = _CALLS.get(signature)
        if entry is not None:
            return _cached_call(entry, a, w_gate_up, a_scale, w_scale, None)
    M, N, _ = check_scaled_mm_args(a, w_gate_up, a_scale, w_scale, None, activation, out_dtype, gated=True)
    _check_runnable(a)
    out = _output(out, M, N, out_dtype, a.device)
    return _launch_new(signature, a, w_gate_up, a_scale, w_scale, None, out, activation, True, config, fp8_fast_accum,
                       kernel)


def int8_matmul_accumulator(a, w, config=None, out=None, kernel="auto"):
    """(M, K) int8 @ (N, K)^T int8 -> the kernel's raw (M, N) int32 accumulator (exactness tests)."""
    if a.dtype != torch.int8:
        raise ValueError(f"a.dtype={a.dtype}; the raw accumulator exists for int8 only")
    ones = torch.ones(1, dtype=torch.float32, device=a.device)
    M, N, _ = check_scaled_mm_args(a, w, ones, ones, None, "none", torch.float32)
    _check_runnable(a)
    out = _output(out, M, N, torch.int32, a.device)
    return _launch(a, w, ones, ones, None, out, "none", gated=False, raw_acc=True, config=config, kernel=kernel)
