"""Persistent INT8 / FP8 scaled GEMM fed by TMA tensor descriptors (large M, compute-bound).

Same math and epilogue as the tiled kernel in gemm.py (``act(acc * a_scale * w_scale + bias)``),
different machinery:
- host-built ``TensorDescriptor``s for a (M, K), w (N, K) and out (M, N): the copy engine moves
  whole tiles into shared memory (no per-thread address arithmetic, no masks: out-of-bounds rows
  and the K tail are zero-filled on load and clipped on store);
- one program per SM walking output tiles in grouped order (GROUP_M row-tiles share weight tiles
  in L2); the K loop and the tile loop are flattened into one software pipeline, so the loads of
  the next tile are in flight while this tile's epilogue runs;
- the epilogue optionally stores the tile in two halves or four quarters (fewer live registers,
  a smaller shared-memory staging buffer for the TMA store);
- CTAS_PER_SM programs per SM (the tile stride is NUM_SMS * CTAS_PER_SM): with 2, two CTAs of a
  small-tile config share an SM, so one issues tensor-core work while the other waits;
  Why INT8 wants that, read from PTX compiled for sm_90 with triton 3.6 (benchmarks/NOTES-gemm.md,
  session 4): the wgmma of a dot with an int32 accumulator is never made asynchronous (the MMAv3
  pipeliner does so for fp32 accumulators only), so a ``wgmma.wait_group 0`` drains the tensor
  cores after every K step; FP8's dot keeps one K step in flight. Measured on an H100: INT8
  128x128 tiles, two CTAs per SM, 4-10 % faster than the best one-CTA config at 6 of 8 points;
- A_IN_REGISTERS (experimental, off): the A tile reaches wgmma from registers. INT8 wgmma is
  capped at N=224 by triton, so a 256-wide tile issues two N=128 instructions per K step, each
  reading A from shared memory; with A in registers they share it. Measured 2-4 % slower (H100,
  7 of 8 points): kept as an option for benchmarks only;
- GATED: the stacked [gate; up] weight, gate rows n and up rows N + n loaded per K step into two
  accumulators, ``act(gate) * up`` in the tiled kernel's arithmetic;
- TAIL_SPLIT (session 5): when the tiles do not fill whole waves of programs, the tiles of the
  partial last wave are split along K (``tail_split_plan``: at most TAIL_SPLIT slices, one per
  program) and their partial sums combined through a workspace by the last-arriving slice
  (``_split_tail``: deterministic slice order, INT8 exact, no program waits on another; the
  per-tile arrival counters reset themselves, so a launch is CUDA-graph capturable once the
  per-device workspace exists).

Eager launches go through ``launch.CachedLaunch`` with light descriptor objects (the weight's
cached by layout); triton's own path, on a key's first call, gets real ``TensorDescriptor``s.

Host descriptors (not ``tl.make_tensor_descriptor``) because device-built ones need a global
scratch allocator (``triton.set_allocator``); both work on triton 3.6 (GPU) and the 3.9
interpreter. Called from ``gemm.scaled_mm``; the eligibility rules (16-byte aligned bases and
row strides) live there.
"""

from __future__ import annotations

import functools
import inspect

import triton.testing

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from quantkit.kernels.launch import CachedLaunch, aligned, cdiv, config_dict, median_replay_ms, num_sms
from quantkit.kernels.gemm_epilogue import dequant_epilogue, dot_accumulate, grouped_tile, split_arrive, split_sum
from quantkit.kernels.quant import cast_for_store

# Output dtype codes (a constexpr int; the store needs the dtype at compile time).
OUT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.int32: 3}


@triton.jit
def _cast_out(out, OUT_CODE: tl.constexpr, INTERPRETED: tl.constexpr):
    if OUT_CODE == 0:
        out = cast_for_store(out, tl.bfloat16, INTERPRETED)
    elif OUT_CODE == 1:
        out = out.to(tl.float16)
    elif OUT_CODE == 2:
        out = out.to(tl.float32)
    return out


@triton.jit
def _store_tile(out_desc, off_m, off_n, out, OUT_CODE: tl.constexpr, INTERPRETED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr):
    out = _cast_out(out, OUT_CODE, INTERPRETED)
    if EPILOGUE_SPLIT == 1:
        out_desc.store([off_m, off_n], out)
    else:
        halves = tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        left, right = tl.split(halves)
        if EPILOGUE_SPLIT == 2:
            out_desc.store([off_m, off_n], left)
            out_desc.store([off_m, off_n + BLOCK_N // 2], right)
        else:
            # Quarters: a quarter-size staging buffer in shared memory (room for one more
            # pipeline stage at 128x256 tiles).
            _store_halves(out_desc, off_m, off_n, left, BLOCK_M, BLOCK_N // 2)
            _store_halves(out_desc, off_m, off_n + BLOCK_N // 2, right, BLOCK_M, BLOCK_N // 2)


@triton.jit
def _store_halves(out_desc, off_m, off_n, out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    halves = tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    left, right = tl.split(halves)
    out_desc.store([off_m, off_n], left)
    out_desc.store([off_m, off_n + BLOCK_N // 2], right)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _scaled_mm_persistent_kernel(
    a_desc, w_desc, out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, partials_ptr, arrivals_ptr,
    M, N, K, M_BUCKET,
    IS_INT8: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    W_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    RAW_ACC: tl.constexpr,
    GATED: tl.constexpr,
    OUT_CODE: tl.constexpr,
    INTERPRETED: tl.constexpr,
    FP8_FAST_ACCUM: tl.constexpr,
    FP8_PROMOTE_K: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    CTAS_PER_SM: tl.constexpr,
    A_IN_REGISTERS: tl.constexpr,
    TAIL_SPLIT: tl.constexpr,
    TAIL_SPLITS: tl.constexpr,
):
    # NUM_SMS * CTAS_PER_SM programs walk the tiles with that stride (the launch grid, or fewer
    # programs when there are fewer tiles).
    NUM_PROGRAMS = NUM_SMS * CTAS_PER_SM
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    # TAIL_SPLITS > 1 (tail_split_plan): the tiles of the partial last wave are left out of the
    # data-parallel loop and each is computed as TAIL_SPLITS K-slices by as many programs.
    if TAIL_SPLITS > 1:
        dp_tiles = num_tiles - num_tiles % NUM_PROGRAMS
    else:
        dp_tiles = num_tiles
    # The epilogue recomputes its tile from its own counter rather than reusing the loop's
    # (pid_m, pid_n): with the loops flattened, the pipeliner may already be on the next tile.
    tile_id_c = start_pid - NUM_PROGRAMS
    for tile_id in tl.range(start_pid, dp_tiles, NUM_PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        off_am = pid_m * BLOCK_M
        off_wn = pid_n * BLOCK_N
        if IS_INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            if GATED:
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if GATED:
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([off_am, ki * BLOCK_K])
            if A_IN_REGISTERS and not INTERPRETED:
                # An identity move the compiler cannot fold: the A tile then reaches wgmma from
                # registers (ldmatrix once per K step) instead of shared memory. For INT8, whose
                # wgmma triton caps at N=224 (so a 256-wide tile issues two N=128 instructions
                # per K step), both halves then share A rather than each re-reading it.
                a = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [a], dtype=a.dtype, is_pure=True, pack=4)
            w = w_desc.load([off_wn, ki * BLOCK_K])
            acc = dot_accumulate(a, w.T, acc, IS_INT8, FP8_FAST_ACCUM, FP8_PROMOTE_K)
            if GATED:
                # The up rows sit N rows below the gate rows in the stacked weight. A gate tile
                # that runs past N reads up rows: those columns are clipped at the store.
                w_up = w_desc.load([N + off_wn, ki * BLOCK_K])
                acc_up = dot_accumulate(a, w_up.T, acc_up, IS_INT8, FP8_FAST_ACCUM, FP8_PROMOTE_K)

        tile_id_c += NUM_PROGRAMS
        pid_m, pid_n = grouped_tile(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if RAW_ACC:
            # Test hook: the int32 accumulator itself, to compare exactly with an integer matmul.
            _store_tile(out_desc, off_m, off_n, acc, OUT_CODE, INTERPRETED, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)
        else:
            offs_m = off_m + tl.arange(0, BLOCK_M)
            offs_n = off_n + tl.arange(0, BLOCK_N)
            out = dequant_epilogue(acc, offs_m, offs_n, M, N, a_scale_ptr, w_scale_ptr, bias_ptr,
                                   A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS, ACTIVATION)
            if GATED:
                # act(gate) * up, the tiled kernel's arithmetic (gemm.py), N = output columns.
                up = dequant_epilogue(acc_up, offs_m, offs_n + N, M, 2 * N, a_scale_ptr, w_scale_ptr, bias_ptr,
                                      A_PER_TOKEN, W_PER_CHANNEL, False, 0)
                out = out * up
            _store_tile(out_desc, off_m, off_n, out, OUT_CODE, INTERPRETED, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)

    if TAIL_SPLITS > 1:
        tl.static_assert(not GATED, "the split tail has no gated form")
        _split_tail(a_desc, w_desc, out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, partials_ptr, arrivals_ptr,
                    M, N, start_pid, dp_tiles, num_tiles, num_pid_m, num_pid_n, k_tiles,
                    IS_INT8, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS, ACTIVATION, RAW_ACC, OUT_CODE, INTERPRETED,
                    FP8_FAST_ACCUM, FP8_PROMOTE_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPILOGUE_SPLIT, TAIL_SPLITS)


@triton.jit
def _split_tail(a_desc, w_desc, out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, partials_ptr, arrivals_ptr,
                M, N, pid, dp_tiles, num_tiles, num_pid_m, num_pid_n, k_tiles,
                IS_INT8: tl.constexpr, A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr,
                HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, RAW_ACC: tl.constexpr, OUT_CODE: tl.constexpr,
                INTERPRETED: tl.constexpr, FP8_FAST_ACCUM: tl.constexpr, FP8_PROMOTE_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                EPILOGUE_SPLIT: tl.constexpr, SPLITS: tl.constexpr):
    """One K-slice of one tail tile per program (unit = pid): slice s of tail tile t covers the
    K steps [s * k_tiles // SPLITS, (s + 1) * k_tiles // SPLITS).

    Every slice writes its int32 / fp32 partial tile to its own workspace slot and arrives
    (``gemm_epilogue.split_arrive``); the last arriver sums the slots in slice order
    (``split_sum``: deterministic, INT8 exact), runs the epilogue in EPILOGUE_SPLIT column chunks
    (registers: one chunk of the sum and one of a slot at a time), and resets the counter to 0 for
    the next launch.
    """
    tail_tiles = num_tiles - dp_tiles
    if pid < tail_tiles * SPLITS:
        t = pid % tail_tiles
        s = pid // tail_tiles
        pid_m, pid_n = grouped_tile(dp_tiles + t, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if IS_INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(s * k_tiles // SPLITS, (s + 1) * k_tiles // SPLITS):
            a = a_desc.load([off_m, ki * BLOCK_K])
            w = w_desc.load([off_n, ki * BLOCK_K])
            acc = dot_accumulate(a, w.T, acc, IS_INT8, FP8_FAST_ACCUM, FP8_PROMOTE_K)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        tile_slots = partials_ptr + (t * SPLITS).to(tl.int64) * (BLOCK_M * BLOCK_N)
        tl.store(tile_slots + s * (BLOCK_M * BLOCK_N) + rows[:, None] * BLOCK_N + cols[None, :], acc)
        if split_arrive(arrivals_ptr + t, SPLITS):
            CHUNK_N: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
            chunk_cols = tl.arange(0, CHUNK_N)
            for c in tl.static_range(EPILOGUE_SPLIT):
                offsets = rows[:, None] * BLOCK_N + (c * CHUNK_N + chunk_cols)[None, :]
                total = split_sum(tile_slots, offsets, None, BLOCK_M * BLOCK_N, SPLITS)
                if RAW_ACC:
                    out = total
                else:
                    out = dequant_epilogue(total, off_m + rows, off_n + c * CHUNK_N + chunk_cols, M, N,
                                           a_scale_ptr, w_scale_ptr, bias_ptr, A_PER_TOKEN, W_PER_CHANNEL,
                                           HAS_BIAS, ACTIVATION)
                out_desc.store([off_m, off_n + c * CHUNK_N], _cast_out(out, OUT_CODE, INTERPRETED))
            tl.store(arrivals_ptr + t, 0)


# ----------------------------------------------------------------------------------------------
# Configs: M >= PERSISTENT_MIN_M only (compute-bound); the tile shapes of cuBLAS/CUTLASS FP8
# kernels (128x256 and 256x128 with a 128-deep K step) plus smaller fallbacks.
# ----------------------------------------------------------------------------------------------


def _cfg(bm, bn, bk, warps, stages, split=2, group_m=8, ws=False, ctas=1, a_regs=False, tail_split=1):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "EPILOGUE_SPLIT": split,
         "WARP_SPECIALIZE": ws, "CTAS_PER_SM": ctas, "A_IN_REGISTERS": a_regs, "TAIL_SPLIT": tail_split},
        num_warps=warps, num_stages=stages, pre_hook=_set_block_shapes,
    )


def _set_block_shapes(nargs):
    # The descriptors are built before the autotuner picks a config; each config sets its tiles.
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["w_desc"].block_shape = [bn, bk]
    nargs["out_desc"].block_shape = [bm, bn // nargs["EPILOGUE_SPLIT"]]


# Session 4 (H100), INT8 only: two 4-warp CTAs per SM hide each other's synchronous wgmma drains
# (module docstring); the fastest INT8 config at 6 of the 8 Llama-3-8B points at M = 1024 / 4096,
# 4-10 % faster than the best one-CTA config there (1 % slower at the other two). FP8
# (asynchronous wgmma) was 4-17 % slower with it: pruned for FP8.
INT8_TWO_PER_SM = _cfg(128, 128, 128, 4, 3, split=4, ctas=2)

PERSISTENT_CONFIGS = [
    _cfg(128, 256, 128, 8, 3),
    _cfg(128, 256, 128, 8, 4),
    _cfg(256, 128, 128, 8, 3),
    _cfg(128, 128, 128, 8, 4),
    _cfg(128, 128, 128, 4, 4, split=1),
    _cfg(128, 256, 64, 8, 4),
    _cfg(128, 128, 256, 8, 3),
    # Session 4 (H100): the epilogue in quarters; with GROUP_M=16 the fastest FP8 config at 6 of
    # the 8 Llama-3-8B points at M = 1024 / 4096 (0.6-4 % faster than the session-3 autotuned pick).
    _cfg(128, 256, 128, 8, 4, split=4, group_m=16),
    _cfg(128, 256, 128, 8, 4, split=4),
    # Session 3 (H100, M=1024): 128x128x128 / 4 warps / 5 stages took FP8 6144x4096 from 44.4 to
    # 40.0 us and INT8 from 52.5 to 50.6 us; 128x256 with GROUP_M=4 was the best FP8 4096x4096.
    _cfg(128, 128, 128, 4, 5, split=1),
    _cfg(128, 256, 128, 8, 4, group_m=4),
    INT8_TWO_PER_SM,
]

def _prune_by_dtype(configs, named_args, **kwargs):
    # Two CTAs per SM are for INT8 only (see INT8_TWO_PER_SM).
    is_int8 = named_args.get("IS_INT8", kwargs.get("IS_INT8"))
    return [c for c in configs if is_int8 or c.kwargs.get("CTAS_PER_SM", 1) == 1]

# Gated (two accumulators, gate and up, and two weight tiles per K step): 128x128 output tiles
# hold the registers of a 128x256 plain tile; shared memory per stage is A + 2 W tiles.
GATED_CONFIGS = [
    _cfg(128, 128, 128, 8, 3),
    _cfg(128, 128, 128, 8, 4),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 8, 5),
    _cfg(128, 64, 128, 4, 4),
    _cfg(128, 128, 128, 8, 4, group_m=16),
]

# Interpreter: few, big tiles (cost is per program) and 3 "SMs", so each program walks several
# tiles and the persistent loop, the grouped order and the split store all run in the tests.
INTERPRETER_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 2, "EPILOGUE_SPLIT": 2,
                      "WARP_SPECIALIZE": False, "CTAS_PER_SM": 1, "A_IN_REGISTERS": False, "TAIL_SPLIT": 1}
INTERPRETER_NUM_SMS = 3


def _fp8_promote_k(args):
    return min(args["BLOCK_K"], 128)


def tail_split_plan(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int, programs: int,
                    max_split: int) -> int:
    """K-slices per tile of the partial last wave (1: no split).

    ``programs`` (SMs x CTAs per SM) walk ``tiles`` output tiles; when ``tiles % programs`` tail
    tiles are left for a last wave, that wave would keep only ``tail`` programs busy for a whole
    tile's K loop. Splitting each tail tile into ``splits`` K-slices (at most ``max_split``, one
    slice per program, at least one K step per slice) makes the last wave ``1 / splits`` as long,
    for the price of writing and summing ``splits`` partial tiles. Example (H100, 132 SMs):
    6144 x 4096 at M=1024 in 128x256 tiles is 192 tiles = 1 wave + 60 tiles -> 60 x 2 slices on
    120 programs: 1.5 waves of work instead of 2.
    """
    if max_split <= 1:
        return 1
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    tail = tiles % programs
    if tail == 0:
        return 1
    splits = min(max_split, programs // tail, cdiv(K, block_k))
    return splits if splits >= 2 else 1


def _tail_splits(args):
    return tail_split_plan(args["M"], args["N"], args["K"], args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"],
                           args["NUM_SMS"] * args["CTAS_PER_SM"], args["TAIL_SPLIT"])


# Split-tail workspace per device: fp32 / int32 partial tiles (one slot per tail unit, at most one
# unit per program) and one int32 arrival counter per tail tile, zero between launches (the last
# arriving slice resets its tile's counter). A grown workspace replaces the old one, which stays
# referenced: a CUDA graph captured earlier still points at it. Two split GEMMs running at once
# on different streams of one device would share counters: not supported (as in
# attention_decode's fused combine).
_SPLIT_WORKSPACE: dict = {}
_RETIRED_WORKSPACES: list = []


def split_workspace(device: torch.device, elems: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, arrivals): at least ``elems`` 4-byte partial-sum elements and ``counters`` zeroed counters."""
    key = (device.type, device.index)
    ws = _SPLIT_WORKSPACE.get(key)
    if ws is None or ws[0].numel() < elems or ws[1].numel() < counters:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the split-tail GEMM workspace must be allocated before a CUDA graph capture; run the model "
                "once eagerly on the same shapes (a warm-up call) before capturing it")
        if ws is not None:
            _RETIRED_WORKSPACES.append(ws)
        old_elems, old_counters = (ws[0].numel(), ws[1].numel()) if ws is not None else (0, 0)
        partials = torch.empty(max(elems, old_elems, 1024), dtype=torch.float32, device=device)
        arrivals = torch.zeros(max(counters, old_counters, 1024), dtype=torch.int32, device=device)
        ws = _SPLIT_WORKSPACE[key] = (partials, arrivals)
    return ws


# What launches without a split pass, per (device index, operand dtype): they never touch the
# buffers, so any workspace of the device will do (a grown one retires, and keeps, the old), and
# reusing the first saves the lookup and the int32 view on every eager GEMM launch (~2 us of host).
_NO_SPLIT_ARGS: dict = {}


def _workspace_args(a: torch.Tensor, slots: int, tile_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Workspace for ``slots`` partial tiles (at most one per program) of ``tile_elems`` elements;
    ``slots=0``: a launch without a split, which passes the buffers but never touches them (inside
    a capture before any workspace exists: stand-ins of the right dtypes, not cached)."""
    if slots == 0:
        cached = _NO_SPLIT_ARGS.get((a.get_device(), a.dtype))
        if cached is not None:
            return cached
        if (a.device.type, a.device.index) not in _SPLIT_WORKSPACE and a.is_cuda \
                and torch.cuda.is_current_stream_capturing():
            partials = torch.empty(1, dtype=torch.int32 if a.dtype == torch.int8 else torch.float32, device=a.device)
            return partials, torch.empty(1, dtype=torch.int32, device=a.device)
    partials, arrivals = split_workspace(a.device, slots * tile_elems, slots)
    # INT8 partials are int32 (exact sums); the buffer is shared, viewed per launch.
    args = (partials.view(torch.int32) if a.dtype == torch.int8 else partials), arrivals
    if slots == 0:
        _NO_SPLIT_ARGS[(a.get_device(), a.dtype)] = args
    return args


def call_workspace(a: torch.Tensor, slots: int, tile_elems: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The workspace a cached launch (``PersistentCall``, ``gemm.TiledCall``) may keep: the fixed
    no-split arguments of (device, dtype) once they exist; None (look it up per launch) for a
    split's, or for a stand-in made inside a capture."""
    workspace = _workspace_args(a, slots, tile_elems)
    return workspace if slots == 0 and _NO_SPLIT_ARGS.get((a.get_device(), a.dtype)) is workspace else None


_GRAPH_BENCH_REPS = 10
_GRAPH_BENCH_REPLAYS = 5
_FLUSH_BYTES = 256 << 20


def flush_graphs(fn, reps: int) -> tuple[dict, torch.Tensor]:
    """The autotuner timer's two CUDA graphs: ``"both"`` holds ``reps`` x (L2 flush, fn),
    ``"flush"`` the flushes alone; captured on a side stream after one eager ``fn()`` (which
    compiles, and fails on a config that does not fit, outside the capture). Returns the graphs and
    the flush buffer, which must outlive them."""
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graphs = {}
    with torch.cuda.stream(side):
        fn()
        for name, with_fn in (("flush", False), ("both", True)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                for _ in range(reps):
                    flush.zero_()
                    if with_fn:
                        fn()
            graphs[name] = graph
    torch.cuda.current_stream().wait_stream(side)
    return graphs, flush


def _graph_bench_ms(fn) -> float:
    """GPU milliseconds of one ``fn()``: ``_GRAPH_BENCH_REPS`` x (L2 flush, fn) captured in a CUDA
    graph, minus a graph of the flushes alone, median of a few replays (no host time inside)."""
    graphs, _flush = flush_graphs(fn, _GRAPH_BENCH_REPS)
    times = {name: median_replay_ms(graph, _GRAPH_BENCH_REPLAYS) for name, graph in graphs.items()}
    return max(times["both"] - times["flush"], 1e-6) / _GRAPH_BENCH_REPS


def refuse_tuning_in_capture() -> None:
    """Raise, naming the fix, where the current CUDA stream is capturing a graph: tuning times its
    candidates (any timer synchronizes), which would break the caller's capture. Shared by this
    module's autotuner and gemm_gluon.tuned_call."""
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a quantkit GEMM shape is being autotuned inside a CUDA graph capture; run the model "
            "once eagerly on the same shapes (a warm-up call) before capturing it")


def _autotune_bench(fn, quantiles=None):
    """The autotuner's timer: CUDA-graph replay with a cold L2 per call.

    Eager ``do_bench`` times a launch that passes through triton's Python launcher (~50-100 us
    on the H100 host) against GEMMs of 25-45 us at M=1024: host time leaked into the timings and
    the pick among close configs changed from run to run (FP8 6144x4096, M=1024: 39.5 us in one
    H100 run, 44.4 us in the next; benchmarks/NOTES-gemm.md, session 4). Falls back to do_bench
    where CUDA refuses the timing graph. Tuning cannot run inside the caller's own capture (any
    timer synchronizes): that is an error naming the fix, not a broken capture.
    """
    refuse_tuning_in_capture()
    try:
        ms = _graph_bench_ms(fn)
        return [ms] * len(quantiles) if quantiles else ms
    except RuntimeError:  # the timing graph was refused: time eagerly
        torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


# Every quantkit autotuner (this kernel's, the tiled kernel's in gemm.py, the GEMV's) times its
# configs with _autotune_bench. The tiled kernel and the GEMV used eager do_bench until session 11:
# at M = 128, 4096x4096 (a ~15 us GEMM) its launches were host-bound and the pick was a 128x128
# tile on 32 of 132 SMs, 19.4 us against 14.5 us for the session-9 pick (NOTES-gemm, session 10).
AUTOTUNE_EXTRA = {"do_bench": _autotune_bench} if "do_bench" in inspect.signature(triton.autotune).parameters else {}


@functools.lru_cache(maxsize=None)
def _autotuned(gated: bool = False):
    return make_autotuner(GATED_CONFIGS if gated else PERSISTENT_CONFIGS)


def make_autotuner(configs: list, prune=None):
    """The persistent kernel autotuned over ``configs`` (benchmarks build candidate sets with it);
    ``prune``: the early-prune function (default ``_prune_by_dtype``)."""
    return triton.autotune(
        configs=configs,
        key=["N", "K", "M_BUCKET", "IS_INT8", "FP8_FAST_ACCUM", "HAS_BIAS", "ACTIVATION", "OUT_CODE", "GATED"],
        prune_configs_by={"early_config_prune": prune or _prune_by_dtype},
        **AUTOTUNE_EXTRA,
    )(triton.heuristics({"FP8_PROMOTE_K": _fp8_promote_k, "TAIL_SPLITS": _tail_splits})(_scaled_mm_persistent_kernel))


def strides_ok(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """The half of ``descriptors_ok`` a call's signature fixes: 16-byte row strides."""
    return (out.stride(0) * out.element_size()) % 16 == 0 and a.stride(0) % 16 == 0 and w.stride(0) % 16 == 0


def pointers_aligned(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """The per-call half of ``descriptors_ok``: 16-byte aligned base addresses (one bit-or)."""
    return (a.data_ptr() | w.data_ptr() | out.data_ptr()) % 16 == 0


def descriptors_ok(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and row strides (K % 16 == 0 is already required)."""
    return pointers_aligned(a, w, out) and strides_ok(a, w, out)


class _Address:
    """Stands in for a tensor inside a cached descriptor: the launcher reads only ``data_ptr()``
    (and the dtype), and the cache must not keep the weight alive."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


class _Descriptor:
    """The fields triton's launcher reads from a host ``TensorDescriptor`` (3.6: base, shape,
    strides, padding; 3.9 adds round_f32_to_tf32), without its per-object validation: used only
    on the cached launch path, for operands ``descriptors_ok`` already checked."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding", "round_f32_to_tf32")

    def __init__(self, base, shape, strides, block_shape) -> None:
        self.base = base
        self.shape = shape
        self.strides = strides
        self.block_shape = block_shape
        self.padding = "zero"
        self.round_f32_to_tf32 = False


# Weight descriptors by everything a TMA descriptor holds (address, shape, strides, dtype, box):
# a new weight, or another tensor reusing a freed weight's address with other shapes, gets its
# own entry, and an entry that matches describes the same bytes. Bounded: cleared when full.
_WEIGHT_DESCRIPTORS: dict = {}
_MAX_WEIGHT_DESCRIPTORS = 4096


def weight_descriptor(w: torch.Tensor, block_n: int, block_k: int) -> _Descriptor:
    # Addresses are unique across devices (unified virtual addressing): no device in the key.
    key = (w.data_ptr(), w.shape[0], w.shape[1], w.stride(0), w.dtype, block_n, block_k)
    desc = _WEIGHT_DESCRIPTORS.get(key)
    if desc is None:
        if len(_WEIGHT_DESCRIPTORS) >= _MAX_WEIGHT_DESCRIPTORS:
            _WEIGHT_DESCRIPTORS.clear()
        desc = _Descriptor(_Address(key[0], w.dtype), [w.shape[0], w.shape[1]], [w.stride(0), 1], [block_n, block_k])
        _WEIGHT_DESCRIPTORS[key] = desc
    return desc


_PERSISTENT = CachedLaunch(_scaled_mm_persistent_kernel)
# Autotuned config per tuning key (see gemm._TUNED_TILED), and per key the launch plan built from it.
_TUNED: dict = {}
_PLANS: dict = {}
FLAG_NAMES = ("IS_INT8", "A_PER_TOKEN", "W_PER_CHANNEL", "HAS_BIAS", "ACTIVATION", "RAW_ACC")


def _plan(config: dict, kernel_flags: dict) -> tuple:
    cfg = dict(config)
    num_warps = cfg.pop("num_warps", 4)
    num_stages = cfg.pop("num_stages", 3)
    cfg.setdefault("GROUP_M", 8)
    cfg.setdefault("EPILOGUE_SPLIT", 1)
    cfg.setdefault("WARP_SPECIALIZE", False)
    cfg.setdefault("CTAS_PER_SM", 1)
    cfg.setdefault("A_IN_REGISTERS", False)
    cfg.setdefault("TAIL_SPLIT", 1)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if cfg["EPILOGUE_SPLIT"] not in (1, 2, 4) or bn % cfg["EPILOGUE_SPLIT"]:
        raise ValueError(f"EPILOGUE_SPLIT={cfg['EPILOGUE_SPLIT']} must be 1, 2 or 4 and divide BLOCK_N={bn}")
    if not (isinstance(cfg["CTAS_PER_SM"], int) and cfg["CTAS_PER_SM"] >= 1):
        raise ValueError(f"CTAS_PER_SM={cfg['CTAS_PER_SM']!r} must be a positive int (programs per SM)")
    if not (isinstance(cfg["TAIL_SPLIT"], int) and 1 <= cfg["TAIL_SPLIT"] <= 8):
        raise ValueError(f"TAIL_SPLIT={cfg['TAIL_SPLIT']!r} must be an int in 1..8 (K-slices per tail tile; 1: off)")
    if cfg["TAIL_SPLIT"] > 1 and kernel_flags.get("GATED"):
        raise ValueError("TAIL_SPLIT > 1 is not supported by the gated GEMM; use TAIL_SPLIT=1")
    constexprs = dict(kernel_flags, FP8_PROMOTE_K=min(bk, 128), **cfg)
    out_box = [bm, bn // cfg["EPILOGUE_SPLIT"]]
    return bm, bn, bk, out_box, constexprs, num_warps, num_stages, (*sorted(cfg.items()), num_warps, num_stages)


def launch_persistent(a, w, out, a_scale, w_scale, bias, flags: tuple, m_bucket: int, fp8_fast_accum: bool,
                      interpreted: bool, config: dict | None = None, gated: bool = False):
    """Launch the persistent kernel; ``config`` (tiles, warps, stages) bypasses autotuning.

    ``flags``: the epilogue flags in FLAG_NAMES order. ``gated``: ``w`` is the stacked (2N, K)
    [gate; up] weight and ``out`` (M, N) gets act(gate) * up.
    """
    call = persistent_call(a, w, out, a_scale, w_scale, bias, flags, m_bucket, fp8_fast_accum, interpreted, config,
                           gated)
    if call is not None:
        call(a, w, out, a_scale, w_scale, bias if bias is not None else a_scale)
    return out


def persistent_call(a, w, out, a_scale, w_scale, bias, flags: tuple, m_bucket: int, fp8_fast_accum: bool,
                    interpreted: bool, config: dict | None = None, gated: bool = False) -> PersistentCall | None:
    """The launch of this call (``launch_persistent``'s arguments) as a ``PersistentCall``; None when
    the autotuner's first call for the tuning key has launched it already."""
    M, K = a.shape
    N = out.shape[1]
    bias_arg = bias if bias is not None else a_scale
    tune_key = (N, K, m_bucket, flags, gated, out.dtype, interpreted, fp8_fast_accum, a.dtype, bias_arg.dtype)
    plan = _PLANS.get(tune_key) if config is None and not interpreted else None
    if plan is None:
        sms = INTERPRETER_NUM_SMS if interpreted else num_sms(a.device.index or 0)
        kernel_flags = dict(zip(FLAG_NAMES, flags), GATED=gated, OUT_CODE=OUT_CODES[out.dtype], INTERPRETED=interpreted,
                            FP8_FAST_ACCUM=fp8_fast_accum, NUM_SMS=sms)
        if config is None:
            if interpreted:
                config = INTERPRETER_CONFIG
            else:
                config = _TUNED.get(tune_key)
                if config is None:
                    tuner = _autotuned(gated)
                    _autotune_and_launch(tuner, a, w, out, a_scale, w_scale, bias_arg, M, N, K, m_bucket, sms,
                                         kernel_flags)
                    _TUNED[tune_key] = config_dict(tuner.best_config)
                    return None
                plan = _PLANS[tune_key] = _plan(config, kernel_flags)
        if plan is None:
            plan = _plan(config, kernel_flags)
    return PersistentCall(plan, tune_key, a, out, m_bucket)


class PersistentCall:
    """A persistent launch minus its addresses: what the plan and the call's shapes, strides and
    dtypes fix (tail split, grid, constexprs, descriptor shapes and boxes, the key without the
    scales' alignment, the no-split workspace). ``gemm.scaled_mm`` keeps one per call signature;
    calling it launches with this call's tensors, whose bases must pass ``pointers_aligned``."""

    __slots__ = ("key", "grid", "constexprs", "num_warps", "num_stages", "ints", "a_layout", "out_layout", "w_box",
                 "w_descriptors", "workspace", "slots", "tile_elems")

    def __init__(self, plan: tuple, tune_key: tuple, a: torch.Tensor, out: torch.Tensor, m_bucket: int) -> None:
        bm, bn, bk, out_box, constexprs, self.num_warps, self.num_stages, config_key = plan
        M, K = a.shape
        N = out.shape[1]
        programs = constexprs["NUM_SMS"] * constexprs["CTAS_PER_SM"]
        splits = tail_split_plan(M, N, K, bm, bn, bk, programs, constexprs["TAIL_SPLIT"])
        self.constexprs = {**constexprs, "TAIL_SPLITS": splits}
        # Descriptors are specialized on dtype and box only; N and K by value; M / M_BUCKET are not
        # specialized (only their int64-ness matters). The scales' alignment is added per call.
        self.key = (tune_key, config_key, splits, M >= 2**31)
        self.grid = (_grid_size(M, N, bm, bn, programs, splits),)
        self.ints = (M, N, K, m_bucket)
        # (shape, strides, box) of the activation's and the output's descriptors; the lists are
        # shared by every launch of this call (triton's launcher only reads them).
        self.a_layout = ([M, K], [a.stride(0), 1], [bm, bk])
        self.out_layout = ([M, N], [out.stride(0), 1], out_box)
        self.w_box = (bn, bk)
        # weight_descriptor's entries by address alone: the signature fixes the rest of its key
        # (shape, row stride, dtype) and the plan the box (a 1-int lookup, ~0.8 us less per call).
        self.w_descriptors: dict = {}
        # Without a split the workspace is unused (its code is compiled out) but still passed: the
        # same pointer types as on the autotuner's path, so both find one compiled binary. That one
        # is fixed per (device, dtype) once it exists; a split's is looked up per launch.
        self.slots, self.tile_elems = (programs if splits > 1 else 0), bm * bn
        self.workspace = call_workspace(a, self.slots, self.tile_elems)

    def __call__(self, a, w, out, a_scale, w_scale, bias_arg) -> None:
        tail = (a_scale, w_scale, bias_arg, *(self.workspace or _workspace_args(a, self.slots, self.tile_elems)),
                *self.ints)
        a_layout, out_layout = self.a_layout, self.out_layout
        w_desc = self.w_descriptors.get(w.data_ptr())
        if w_desc is None:
            if len(self.w_descriptors) >= _MAX_WEIGHT_DESCRIPTORS:
                self.w_descriptors.clear()
            w_desc = self.w_descriptors[w.data_ptr()] = weight_descriptor(w, *self.w_box)
        args = (_Descriptor(a, *a_layout), w_desc, _Descriptor(out, *out_layout), *tail)

        def triton_args():
            return (TensorDescriptor.from_tensor(a, list(a_layout[2])),
                    TensorDescriptor.from_tensor(w, list(self.w_box)),
                    TensorDescriptor.from_tensor(out, list(out_layout[2])), *tail)

        _PERSISTENT((self.key, aligned(a_scale, w_scale, bias_arg)), self.grid, args, self.constexprs, self.num_warps,
                    self.num_stages, triton_args=triton_args)


def _grid_size(M: int, N: int, block_m: int, block_n: int, programs: int, splits: int) -> int:
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    if splits > 1:
        # The tail's K-slices need tail * splits <= programs programs.
        return min(programs, max(tiles, (tiles % programs) * splits))
    return min(programs, tiles)


def _autotune_and_launch(tuner, a, w, out, a_scale, w_scale, bias_arg, M, N, K, m_bucket, sms, kernel_flags):
    # The descriptors are built before the autotuner picks a config; each config's pre_hook sets its tiles.
    first = tuner.configs[0].kwargs
    a_desc = TensorDescriptor.from_tensor(a, [first["BLOCK_M"], first["BLOCK_K"]])
    w_desc = TensorDescriptor.from_tensor(w, [first["BLOCK_N"], first["BLOCK_K"]])
    out_desc = TensorDescriptor.from_tensor(out, [first["BLOCK_M"], first["BLOCK_N"] // first["EPILOGUE_SPLIT"]])

    def grid(meta):
        programs = sms * meta["CTAS_PER_SM"]
        splits = tail_split_plan(M, N, K, meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"], programs,
                                 meta["TAIL_SPLIT"])
        return (_grid_size(M, N, meta["BLOCK_M"], meta["BLOCK_N"], programs, splits),)

    # Room for the largest split config of the set (one slot per program).
    elems, slots = 1, 1
    for c in tuner.configs:
        kw = c.kwargs
        if kw.get("TAIL_SPLIT", 1) > 1:
            elems = max(elems, sms * kw["CTAS_PER_SM"] * kw["BLOCK_M"] * kw["BLOCK_N"])
            slots = max(slots, sms * kw["CTAS_PER_SM"])
    partials, arrivals = split_workspace(a.device, elems, slots)
    if a.dtype == torch.int8:
        partials = partials.view(torch.int32)
    tuner[grid](a_desc, w_desc, out_desc, a_scale, w_scale, bias_arg, partials, arrivals, M, N, K, m_bucket,
                **kernel_flags)
