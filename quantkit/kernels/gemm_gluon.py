"""Warp-specialized persistent INT8 / FP8 scaled GEMM for Hopper, written in Gluon.

``out = act(acc * a_scale[m] * w_scale[n] + bias[n])`` with ``acc = a @ w.T`` (a: (M, K), w: (N, K),
both int8 or both float8_e4m3fn; fp32 accumulation for FP8, exact int32 for INT8), the same math as
``reference.scaled_mm`` and the Triton kernels in gemm.py / gemm_tma.py.

Why Gluon: the Triton kernels of gemm_tma.py are limited by what triton 3.6's compiler does on
Hopper (benchmarks/NOTES-gemm.md, sessions 4-7): no warp specialization (the epilogue of a tile is
not overlapped with the next tile's MMAs), and an int32-accumulator ``tl.dot`` compiled to a
synchronous wgmma (``wgmma.wait_group 0`` after every K step). Gluon exposes the pieces directly:

- one 1-warp **loader partition** walks this program's tiles and streams A and W K-slices into a
  STAGES-deep shared-memory ring with TMA; each slot has a ``ready`` mbarrier (completed by the
  TMA byte count) and an ``empty`` mbarrier (arrived by the consumer once its wgmma has read it);
- **consumer partitions** (warpgroups) issue ``warpgroup_mma`` asynchronously and wait with
  ``warpgroup_mma_wait(1)``: one MMA stays in flight while the next slot is waited for, for INT8
  exactly as for FP8; the slot of the MMA that just retired is handed back to the loader;
- the epilogue (row scale, column scale, bias, activation in fp32, cast) runs in the consumer
  and stores through shared memory with TMA, in column chunks (EPILOGUE_SPLIT) to keep the
  staging buffer small. The loader keeps fetching the next tile's K-slices meanwhile.
- plain epilogue only (no bias, no activation, not gated; the others spilled): ``store_warp`` moves
  the TMA stores to a one-warp store partition. The consumers stage the whole tile (every chunk its
  own buffer), fence once and hand it over through stage_bars[0]; the store partition gives the
  staging back through stage_bars[1] once its stores have read it (``staging_turns``: the two
  warpgroups of a split tile take turns on one warpgroup-sized staging, one free barrier each,
  stage_bars[1 + c]). ``lean_start``: a tile's first
  MMA ignores its accumulator (use_acc off; it is handed the previous tile's registers, no
  zeroing), and the next tile's coordinates are computed under the last MMA.
- CONSUMERS=1 ("cooperative"): one partition of CONSUMER_WARPS (8: two warpgroups, each owns 64
  rows of a 128-row tile). CONSUMERS=2 ("ping-pong"): two 4-warp partitions take alternate tiles
  of the program and take turns on the mainloop through an order barrier (CUTLASS's ping-pong):
  a consumer waits for its turn before its tile's first ring wait and hands the turn over once
  its tile's last MMA is issued, so its epilogue runs under the other consumer's MMAs.
- ``tail_order`` (split tiles: two partitions on 64 rows each of every tile): consumer 1 issues its
  last ``tail_order`` K steps of a tile only after consumer 0 has issued all of its own (order_bars[0],
  one phase per tile, only on tiles of at least STAGES steps so that consumer 0 cannot arrive twice
  ahead), so consumer 0's epilogue runs under consumer 1's last MMAs. ``prologue_loads``: the first
  tile's first K steps are copied by the kernel's prologue, right after the ready barriers are set up,
  not by the loader once the partitions have started; the loader skips them.

- GATED (``GluonConfig.gated``, ``gluon_gated_scaled_mm``, the Gluon form of ``gemm.gated_scaled_mm``):
  w is the stacked (2N, K) [gate; up] weight and the output (M, N) ``act(gate) * up``. Per K step
  the loader brings the A tile, the gate W tile (rows n) and the up W tile (rows N + n) into one
  ring slot under its one ready barrier (the expected bytes of all three); the consumer issues two
  async wgmmas into two accumulators and waits down to 2 outstanding (this step's pair stays in
  flight, the previous step's pair has retired: its slot goes back). Epilogue in fp32 in
  gemm._store_tile's order, ``act((acc * a_scale) * w_scale[n]) * ((acc_up * a_scale) * w_scale[N + n])``,
  one cast. Same ring, barriers and slot order as the plain form; GATED is a constexpr, the plain
  kernel compiles as before. Tiles of GATED_CONFIGS hold two accumulators in the registers of one.

Barrier protocol (mbarrier waits name a phase only by its parity, so every wait must be for the
current phase of its barrier or the one just completed, never one further ahead): the ring is
consumed in this program's K-slice order, ``step`` = tile index in the program x k_steps + ki,
by one consumer at a time (the order barrier), so when step s is waited for, every earlier step
has been waited for and the loader cannot be more than one lap of the ring ahead or behind.
The cooperative consumer walks the steps in that order by itself; the ping-pong consumers need
the order barrier for it (without it, consumer 1 waited for step k_steps while the loader was
still on the first lap: a stale phase of the same parity, garbage operands, slots released out
of order). The formulas are plain Python functions (``ring_slot_phase``, ``previous_phase``,
``turn_phase``) that the kernel compiles and tests/kernels/test_gemm_gluon.py runs in a model of
the protocol (random tile and K-step counts and interleavings).

W is consumed as stored, (N, K) with K contiguous: the MMA's B operand is the permuted
shared-memory view of the W tile (8-bit wgmma takes K-major B only, which is this layout).
Tiles are walked in grouped order (GROUP_M row-tiles share the weight tiles in L2), one program
per SM. TMA zero-fills out-of-range rows and the K tail on load and clips the store, so M, N and
K (a multiple of 16, for the 16-byte TMA row stride) are otherwise arbitrary; an output whose row
is not a multiple of 16 bytes is written into a padded buffer and returned as a view.

Gluon is compiled for sm_90 only and has no CPU interpreter: ``available()`` says whether this
process can run it (a Hopper GPU and triton 3.6 or 3.9, the Gluon APIs the kernels are written
against: ``_tma_load`` / ``_tma_store`` take either release's names). Importing this module never
fails; the kernels are defined only where Gluon imports. Offline check (no GPU):
tests/kernels/test_gemm_gluon.py compiles every config for sm_90 under the installed triton (3.6 or
3.9, the CPU test pin) and reads the PTX (wgmma.wait_group 1 in the K loop, setmaxnreg, no spills).

Tried and measured, not kept (benchmarks/NOTES-gemm.md, session 12; code in commit 5e5ed47): 2-CTA
clusters sharing the W tile through TMA multicast (triton 3.9's Gluon), cuBLAS's arrangement. They
passed the GPU checks and sped the L2-bound ping-pong kernel up (pp_128x128: 2-18 % at M = 16384),
but no cluster config was the fastest FP8 config at any of the 12 large-M points (on an H200 in
session 13, pp_128x128_c2 was 1.5 % slower than pp_128x128). Session 13 (commit 366d965): the
scales and bias loaded when a tile's mainloop starts and the next tile's coordinates computed under
its first MMAs, about 40 % fewer per-tile instructions in the cooperative kernel, moved it by
+0.4-0.9 % (H200), within the noise.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import weakref

import torch
import triton

from quantkit.kernels.call_cache import SignatureCache
from quantkit.kernels.gemm_tma import _Descriptor, _graph_bench_ms, refuse_tuning_in_capture
from quantkit.kernels.launch import (SHARED_MEMORY_LIMIT, aligned, cdiv, int_spec, launch_hooks_active, num_sms,
                                     rotated_medians)
from quantkit.kernels.reference import ACTIVATIONS

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # The TMA copies under their names of each supported release (3.9 renamed them and made the
    # old names raise): the kernels call these two.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _GLUON_ERROR = None
except (ImportError, AttributeError) as error:  # no Gluon, or one without Hopper's pieces
    _GLUON_ERROR = error


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """One kernel variant. Shared memory: STAGES x (A + W tile) + CONSUMERS x EPILOGUE_BUFFERS output chunks
    (gated: STAGES x (A + gate W + up W tile); block_n counts the N outputs, two W tiles per step)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 128
    stages: int = 4
    consumers: int = 1  # 1: one (cooperative) consumer partition; 2: ping-pong on alternate tiles
    consumer_warps: int = 8  # warps per consumer partition (4 = one warpgroup)
    epilogue_split: int = 4  # the output tile is stored in this many column chunks
    epilogue_buffers: int = 2  # staging buffers per consumer: 2 lets a chunk's TMA store run under the next
    group_m: int = 8
    loader_regs: int = 40
    consumer_regs: int = 232  # a worker consumer's register budget (ping-pong only)
    gated: bool = False  # act(gate) * up over a stacked (2N, K) [gate; up] weight: two accumulators
    early_scales: bool = True  # the tile's column scales loaded under the last MMA, not per output chunk
    # consumers=2 only: both consumers work on every tile, consumer c on rows [c, c + 1) x block_m / 2
    # ("cooperative" with independent warpgroups: each waits and releases ring slots on its own)
    # instead of taking alternate tiles (ping-pong).
    split_m: bool = False
    # A one-warp store partition issues the output's TMA stores: the consumers stage the whole tile
    # (every epilogue chunk its own buffer), fence once, arrive, and go on to the next tile's MMAs,
    # instead of waiting on barriers, fences and stores chunk by chunk (2k SM cycles per tile of the
    # cooperative kernel, session 14's traces). Every consumer on every tile (split_m or one consumer).
    store_warp: bool = False
    # store_warp staging one warpgroup's part of the tile at a time (split_m: 32 KB for 128x256, so
    # four ring stages fit): the warpgroups take turns on it, the second after the store partition
    # has read out the first's, which staggers them (one's epilogue under the other's MMAs).
    staging_turns: bool = False
    # The next tile's start kept short: its first MMA ignores the accumulator (use_acc off) instead
    # of 128 registers being zeroed, and its coordinates are computed under this tile's last MMA.
    lean_start: bool = False
    # split_m only: consumer 1 issues its last ``tail_order`` K steps of a tile only after consumer 0
    # has issued all of its own, so consumer 0's MMAs finish that many half-steps early and its
    # epilogue runs under consumer 1's last MMAs (on tiles of at least ``stages`` K steps).
    tail_order: int = 0
    # The first tile's first ``prologue_loads`` (<= stages) K steps of copies issued by the kernel's
    # prologue, right after the ready barriers' set-up, instead of by the loader once the partitions
    # have started (about 1 us after a program's entry in session 19's H100 traces); the loader
    # goes on from there.
    prologue_loads: int = 0
    # As many programs as the rounds of tiles need, so every program takes the same number of tiles
    # (2048 tiles on 132 SMs: 16 rounds, 128 programs of 16 instead of 68 of 16 and 64 of 15): no
    # partial last round, with the power the idle SMs leave to the others.
    balanced_grid: bool = False
    # split_m only, not with balanced_grid: the tiles of a partial last round (where at most half
    # the programs have one) are taken as half tiles, 64 rows each, one per program, by that
    # program's warpgroup for those rows (the other warpgroup idles): the round takes the time of
    # one warpgroup's MMAs on half a tile instead of a whole tile's (3072 tiles on 132 SMs: 23
    # rounds, then 72 half tiles instead of 36 whole ones).
    tail_halves: bool = False

    def __post_init__(self):
        if self.consumers not in (1, 2):
            raise ValueError(f"consumers={self.consumers}: 1 (cooperative) or 2 (ping-pong)")
        if self.consumer_warps not in (4, 8):
            raise ValueError(f"consumer_warps={self.consumer_warps}: 4 or 8 (whole warpgroups)")
        if self.split_m and self.consumers != 2:
            raise ValueError(f"split_m needs consumers=2 (two warpgroups on halves of each tile), got {self.consumers}")
        if self.block_m % (16 * self.consumer_warps * (2 if self.split_m else 1)):
            raise ValueError(f"block_m={self.block_m} must be a multiple of 16 rows per warp "
                             f"({16 * self.consumer_warps} for {self.consumer_warps} warps)")
        if self.block_n % (8 * self.epilogue_split) or self.epilogue_split not in (1, 2, 4):
            raise ValueError(f"epilogue_split={self.epilogue_split} must be 1, 2 or 4 and divide "
                             f"block_n={self.block_n} into multiples of 8")
        if self.tail_order and not (self.split_m and 0 < self.tail_order < self.stages):
            raise ValueError(f"tail_order={self.tail_order} needs split_m=True and 0 < tail_order < stages={self.stages}")
        if not 0 <= self.prologue_loads <= self.stages:
            raise ValueError(f"prologue_loads={self.prologue_loads}: 0 to stages={self.stages} K steps")
        if self.tail_halves and not (self.split_m and not self.balanced_grid and not self.gated):
            raise ValueError("tail_halves needs split_m=True (a warpgroup per half tile), balanced_grid=False "
                             "and gated=False")
        if self.staging_turns and not (self.store_warp and self.split_m):
            raise ValueError("staging_turns needs store_warp=True and split_m=True (two warpgroups per tile)")
        if self.store_warp and self.consumers == 2 and not self.split_m:
            raise ValueError("store_warp needs every consumer on every tile: split_m=True or consumers=1")
        if self.epilogue_buffers not in (1, 2) or self.epilogue_split % self.epilogue_buffers:
            raise ValueError(f"epilogue_buffers={self.epilogue_buffers}: 1, or 2 with an even epilogue_split")
        if self.block_k % 32:
            raise ValueError(f"block_k={self.block_k} must be a multiple of 32 (one 8-bit wgmma K step)")
        if self.shared_bytes() > SHARED_LIMIT:
            raise ValueError(f"{self.name}: {self.shared_bytes()} bytes of shared memory, over the "
                             f"{SHARED_LIMIT} of an H100; use fewer stages or a larger epilogue_split")

    @property
    def name(self) -> str:
        kind = ("gated_" if self.gated else "") + (
            "coop2x" if self.split_m else "pp" if self.consumers == 2 else f"coop{self.consumer_warps}w")
        return (f"{kind}_{self.block_m}x{self.block_n}x{self.block_k}_s{self.stages}"
                f"_e{self.epilogue_split}_g{self.group_m}" + ("" if self.early_scales else "_late")
                + ("_sw" if self.store_warp else "") + ("t" if self.staging_turns else "")
                + ("_lean" if self.lean_start else "") + (f"_t{self.tail_order}" if self.tail_order else "")
                + (f"_pl{self.prologue_loads}" if self.prologue_loads else "") + ("_bal" if self.balanced_grid else "")
                + ("_th" if self.tail_halves else ""))

    @property
    def store_mode(self) -> int:
        """The kernel's STORE_WARP: 0 (the consumers store), 1 (store partition, the whole tile
        staged) or 2 (store partition, one warpgroup's part at a time)."""
        return 2 if self.staging_turns else int(self.store_warp)

    @property
    def staging_buffers(self) -> int:
        """Output chunk buffers in shared memory, as the kernel allocates them (its STAGING)."""
        if self.staging_turns:
            return self.epilogue_split
        return self.consumers * (self.epilogue_split if self.store_warp else self.epilogue_buffers)

    @property
    def stored_rows(self) -> int:
        """Rows of one consumer's output chunk (its TMA store box)."""
        return self.block_m // 2 if self.split_m else self.block_m

    def shared_bytes(self, out_bytes: int = 2) -> int:
        ring = self.stages * (self.block_m + (2 if self.gated else 1) * self.block_n) * self.block_k  # 8-bit operands
        staging = self.staging_buffers * self.stored_rows * (self.block_n // self.epilogue_split) * out_bytes
        return ring + staging + (2 * self.stages + self.consumers + 3) * 8 + 1024  # barriers, alignment slack


SHARED_LIMIT = SHARED_MEMORY_LIMIT  # 227 KB: an H100's shared memory per block (opt-in maximum)

CONFIGS = {
    # 128x256 tiles, two warpgroups on 64 rows each: the shape of the Triton kernel's best FP8
    # config (q4), now with a producer warp and asynchronous INT8 MMAs.
    "coop_128x256": GluonConfig(128, 256, 128, stages=4, consumers=1, consumer_warps=8, epilogue_split=4),
    # The same tile with 64-deep K steps: twice the barrier traffic, a deeper ring.
    "coop_128x256_k64": GluonConfig(128, 256, 64, stages=8, consumers=1, consumer_warps=8, epilogue_split=4),
    # Ping-pong: two warpgroups on alternate 128x128 tiles (128 accumulator registers each), one's
    # epilogue under the other's MMAs. Also the finer-grained tiling for partial last waves.
    "pp_128x128": GluonConfig(128, 128, 128, stages=5, consumers=2, consumer_warps=4, epilogue_split=2),
    # The same with one staging buffer per consumer, the freed 32 KB a sixth ring stage: a ping-pong
    # consumer's epilogue runs under the other's MMAs, so waiting for the previous chunk's store
    # costs little there, and the deeper ring hides more L2 latency. On an H200 (session 13) the
    # fastest INT8 config at 11 of the 12 large-M points, 1.10-1.15x pp_128x128 at M = 16384.
    "pp_128x128_s6": GluonConfig(128, 128, 128, stages=6, consumers=2, consumer_warps=4, epilogue_split=2,
                                 epilogue_buffers=1),
    # Ping-pong on 64x256 tiles: wider wgmma (n=256 for FP8), half the rows per tile.
    "pp_64x256": GluonConfig(64, 256, 128, stages=5, consumers=2, consumer_warps=4, epilogue_split=4,
                             epilogue_buffers=1),
    # The cooperative tile with its two warpgroups as separate partitions (CUTLASS's cooperative
    # kernel): no warpgroup barrier per K step, and a warpgroup that finishes its epilogue first
    # starts the next tile's MMAs while the other still stores.
    "coop2_128x256": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4, epilogue_split=4,
                                 split_m=True),
    # The same walking 16 row tiles per group (the weight tiles of a group stay in L2 for twice the
    # rows): the fastest FP8 config at 9 of the 12 large-M points on the H100 (session 10).
    "coop2_128x256_g16": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4, epilogue_split=4,
                                     split_m=True, group_m=16),
    # coop2_128x256_g16 with a store partition and a lean tile start (session 15): the warpgroups
    # stage the whole tile (64 KB, so three ring stages) and go straight on to the next tile, whose
    # first MMA needs no zeroed accumulator and whose coordinates are ready. H100 per-tile traces
    # (FP8, plain): the cycles outside the MMAs fall from ~3.3k to ~2.0k, but the three-stage ring
    # starves the mainloop by ~2.6k (34.1k against 31.5k). Faster than coop2_128x256_g16 at the
    # power-capped points (run 2: 4096x28672 697 us against 743, 16384x6144 604 against 639), 1-5 %
    # slower at M = 1024.
    "coop2_128x256_g16_sw": GluonConfig(128, 256, 128, stages=3, consumers=2, consumer_warps=4, epilogue_split=4,
                                        split_m=True, group_m=16, store_warp=True, lean_start=True),
    # The store partition with the warpgroups taking turns on one part-sized staging (32 KB), so
    # that four ring stages fit. H100 traces (FP8, plain, session 15 run 6): mainloop 32.3-32.6k
    # cycles (sw: 34.1k), step to the next tile 0.13k, but the epilogue, the second warpgroup's wait
    # for its turn included, 2.4k: per tile no shorter than the lean start alone. INT8: 1.09-1.14x
    # coop2_128x256_g16 at 6 of the 8 points with M >= 4096 in the same run (0.98-0.99x at the others).
    "coop2_128x256_g16_swt": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4, epilogue_split=4,
                                         split_m=True, group_m=16, store_warp=True, staging_turns=True,
                                         lean_start=True),
    # The lean start alone, with four stages and the staging of coop2_128x256_g16: about 0.4k fewer
    # cycles per tile (first-data wait and next-tile step 0.7k shorter and the drain 0.3k, the
    # mainloop 0.6k longer with the next coordinates in it). At 232 registers it spilled 48 bytes on
    # triton 3.6 (the scaled tile held for the hand-over); the loader at setmaxnreg's floor (24)
    # frees 8 more.
    "coop2_128x256_g16_lean": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4, epilogue_split=4,
                                          split_m=True, group_m=16, lean_start=True, loader_regs=24,
                                          consumer_regs=240),
    # Session 19, two changes for the cycles outside the MMAs (H100, FP8, plain):
    # - tail_order=3: the two warpgroups no longer finish a tile together, consumer 0's MMAs three
    #   half-steps early, so its epilogue runs under consumer 1's last MMAs instead of beside
    #   consumer 1's (traced at 1024x4096x4096: consumer 1 retires ~1.07 us after consumer 0, whose
    #   stores are issued ~0.06 us after that). Three runs, 34 points with M >= 1024: faster than
    #   coop2_128x256_g16_lean at 28 (median 1.009x, 0.989-1.075x), 1.001-1.019x at M = 1024; the
    #   store-partition form faster than coop2_128x256_g16_swt at 9 of 11 (median 1.011x).
    # - prologue_loads=1: the traces put a program's first copy ~1.05 us after its entry (the loader
    #   starts only once the partitions have); issued from the prologue it goes out ~0.4-0.5 us
    #   after entry. 1024x4096x4096: 0.985 -> 1.014x `_scaled_mm`
    #   (lean) and 0.977 -> 1.002x (swt) in the same run; at M >= 4096 within the run's spread.
    "coop2_128x256_g16_lean_t3_pl1": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4,
                                                 epilogue_split=4, split_m=True, group_m=16, lean_start=True,
                                                 loader_regs=24, consumer_regs=240, tail_order=3, prologue_loads=1),
    # The same with balanced_grid (H100, FP8, plain, one run of 10 points: 1.044 against 1.010x
    # `_scaled_mm` at 16384x4096x4096, 1.01-1.02x the unbalanced config at the three M = 4096 points
    # with N = 4096 / 6144, within 2.5 % either way at the others).
    "coop2_128x256_g16_lean_t3_pl1_bal": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4,
                                                     epilogue_split=4, split_m=True, group_m=16, lean_start=True,
                                                     loader_regs=24, consumer_regs=240, tail_order=3, prologue_loads=1,
                                                     balanced_grid=True),
    "coop2_128x256_g16_swt_t3_pl1": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4,
                                                epilogue_split=4, split_m=True, group_m=16, store_warp=True,
                                                staging_turns=True, lean_start=True, tail_order=3, prologue_loads=1),
    # The same with balanced_grid (session 20, H100, FP8, plain, 9 rounds: 0.986 against 0.947x
    # `_scaled_mm` at 16384x6144x4096 and 1.069 against 1.050x at 4096x6144x4096, 0.990 against
    # 1.009x at 16384x4096x14336; session 19's run 12: 1.022 against 1.000x at 16384x6144x4096).
    "coop2_128x256_g16_swt_t3_pl1_bal": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4,
                                                    epilogue_split=4, split_m=True, group_m=16, store_warp=True,
                                                    staging_turns=True, lean_start=True, tail_order=3,
                                                    prologue_loads=1, balanced_grid=True),
    # The unbalanced lean form with the partial last round's tiles in halves (tail_halves): the
    # round ends after one warpgroup's MMAs on half a tile (16384x6144: 23 rounds and 72 half tiles,
    # where the balanced grid has 24 rounds on 128 SMs). Session 21 (H100, FP8, plain, 7 rounds,
    # L2 flushed): 663.6 against 675.7 us for lean_t3_pl1_bal at 4096x28672x4096 (faster in each of
    # the 7 rounds; 1.016x `_scaled_mm`), 39.9 against 43.9 us at 1024x6144x4096, 573.7 against
    # 574.3 us at 16384x6144x4096. Run back to back at the power cap (warm L2) it was 0.5-3 % slower
    # than the balanced form at those two large points: the SMs a partial round leaves idle give
    # their power to the others. The store-partition form with tail_halves was no faster.
    "coop2_128x256_g16_lean_t3_pl1_th": GluonConfig(128, 256, 128, stages=4, consumers=2, consumer_warps=4,
                                                    epilogue_split=4, split_m=True, group_m=16, lean_start=True,
                                                    loader_regs=24, consumer_regs=240, tail_order=3, prologue_loads=1,
                                                    tail_halves=True),
    # Session 49, tiles for about one round of 128x128 tiles (M = 257-512 at N = 4096, and
    # 1024x6144): H200, 9 rounds, L2 flushed, plain, against the tuned pick of the candidates before
    # (results/gemm_gluon_s49_*_h200.*). The cooperative split on a 128x128 tile (each warpgroup's
    # m64n128 MMAs on 64 of its rows) with six stages and three first K steps copied from the
    # prologue: FP8 / INT8 15.0 / 14.7 us against 16.1 / 16.0 at 512x4096x4096 (`_scaled_mm` 15.2),
    # 14.5 / 14.6 against 15.8 / 15.7 at 320x4096x4096 (15.0), 41.9 / 40.0 against 42.8 / 41.3 at
    # 512x4096x14336 (41.8). pp_128x128_s6 with the same three prologue copies: 36.9 against 37.8 us
    # FP8 at 1024x6144x4096 (38.7). Of prologue_loads 1 (ping-pong: 0), 2, 3, 4 and 6, 3 was the
    # fastest or within 0.4 us of it at every point, for both configs and both dtypes (six points).
    "coop2_128x128_lean_t3_pl3": GluonConfig(128, 128, 128, stages=6, consumers=2, consumer_warps=4,
                                             epilogue_split=4, split_m=True, group_m=16, lean_start=True,
                                             loader_regs=24, consumer_regs=240, tail_order=3, prologue_loads=3),
    "pp_128x128_s6_pl3": GluonConfig(128, 128, 128, stages=6, consumers=2, consumer_warps=4, epilogue_split=2,
                                     epilogue_buffers=1, prologue_loads=3),
}

# The gated form (``gated=True``): per K step the ring slot holds the A tile, the gate W tile (rows
# n of the stacked weight) and the up W tile (rows N + n), and the consumer keeps two accumulators,
# so the register budget of one accumulator tile is split between two: the tiles below hold 128
# int32 accumulator registers per consumer thread like pp_128x128 / coop_128x256 do.
GATED_CONFIGS = {
    # Ping-pong, 128 rows x 64 outputs per consumer (gate + up: a 128x128 MMA tile per K step).
    "gated_pp_128x64": GluonConfig(128, 64, 128, stages=6, consumers=2, consumer_warps=4, epilogue_split=2,
                                   epilogue_buffers=1, gated=True),
    # Cooperative, two warpgroups on 64 rows each of 128 rows x 128 outputs (a 128x256 MMA tile).
    "gated_coop_128x128": GluonConfig(128, 128, 128, stages=4, consumers=1, consumer_warps=8, epilogue_split=4,
                                      gated=True),
    # The same with 64-deep K steps and a ring twice as deep.
    "gated_coop_128x128_k64": GluonConfig(128, 128, 64, stages=8, consumers=1, consumer_warps=8, epilogue_split=4,
                                          gated=True),
    # gated_coop_128x128 with its warpgroups as separate partitions (split_m, as coop2_128x256).
    "gated_coop2_128x128": GluonConfig(128, 128, 128, stages=4, consumers=2, consumer_warps=4, epilogue_split=4,
                                       gated=True, split_m=True),
    # The same with the first K step copied from the prologue and a balanced grid (session 20, H200,
    # gate_up 2 x 14336 x 4096, 7 rounds, against gated_coop2_128x128: FP8 1.008 / 1.024 / 1.029x at
    # M = 1024 / 4096 / 16384, INT8 1.000 / 1.007 / 0.994x). tail_order=3 on top was 0.987-1.010x.
    "gated_coop2_128x128_pl1_bal": GluonConfig(128, 128, 128, stages=4, consumers=2, consumer_warps=4,
                                               epilogue_split=4, gated=True, split_m=True, prologue_loads=1,
                                               balanced_grid=True),
}


def program_count(tiles: int, sms: int, balanced: bool, tail_halves: bool = False) -> int:
    """Persistent programs for ``tiles`` tiles on ``sms`` SMs: one per SM (at most one per tile), or
    (``balanced``) the fewest that take the same rounds of tiles, each program as many tiles, or
    (``tail_halves``, with at most half as many tiles as SMs) one per half tile."""
    if tail_halves and 2 * tiles <= sms:
        return 2 * tiles
    programs = min(sms, tiles)
    return cdiv(tiles, cdiv(tiles, programs)) if balanced else programs


def _wave_efficiency(tiles: int, programs: int) -> float:
    """tiles / (programs x the busiest program's tile count): how busy the SMs are on average."""
    return tiles / (cdiv(tiles, programs) * programs)


def pick_config(N: int, K: int, M: int, dtype: torch.dtype) -> GluonConfig:
    """A first rule, to be replaced by measured picks (benchmarks/gemm_gluon.py times every config):
    the cooperative 128x256 kernel, unless its tiles fill the programs' last round much worse than
    128x128 tiles would (6144x4096 at M=1024: 192 tiles on 132 SMs keep the SMs 73 % busy, 384
    half-size tiles 97 %); then ping-pong 128x128. The same rule for FP8 and INT8 (both dtypes
    run the same MMA rate on Hopper)."""
    sms = num_sms(torch.cuda.current_device()) if torch.cuda.is_available() else 132
    wide = _wave_efficiency(cdiv(M, 128) * cdiv(N, 256), sms)
    narrow = _wave_efficiency(cdiv(M, 128) * cdiv(N, 128), sms)
    return CONFIGS["pp_128x128"] if narrow > wide + 0.05 else CONFIGS["coop_128x256"]


# Gluon is experimental and its API moves between releases: the kernels are written against triton
# 3.6 (the GPU image's) and 3.9 (the CPU test pin, and what torch 2.13 installs), compiled offline for
# sm_90 under both (tests/kernels/test_gemm_gluon.py) and checked on an H100 under both (NOTES-gemm).
SUPPORTED_TRITON = ("3.6", "3.9")


def available() -> bool:
    """True when this process can run the Gluon kernels: a Hopper (sm_90) GPU and the Gluon of a
    triton in SUPPORTED_TRITON (the versions they were written and compiled against). Never raises."""
    if _GLUON_ERROR is not None or not _cuda_available():
        return False
    return _available_on(torch.cuda.current_device())


@functools.cache
def _cuda_available() -> bool:
    # torch.cuda.is_available() asks NVML or the driver each time (~1-2 us; an MoE layer's eager
    # call asked five times); whether this process sees a GPU does not change.
    return torch.cuda.is_available()


@functools.cache
def _available_on(device_index: int) -> bool:
    import triton

    if not triton.__version__.startswith(SUPPORTED_TRITON):
        return False
    try:
        if torch.cuda.get_device_capability(device_index) != (9, 0):
            return False
        params = inspect.signature(gl.warp_specialize).parameters
    except (RuntimeError, AssertionError, TypeError, ValueError):
        return False
    return "functions_and_args" in params and "worker_num_regs" in params


# ----------------------------------------------------------------------------------------------
# Barrier arithmetic: plain Python on non-negative ints, compiled into the kernel below (gluon.jit
# of the same functions) and run by the protocol model in tests/kernels/test_gemm_gluon.py.
# ----------------------------------------------------------------------------------------------


def ring_slot_phase(step, STAGES):
    """The ring slot of K-slice ``step`` (this program's running count) and the parity of its
    fill: the loader's ``step // STAGES``-th fill of that slot completes phase ``step // STAGES`` of
    its ready barrier, the consumer's release of it the same phase of its empty barrier."""
    return step % STAGES, (step // STAGES) & 1


def previous_phase(phase):
    """The parity of phase ``phase - 1``: before a slot's ``phase``-th fill the loader waits for
    the release of its previous fill, phase ``phase - 1`` of the empty barrier. A fresh mbarrier
    counts phase -1 (parity 1) as completed, so the first lap over the ring does not wait."""
    return (phase & 1) ^ 1


def turn_phase(tile):
    """Ping-pong: the order barrier phase that gives this program's ``tile``-th tile (counting
    both consumers' tiles, 0, 1, 2, ...) its turn on the mainloop. Tile t's consumer waits on
    order barrier t % 2, which the consumer of tile t - 1 arrives on when done with its mainloop:
    the (t - 1) // 2-th arrival there, i.e. wait for ``previous_phase((t + 1) // 2)``; tile 0
    waits for the fresh barrier's pre-completed phase (consumer 0 goes first)."""
    return (((tile + 1) // 2) & 1) ^ 1  # previous_phase((tile + 1) // 2), spelled out for gluon.jit


def plain_only(flag, has_bias, activation, gated):
    """``flag`` where the epilogue is plain (no bias, activation index 0, not gated), else 0; its
    value kept (STORE_WARP 2). The kernel's and the grid's one rule for the plain-only options:
    store_warp and lean_start take effect with the plain epilogue, whose output chunks are views of
    the scaled tile. A bias or activation makes new values per chunk: with the chunks no longer
    fenced apart (store_warp) or the scaled tile kept live for the next tile's first MMA
    (lean_start), those spilled (0.4-2.6 KB with bias + silu, triton 3.6 and 3.9), so they run the
    per-chunk epilogue, each chunk its own buffer. tail_halves spilled 40 bytes with bias + silu."""
    return flag if not has_bias and activation == 0 and not gated else 0


def unit_count(tiles, programs):
    """tail_halves: the work units the programs walk (unit u by program u % programs): the tiles,
    plus one more per tile of a partial last round when at most half the programs have one there;
    those tiles are taken as two half tiles each, one per program."""
    leftover = tiles % programs
    units = tiles
    if 2 * leftover <= programs:
        units = tiles + leftover
    return units


def unit_tile(unit, tiles, units):
    """(tile, half) of work unit ``unit`` of ``units`` (``unit_count``): half 2 is the whole
    tile, 0 or 1 its first or second half of rows (the rows of split_m's consumer 0 or 1)."""
    whole = 2 * tiles - units  # the tiles before the halved ones
    tile = unit
    half = 2
    if unit >= whole:
        tile = whole + (unit - whole) // 2
        half = (unit - whole) % 2
    return tile, half


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

if _GLUON_ERROR is None:
    _ring_slot_phase = gluon.jit(ring_slot_phase)
    _previous_phase = gluon.jit(previous_phase)
    _turn_phase = gluon.jit(turn_phase)
    _plain_only = gluon.constexpr_function(plain_only)
    _unit_count = gluon.jit(unit_count)
    _unit_tile = gluon.jit(unit_tile)

    @gluon.jit
    def _units(tiles, programs, TAIL_HALVES: gl.constexpr):
        # The units this kernel's programs walk: its tiles, or with TAIL_HALVES unit_count's.
        units = tiles
        if TAIL_HALVES:
            units = _unit_count(tiles, programs)
        return units

    @gluon.jit
    def _tile_of(unit, tiles, units, TAIL_HALVES: gl.constexpr):
        # The tile of a unit (unit_tile); without TAIL_HALVES every unit is its tile.
        tile = unit
        if TAIL_HALVES:
            tile, _ = _unit_tile(unit, tiles, units)
        return tile

    @gluon.constexpr_function
    def _split(BLOCK_M, CONSUMERS, SPLIT_M):
        return BLOCK_M // CONSUMERS if SPLIT_M else BLOCK_M

    @gluon.constexpr_function
    def _mma_layout(BLOCK_M, BLOCK_N, num_warps, IS_INT8):
        # Warps stacked along M (16 rows each, whole warpgroups), the widest wgmma N that divides
        # the tile: 256 for FP8; INT8 wgmma stops at 224, so 128 for 128- and 256-wide tiles.
        max_n = 224 if IS_INT8 else 256
        n = max_n
        while n > BLOCK_N or BLOCK_N % n:
            n -= 8 if not IS_INT8 else 16
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 32])

    @gluon.constexpr_function
    def _chunk_layout(BLOCK_M, BLOCK_N, num_warps, IS_INT8, EPILOGUE_SPLIT):
        # A column chunk of the accumulator keeps its registers: in the wgmma layout the upper
        # column bits are per-thread repetitions, so the chunk is the wgmma layout of a
        # narrower instruction (checked at compile time by convert_layout(assert_trivial=True)).
        full = _mma_layout(BLOCK_M, BLOCK_N, num_warps, IS_INT8)
        n = min(full.instr_shape[1], BLOCK_N // EPILOGUE_SPLIT)
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 32])


    @gluon.jit
    def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
        # GROUP_M row-tiles walk the N tiles together: their shared weight tiles stay in L2.
        per_group = GROUP_M * num_pid_n
        first_m = (tile // per_group) * GROUP_M
        rows = gl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % rows
        pid_n = (tile % per_group) // rows
        return pid_m, pid_n

    @gluon.jit
    def _rows_used(M, used_ptr, GROUPED: gl.constexpr):
        # GROUPED (a mixture of experts' slot-ordered rows, moe.py's RoutePlan): the rows the
        # routing fills, read on the device (M is the plan's capacity, the descriptors' rows).
        rows = M
        if GROUPED:
            rows = gl.load(used_ptr)
        return rows

    @gluon.jit
    def _expert_of(pid_m, block_expert_ptr, num_experts, GROUPED: gl.constexpr):
        # GROUPED: the expert of row block pid_m, whose weight rows start at expert * rows_per_expert
        # and scales at expert * stride_se; the run of the pairs of no expert (num_experts) takes
        # the last expert's (its rows come with zero activations and scales). Else 0.
        expert = 0
        if GROUPED:
            expert = gl.minimum(gl.load(block_expert_ptr + pid_m), num_experts - 1)
        return expert

    @gluon.jit
    def _activation(x, ACTIVATION: gl.constexpr):
        # Codes follow reference.ACTIVATIONS; sigmoid as 1 / (1 + exp(-x)) saturates cleanly.
        if ACTIVATION == 1:
            x = gl.where(x < 0.0, 0.0, x)  # relu(NaN) = NaN, as in torch
        elif ACTIVATION == 2:
            x = x / (1.0 + gl.exp(-x))
        elif ACTIVATION == 3:
            x = 0.5 * x * (1.0 + gl.erf(x * 0.7071067811865476))
        elif ACTIVATION == 4:
            # 0.5 x (1 + tanh(y)) = x sigmoid(2y)
            inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = x / (1.0 + gl.exp(-2.0 * inner))
        return x

    @gluon.jit
    def _load_step(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, slot, off_m, off_n, ki, N,
                   GATED: gl.constexpr):
        # One K slice into ring slot ``slot``, under its ready barrier; ``off_n`` the first weight
        # row (a grouped GEMM's: of the block's expert's rows). Gated: N counts the outputs;
        # w_desc is the stacked (2N, K) weight, the up rows N below the gate rows, both W tiles of a
        # step land in the slot's w_bufs / u_bufs.
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        ready = ready_bars.index(slot)
        if GATED:
            mbarrier.expect(ready, a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
        else:
            mbarrier.expect(ready, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        _tma_load(a_desc, [off_m, ki * BLOCK_K], ready, a_bufs.index(slot))
        _tma_load(w_desc, [off_n, ki * BLOCK_K], ready, w_bufs.index(slot))
        if GATED:
            # Up rows past 2N (N not a multiple of BLOCK_N) are zero-filled; gate rows past N
            # read up rows, whose outputs the clipped store drops.
            _tma_load(w_desc, [N + off_n, ki * BLOCK_K], ready, u_bufs.index(slot))

    @gluon.jit
    def _load_partition(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K,
                        block_expert_ptr, used_ptr, rows_per_expert, num_experts,
                        GROUP_M: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr,
                        PROLOGUE_LOADS: gl.constexpr, TAIL_HALVES: gl.constexpr, GROUPED: gl.constexpr):
        # PROLOGUE_LOADS: the kernel's prologue issued the first min(k_steps, PROLOGUE_LOADS) steps.
        # A half tile's unit (TAIL_HALVES) loads the whole tile's slices: its warpgroup reads its rows.
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        num_pid_m = gl.cdiv(_rows_used(M, used_ptr, GROUPED), BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        issued = gl.minimum(k_steps, PROLOGUE_LOADS)
        tiles = num_pid_m * num_pid_n
        units = _units(tiles, gl.num_programs(0), TAIL_HALVES)
        step = 0  # K-slices issued by this program so far: the ring position
        for unit in range(gl.program_id(0), units, gl.num_programs(0)):
            tile = _tile_of(unit, tiles, units, TAIL_HALVES)
            pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            w_row = _expert_of(pid_m, block_expert_ptr, num_experts, GROUPED) * rows_per_expert + pid_n * BLOCK_N
            for ki in range(k_steps):
                if step >= issued:
                    slot, phase = _ring_slot_phase(step, STAGES)
                    # The slot's previous fill released (phase before this fill's); a fresh mbarrier
                    # counts as having completed it, so the first lap over the ring does not wait.
                    mbarrier.wait(empty_bars.index(slot), _previous_phase(phase))
                    _load_step(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, slot, off_m, w_row, ki, N, GATED)
                step += 1

    @gluon.jit
    def _store_chunk(x, u, chunk: gl.constexpr, off_m, off_n, out_desc, c_bufs, FIRST: gl.constexpr,
                     BUFFERS: gl.constexpr, w_scale_ptr, bias_ptr, N, HAS_BIAS: gl.constexpr,
                     ACTIVATION: gl.constexpr, GATED: gl.constexpr, SCALED: gl.constexpr, layout: gl.constexpr,
                     STAGE_ONLY: gl.constexpr):
        # c_bufs[FIRST:FIRST + BUFFERS]: this consumer's output staging buffers. Gated: ``u`` is
        # the up chunk (acc_up * a_scale; unused otherwise), out = act(gate) * up as in
        # gemm._store_tile: act((acc * a_scale) * w_scale[n]) * ((acc_up * a_scale) * w_scale[N + n]).
        # SCALED: x (and u) arrive multiplied by their column scales already (early_scales).
        # STAGE_ONLY (store_warp): every chunk has its own buffer, and the store partition stores them.
        CHUNK_N: gl.constexpr = out_desc.block_type.shape[1]
        x = gl.convert_layout(x, layout, assert_trivial=True)
        cols = off_n + chunk * CHUNK_N + gl.arange(0, CHUNK_N, layout=gl.SliceLayout(0, layout))
        col_ok = cols < N
        if not SCALED:
            w_scale = gl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)
            x = x * gl.expand_dims(w_scale, 0)
        if HAS_BIAS:
            bias = gl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(gl.float32)
            x = x + gl.expand_dims(bias, 0)
        x = _activation(x, ACTIVATION)
        if GATED:
            u = gl.convert_layout(u, layout, assert_trivial=True)
            if not SCALED:
                w_scale_up = gl.load(w_scale_ptr + N + cols, mask=col_ok, other=0.0)
                u = u * gl.expand_dims(w_scale_up, 0)
            x = x * u
        if STAGE_ONLY:
            c_bufs.index(FIRST + chunk).store(x.to(out_desc.dtype))
        else:
            # Chunks take the staging buffers in turn (the split is a multiple of BUFFERS, so every
            # tile starts on buffer 0): the store issued BUFFERS chunks ago must have read this one.
            c_smem = c_bufs.index(FIRST + chunk % BUFFERS)
            tma.store_wait(BUFFERS - 1)
            c_smem.store(x.to(out_desc.dtype))
            fence_async_shared()
            _tma_store(out_desc, [off_m, off_n + chunk * CHUNK_N], c_smem)

    @gluon.jit
    def _store_partition(out_desc, c_bufs, stage_bars, M, N, used_ptr, GROUP_M: gl.constexpr,
                         CONSUMERS: gl.constexpr, STORE_MODE: gl.constexpr, TAIL_HALVES: gl.constexpr,
                         GROUPED: gl.constexpr):
        # store_warp: the TMA stores of every tile the consumers staged. STORE_MODE 1: stage_bars[0]
        # completes a phase when every consumer has staged its part of this program's next tile (in
        # tile order), stage_bars[1] when the stores have read the staging back out, so it can be
        # written again. STORE_MODE 2 (staging_turns): one phase of stage_bars[0] per consumer part
        # (consumer 0's part of a tile, then consumer 1's, in the one part-sized staging); once a
        # part is read out, stage_bars[1 + c] of the consumer c that stages the next part completes.
        # One free barrier per consumer: on a shared one, consumer 0 (a whole tile ahead when K
        # has fewer steps than the ring has stages) could wait two phases ahead, which its parity
        # cannot tell from the phase just completed (the protocol model caught it).
        ROWS: gl.constexpr = out_desc.block_type.shape[0]
        CHUNK_N: gl.constexpr = out_desc.block_type.shape[1]
        CHUNKS: gl.constexpr = c_bufs.type.shape[0] // (1 if STORE_MODE == 2 else CONSUMERS)
        BLOCK_M: gl.constexpr = ROWS * CONSUMERS
        BLOCK_N: gl.constexpr = CHUNK_N * CHUNKS
        num_pid_m = gl.cdiv(_rows_used(M, used_ptr, GROUPED), BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        tiles = num_pid_m * num_pid_n
        units = _units(tiles, gl.num_programs(0), TAIL_HALVES)
        staged = 0  # tiles stored so far
        for unit in range(gl.program_id(0), units, gl.num_programs(0)):
            # A half tile's unit: only its warpgroup's part holds results (the other's is not stored).
            if TAIL_HALVES:
                tile, half = _unit_tile(unit, tiles, units)
            else:
                tile = unit
                half: gl.constexpr = 2
            pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            if STORE_MODE == 2:
                for c in gl.static_range(CONSUMERS):
                    mbarrier.wait(stage_bars.index(0), (staged * CONSUMERS + c) & 1)
                    if (half == 2) | (half == c):
                        for j in gl.static_range(CHUNKS):
                            _tma_store(out_desc, [pid_m * BLOCK_M + c * ROWS, pid_n * BLOCK_N + j * CHUNK_N],
                                       c_bufs.index(j))
                    tma.store_wait(0)
                    mbarrier.arrive(stage_bars.index(1 + (c + 1) % CONSUMERS))
            else:
                mbarrier.wait(stage_bars.index(0), staged & 1)
                for c in gl.static_range(CONSUMERS):
                    if (half == 2) | (half == c):
                        for j in gl.static_range(CHUNKS):
                            _tma_store(out_desc, [pid_m * BLOCK_M + c * ROWS, pid_n * BLOCK_N + j * CHUNK_N],
                                       c_bufs.index(c * CHUNKS + j))
                tma.store_wait(0)  # the stores have read the staging (not: reached global memory)
                mbarrier.arrive(stage_bars.index(1))
            staged += 1
        # Returning ends the program only after its stores complete (the kernel's exit waits for them).

    @gluon.jit
    def _halves(x):
        # Columns [0, n/2) and [n/2, n) of a 2-D tile, each keeping its registers.
        BM: gl.constexpr = x.shape[0]
        BN: gl.constexpr = x.shape[1]
        return x.reshape([BM, 2, BN // 2]).permute((0, 2, 1)).split()

    @gluon.jit
    def _store_halves(x, u, chunk: gl.constexpr, off_m, off_n, out_desc, c_bufs, FIRST: gl.constexpr,
                      BUFFERS: gl.constexpr, w_scale_ptr, bias_ptr, N, HAS_BIAS: gl.constexpr,
                      ACTIVATION: gl.constexpr, GATED: gl.constexpr, SCALED: gl.constexpr, layout: gl.constexpr,
                      STAGE_ONLY: gl.constexpr):
        # Output chunks ``chunk`` and ``chunk + 1``: the two column halves of x (and u), each keeping
        # its registers; the arguments are _store_chunk's.
        left, right = _halves(x)
        u_left, u_right = _halves(u)
        _store_chunk(left, u_left, chunk, off_m, off_n, out_desc, c_bufs, FIRST, BUFFERS, w_scale_ptr, bias_ptr, N,
                     HAS_BIAS, ACTIVATION, GATED, SCALED, layout, STAGE_ONLY)
        _store_chunk(right, u_right, chunk + 1, off_m, off_n, out_desc, c_bufs, FIRST, BUFFERS, w_scale_ptr,
                     bias_ptr, N, HAS_BIAS, ACTIVATION, GATED, SCALED, layout, STAGE_ONLY)

    @gluon.jit
    def _consumer_partition(a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, order_bars, stage_bars, c_bufs, out_desc,
                            a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, block_expert_ptr, used_ptr, stride_se,
                            num_experts, CONSUMER: gl.constexpr,
                            CONSUMERS: gl.constexpr, CONSUMER_WARPS: gl.constexpr, GROUP_M: gl.constexpr,
                            STAGES: gl.constexpr, EPILOGUE_SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
                            ACTIVATION: gl.constexpr, GATED: gl.constexpr, EARLY_SCALES: gl.constexpr,
                            SPLIT_M: gl.constexpr, STORE_WARP: gl.constexpr, LEAN_START: gl.constexpr,
                            TAIL_ORDER: gl.constexpr, TAIL_HALVES: gl.constexpr, GROUPED: gl.constexpr):
        # SPLIT_M: every consumer takes every tile, rows [ROW0, ROW0 + TILE_M) of it; otherwise
        # (ping-pong) consumer c takes this program's tiles c, c + 2, ... whole. TAIL_HALVES (split_m):
        # on a half tile's unit the other consumer keeps the barriers' counts without MMAs or stores.
        BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
        IS_INT8: gl.constexpr = a_bufs.dtype == gl.int8
        acc_dtype: gl.constexpr = gl.int32 if IS_INT8 else gl.float32
        TILE_M: gl.constexpr = _split(BLOCK_M, CONSUMERS, SPLIT_M)
        ROW0: gl.constexpr = CONSUMER * TILE_M if SPLIT_M else 0
        mma_layout: gl.constexpr = _mma_layout(TILE_M, BLOCK_N, CONSUMER_WARPS, IS_INT8)
        chunk_layout: gl.constexpr = _chunk_layout(TILE_M, BLOCK_N, CONSUMER_WARPS, IS_INT8, EPILOGUE_SPLIT)
        BUFFERS: gl.constexpr = c_bufs.type.shape[0] // CONSUMERS
        FIRST: gl.constexpr = 0 if STORE_WARP == 2 else CONSUMER * BUFFERS  # staging_turns: one shared part

        M = _rows_used(M, used_ptr, GROUPED)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        k_steps = gl.cdiv(K, BLOCK_K)
        nprog = gl.num_programs(0)
        TURNS: gl.constexpr = 1 if SPLIT_M else CONSUMERS  # consumers taking turns on this program's tiles
        TURN: gl.constexpr = 0 if SPLIT_M else CONSUMER
        local = TURN  # this program's tile count so far (both consumers'): the ring position
        first = gl.program_id(0) + TURN * nprog
        tiles = num_pid_m * num_pid_n
        units = _units(tiles, nprog, TAIL_HALVES)
        last = units - 1
        if LEAN_START:
            # The first tile's coordinates (each later tile's are computed under the last MMA of the
            # tile before it), and an accumulator never read: every tile's first MMA ignores it.
            first_tile = _tile_of(first, tiles, units, TAIL_HALVES)
            pid_m, pid_n = _grouped_tile(first_tile, num_pid_m, num_pid_n, GROUP_M)
            acc = gl.zeros((TILE_M, BLOCK_N), acc_dtype, layout=mma_layout)
        for unit in range(first, last + 1, TURNS * nprog):
            if TAIL_HALVES:
                tile, half = _unit_tile(unit, tiles, units)
                busy = (half == 2) | (half == CONSUMER)  # False: the other consumer's half tile
            else:
                tile = unit
                busy: gl.constexpr = True  # (a constexpr: the tests on it fold away at compile time)
            if not LEAN_START:
                pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            off_m = pid_m * BLOCK_M + ROW0
            off_n = pid_n * BLOCK_N
            # The column scales of this tile's expert (grouped), taken before LEAN_START moves pid_m on.
            tile_w_scale_ptr = w_scale_ptr + _expert_of(pid_m, block_expert_ptr, num_experts, GROUPED) * stride_se
            step = local * k_steps
            if not LEAN_START:
                acc = gl.zeros((TILE_M, BLOCK_N), acc_dtype, layout=mma_layout)
                if GATED:
                    acc_up = gl.zeros((TILE_M, BLOCK_N), acc_dtype, layout=mma_layout)
            if TURNS == 2:
                # Our turn: the other consumer has issued all of the previous tile's ring waits
                # and MMAs, so the ring positions below are at most one lap ahead of the loader.
                mbarrier.wait(order_bars.index(CONSUMER), _turn_phase(local))
            for ki in range(k_steps):
                if TAIL_ORDER > 0 and CONSUMER == 1:
                    # tail_order: consumer 0 arrives once per tile (below), so this tile's arrival
                    # completes phase `local`. With k_steps >= STAGES consumer 0 cannot arrive for
                    # the next tile before this wait (its last slot needs our releases past it).
                    if k_steps >= STAGES and ki == k_steps - TAIL_ORDER:
                        mbarrier.wait(order_bars.index(0), local & 1)
                slot, phase = _ring_slot_phase(step, STAGES)
                mbarrier.wait(ready_bars.index(slot), phase)
                if busy:  # (else the other warpgroup's half tile: take and release the slots in step with it)
                    a_tile = a_bufs.index(slot)
                    if SPLIT_M:
                        a_tile = a_tile.slice(ROW0, TILE_M)
                    if LEAN_START:
                        use_acc = ki > 0
                    else:
                        use_acc = True
                    acc = warpgroup_mma(a_tile, w_bufs.index(slot).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
                    if GATED:
                        # Two MMA groups per step (gate, up): waiting down to 2 outstanding keeps this
                        # step's pair in flight and retires the previous step's pair, whose slot is free.
                        acc_up = warpgroup_mma(a_tile, u_bufs.index(slot).permute((1, 0)), acc_up, use_acc=use_acc,
                                               is_async=True)
                        acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_up))
                    else:
                        # Keep this MMA in flight; the one before it has now retired, so its slot is free.
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty_bars.index((step + STAGES - 1) % STAGES), pred=ki > 0)
                step += 1
            if TAIL_ORDER > 0 and CONSUMER == 0:
                # Every MMA of this tile issued: consumer 1 may issue its last TAIL_ORDER steps.
                mbarrier.arrive(order_bars.index(0), pred=k_steps >= STAGES)
            if TURNS == 2:
                # The next tile's turn (the other consumer's), while our last MMA finishes and our
                # epilogue runs. After this program's last tile nobody waits for it: harmless.
                mbarrier.arrive(order_bars.index(1 - CONSUMER))
            if LEAN_START:
                # The next tile's coordinates while the last MMA runs (past the last tile: unused).
                next_tile = _tile_of(gl.minimum(unit + TURNS * nprog, last), tiles, units, TAIL_HALVES)
                pid_m, pid_n = _grouped_tile(next_tile, num_pid_m, num_pid_n, GROUP_M)
            # The epilogue's scale loads go out while the last MMA is still running, so their
            # latency hides under it (EARLY_SCALES: the column scales too, for the whole tile, not
            # one round trip per output chunk).
            rows = off_m + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, mma_layout))
            a_scale = gl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
            if EARLY_SCALES:
                cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
                w_scale = gl.load(tile_w_scale_ptr + cols, mask=cols < N, other=0.0)
                if GATED:
                    w_scale_up = gl.load(tile_w_scale_ptr + N + cols, mask=cols < N, other=0.0)
            if GATED:
                acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty_bars.index((step + STAGES - 1) % STAGES))
            local += TURNS

            # Epilogue in fp32, in the reference's order: (acc * a_scale) * w_scale + bias.
            x = acc.to(gl.float32) * gl.expand_dims(a_scale, 1)
            if EARLY_SCALES:
                x = x * gl.expand_dims(w_scale, 0)
            if GATED:
                u = acc_up.to(gl.float32) * gl.expand_dims(a_scale, 1)
                if EARLY_SCALES:
                    u = u * gl.expand_dims(w_scale_up, 0)
            else:
                u = x  # a stand-in, unused
            if STORE_WARP == 2:
                # staging_turns: free once the part staged before this one (the other consumer's,
                # of this tile or the previous one) has been read out. This consumer's free barrier
                # completes once per tile: for consumer 0 from the second tile on (the first
                # waits for a fresh barrier's pre-completed phase), for consumer 1 from the first.
                mbarrier.wait(stage_bars.index(1 + CONSUMER), _previous_phase(local - 1 + CONSUMER))
            elif STORE_WARP:
                # The staging is free again once the store partition's stores of the previous tile
                # have read it (every consumer takes every tile: local counts this program's tiles).
                mbarrier.wait(stage_bars.index(1), _previous_phase(local - 1))
            if busy:  # (a half tile's other consumer stages and stores nothing)
                if EPILOGUE_SPLIT == 1:
                    _store_chunk(x, u, 0, off_m, off_n, out_desc, c_bufs, FIRST, BUFFERS, tile_w_scale_ptr, bias_ptr,
                                 N, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES, chunk_layout, STORE_WARP)
                elif EPILOGUE_SPLIT == 2:
                    _store_halves(x, u, 0, off_m, off_n, out_desc, c_bufs, FIRST, BUFFERS, tile_w_scale_ptr,
                                  bias_ptr, N, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES, chunk_layout, STORE_WARP)
                else:
                    left, right = _halves(x)
                    u_left, u_right = _halves(u)
                    _store_halves(left, u_left, 0, off_m, off_n, out_desc, c_bufs, FIRST, BUFFERS, tile_w_scale_ptr,
                                  bias_ptr, N, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES, chunk_layout, STORE_WARP)
                    _store_halves(right, u_right, 2, off_m, off_n, out_desc, c_bufs, FIRST, BUFFERS, tile_w_scale_ptr,
                                  bias_ptr, N, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES, chunk_layout, STORE_WARP)
            if STORE_WARP:
                # The staged tile visible to the TMA unit, then handed to the store partition.
                fence_async_shared()
                mbarrier.arrive(stage_bars.index(0))
            if LEAN_START:
                # The next tile's first MMA takes these registers as its (ignored) accumulator: no
                # zeroing, and no second set of 128 live registers.
                acc = x.to(acc_dtype, bitcast=True)
        tma.store_wait(0)

    # M, N and K only size loops and masks (TMA does the addressing): not specialized, so odd
    # shapes share one binary per config.
    @gluon.jit(do_not_specialize=["M", "N", "K", "rows_per_expert", "stride_se", "num_experts"])
    def _scaled_mm_kernel(a_desc, w_desc, out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                          block_expert_ptr, used_ptr, rows_per_expert, stride_se, num_experts,
                          HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, GROUP_M: gl.constexpr,
                          STAGES: gl.constexpr, CONSUMERS: gl.constexpr, EPILOGUE_SPLIT: gl.constexpr,
                          EPILOGUE_BUFFERS: gl.constexpr, LOADER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          GATED: gl.constexpr, EARLY_SCALES: gl.constexpr, SPLIT_M: gl.constexpr,
                          STORE_WARP: gl.constexpr, LEAN_START: gl.constexpr, TAIL_ORDER: gl.constexpr,
                          PROLOGUE_LOADS: gl.constexpr, TAIL_HALVES: gl.constexpr, GROUPED: gl.constexpr,
                          num_warps: gl.constexpr):
        # GATED: out (M, N) = act(gate) * up over the stacked (2N, K) weight of w_desc; N counts outputs.
        # GROUPED: a mixture of experts' GEMM in slot order (moe.grouped_slot_mm): a (M, K) the
        # routed rows, each block of BLOCK_M rows one expert's (block_expert_ptr), only the first
        # used_ptr[0] rows computed; w_desc the experts' weights stacked as (E * rows_per_expert, K),
        # w_scale_ptr their scales, stride_se apart. Else those five arguments are unused.
        # tail_halves with the plain epilogue only (with a bias and an activation it spilled 40 bytes).
        PLAIN_HALVES: gl.constexpr = _plain_only(TAIL_HALVES, HAS_BIAS, ACTIVATION, GATED)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        if GATED:
            u_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        else:
            u_bufs = w_bufs  # a stand-in, unused
        # Output staging (GluonConfig.staging_buffers): with a store partition every chunk its own
        # buffer, for one consumer's part (staging_turns) or for every consumer's; else
        # EPILOGUE_BUFFERS per consumer.
        STAGING: gl.constexpr = (EPILOGUE_SPLIT if STORE_WARP == 2 else
                                 CONSUMERS * (EPILOGUE_SPLIT if STORE_WARP else EPILOGUE_BUFFERS))
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [STAGING] + out_desc.block_type.shape, out_desc.layout)
        ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # Ping-pong: order_bars[c] gives consumer c its turn on the mainloop (unused with one consumer).
        order_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        # store_warp: [0] the tile staged (by every consumer), [1] the staging read out by its stores
        # (staging_turns: [0] a part staged, [1 + c] the staging free for consumer c's next part).
        stage_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready_bars.index(i), count=1)
        if PROLOGUE_LOADS > 0:
            # The first tile's first K steps (fresh slots: nothing to wait for), before the partitions
            # start and the other barriers are set up. The ready barriers' initialization must be
            # visible to the TMA unit before the first copy.
            fence_async_shared()
            BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
            num_pid_m = gl.cdiv(_rows_used(M, used_ptr, GROUPED), a_desc.block_type.shape[0])
            num_pid_n = gl.cdiv(N, w_desc.block_type.shape[0])
            tiles = num_pid_m * num_pid_n
            units = _units(tiles, gl.num_programs(0), PLAIN_HALVES)
            first_tile = _tile_of(gl.program_id(0), tiles, units, PLAIN_HALVES)
            pid_m, pid_n = _grouped_tile(first_tile, num_pid_m, num_pid_n, GROUP_M)
            w_row = (_expert_of(pid_m, block_expert_ptr, num_experts, GROUPED) * rows_per_expert
                     + pid_n * w_desc.block_type.shape[0])
            k_steps = gl.cdiv(K, BLOCK_K)
            for s in gl.static_range(PROLOGUE_LOADS):
                if s < k_steps:
                    if GROUPED:  # (the routing may leave a program no tile)
                        if first_tile < tiles:
                            _load_step(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, s,
                                       pid_m * a_desc.block_type.shape[0], w_row, s, N, GATED)
                    else:
                        _load_step(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, s,
                                   pid_m * a_desc.block_type.shape[0], w_row, s, N, GATED)
        for i in gl.static_range(STAGES):
            # SPLIT_M: both consumers read every slot, and both release it.
            mbarrier.init(empty_bars.index(i), count=CONSUMERS if SPLIT_M else 1)
        for i in gl.static_range(CONSUMERS):
            mbarrier.init(order_bars.index(i), count=1)
        mbarrier.init(stage_bars.index(0), count=1 if STORE_WARP == 2 else CONSUMERS)
        mbarrier.init(stage_bars.index(1), count=1)
        mbarrier.init(stage_bars.index(2), count=1)
        # The barriers' initialization must be visible to the TMA unit before the first copy.
        fence_async_shared()
        PLAIN_STORE_WARP: gl.constexpr = _plain_only(STORE_WARP, HAS_BIAS, ACTIVATION, GATED)
        PLAIN_LEAN: gl.constexpr = _plain_only(LEAN_START, HAS_BIAS, ACTIVATION, GATED)

        # The default partition (the kernel's num_warps) is consumer 0; workers follow: consumer 1
        # (ping-pong, split_m), the loader, and with store_warp the store partition. Neither a
        # (function, arguments) tuple nor an arguments tuple can be a variable here (Gluon 3.6 / 3.9
        # refuse both), hence one full list per arrangement.
        if CONSUMERS == 1 and PLAIN_STORE_WARP:
            gl.warp_specialize([
                (_consumer_partition, (a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, order_bars, stage_bars, c_bufs,
                                       out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                                       block_expert_ptr, used_ptr, stride_se, num_experts, 0, CONSUMERS, num_warps,
                                       GROUP_M, STAGES, EPILOGUE_SPLIT, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES,
                                       SPLIT_M, PLAIN_STORE_WARP, PLAIN_LEAN, TAIL_ORDER, PLAIN_HALVES, GROUPED)),
                (_load_partition, (a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K,
                                   block_expert_ptr, used_ptr, rows_per_expert, num_experts,
                                   GROUP_M, STAGES, GATED, PROLOGUE_LOADS, PLAIN_HALVES, GROUPED)),
                (_store_partition, (out_desc, c_bufs, stage_bars, M, N, used_ptr, GROUP_M, CONSUMERS,
                                     PLAIN_STORE_WARP, PLAIN_HALVES, GROUPED)),
            ], [1, 1], [LOADER_REGS, LOADER_REGS])
        elif CONSUMERS == 1:
            gl.warp_specialize([
                (_consumer_partition, (a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, order_bars, stage_bars, c_bufs,
                                       out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                                       block_expert_ptr, used_ptr, stride_se, num_experts, 0, CONSUMERS, num_warps,
                                       GROUP_M, STAGES, EPILOGUE_SPLIT, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES,
                                       SPLIT_M, PLAIN_STORE_WARP, PLAIN_LEAN, TAIL_ORDER, PLAIN_HALVES, GROUPED)),
                (_load_partition, (a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K,
                                   block_expert_ptr, used_ptr, rows_per_expert, num_experts,
                                   GROUP_M, STAGES, GATED, PROLOGUE_LOADS, PLAIN_HALVES, GROUPED)),
            ], [1], [LOADER_REGS])
        elif PLAIN_STORE_WARP:
            gl.warp_specialize([
                (_consumer_partition, (a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, order_bars, stage_bars, c_bufs,
                                       out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                                       block_expert_ptr, used_ptr, stride_se, num_experts, 0, CONSUMERS, num_warps,
                                       GROUP_M, STAGES, EPILOGUE_SPLIT, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES,
                                       SPLIT_M, PLAIN_STORE_WARP, PLAIN_LEAN, TAIL_ORDER, PLAIN_HALVES, GROUPED)),
                (_consumer_partition, (a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, order_bars, stage_bars, c_bufs,
                                       out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                                       block_expert_ptr, used_ptr, stride_se, num_experts, 1, CONSUMERS, num_warps,
                                       GROUP_M, STAGES, EPILOGUE_SPLIT, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES,
                                       SPLIT_M, PLAIN_STORE_WARP, PLAIN_LEAN, TAIL_ORDER, PLAIN_HALVES, GROUPED)),
                (_load_partition, (a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K,
                                   block_expert_ptr, used_ptr, rows_per_expert, num_experts,
                                   GROUP_M, STAGES, GATED, PROLOGUE_LOADS, PLAIN_HALVES, GROUPED)),
                (_store_partition, (out_desc, c_bufs, stage_bars, M, N, used_ptr, GROUP_M, CONSUMERS,
                                     PLAIN_STORE_WARP, PLAIN_HALVES, GROUPED)),
            ], [num_warps, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consumer_partition, (a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, order_bars, stage_bars, c_bufs,
                                       out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                                       block_expert_ptr, used_ptr, stride_se, num_experts, 0, CONSUMERS, num_warps,
                                       GROUP_M, STAGES, EPILOGUE_SPLIT, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES,
                                       SPLIT_M, PLAIN_STORE_WARP, PLAIN_LEAN, TAIL_ORDER, PLAIN_HALVES, GROUPED)),
                (_consumer_partition, (a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, order_bars, stage_bars, c_bufs,
                                       out_desc, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                                       block_expert_ptr, used_ptr, stride_se, num_experts, 1, CONSUMERS, num_warps,
                                       GROUP_M, STAGES, EPILOGUE_SPLIT, HAS_BIAS, ACTIVATION, GATED, EARLY_SCALES,
                                       SPLIT_M, PLAIN_STORE_WARP, PLAIN_LEAN, TAIL_ORDER, PLAIN_HALVES, GROUPED)),
                (_load_partition, (a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K,
                                   block_expert_ptr, used_ptr, rows_per_expert, num_experts,
                                   GROUP_M, STAGES, GATED, PROLOGUE_LOADS, PLAIN_HALVES, GROUPED)),
            ], [num_warps, 1], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

_GL_DTYPES = {}
if _GLUON_ERROR is None:
    _GL_DTYPES = {torch.int8: gl.int8, torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
                  torch.float16: gl.float16}

# Weight descriptors, per weight tensor (weights do not change between calls): by id() with a weak
# reference whose callback drops the entry when the weight goes (a WeakKeyDictionary would compare
# tensors with ==), each descriptor holding a detached alias rather than the weight object itself.
# Keyed inside by tile, pointer and strides (a reassigned .data moves the pointer).
_WEIGHT_DESCRIPTORS: dict[int, tuple[weakref.ref, dict]] = {}


def _descriptor(t: torch.Tensor, block: list[int], shape=None, strides=None):
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(shape or t.shape), list(strides or t.stride()), block, layout)


def _weight_descriptor(w: torch.Tensor, block: list[int]):
    entry = _WEIGHT_DESCRIPTORS.get(id(w))
    if entry is None or entry[0]() is not w:
        entry = _WEIGHT_DESCRIPTORS[id(w)] = (
            weakref.ref(w, lambda _, key=id(w): _WEIGHT_DESCRIPTORS.pop(key, None)), {})
    key = (tuple(block), w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    desc = entry[1].get(key)
    if desc is None:
        desc = entry[1][key] = _descriptor(w.detach(), block)
    return desc


def _check(a, w, a_scale, w_scale, bias, activation, out_dtype, gated=False):
    if a.dtype not in (torch.int8, torch.float8_e4m3fn) or w.dtype != a.dtype:
        raise ValueError(f"a and w must both be int8 or both float8_e4m3fn, got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"a (M, K) and w (N, K) expected, got {tuple(a.shape)} and {tuple(w.shape)}")
    M, K = a.shape
    N = w.shape[0]
    if gated:
        if N % 2:
            raise ValueError(f"the gated GEMM needs a stacked [gate; up] weight of 2N rows, got {N} rows")
        if bias is not None:
            raise ValueError("the gated GEMM takes no bias")
    if K % 16:
        raise ValueError(f"K={K} is not a multiple of 16 (TMA needs 16-byte row strides); pad K")
    for name, t in (("a", a), ("w", w)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name} needs contiguous rows, a 16-byte aligned base and row stride; "
                             f"call .contiguous()")
    if a_scale.numel() != M or w_scale.numel() != N:
        raise ValueError(f"a_scale needs M={M} values (per row) and w_scale {N} (per weight row), got "
                         f"{a_scale.numel()} and {w_scale.numel()}")
    if bias is not None and bias.numel() != N:
        raise ValueError(f"bias needs N={N} values, got {bias.numel()}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; choose one of {ACTIVATIONS}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype={out_dtype}: bfloat16 or float16")


# Launches after the first of a key skip Gluon's JIT launch path (argument binding, descriptor
# validation and layout objects per call: ~100+ us of host time per launch, measured as eager
# 1x2048 prefill going host-bound on the H100 in session 8). QUANTKIT_GLUON_CACHED_LAUNCH=0 turns it off.
CACHED_LAUNCH = os.environ.get("QUANTKIT_GLUON_CACHED_LAUNCH", "1") != "0"
_COMPILED: dict = {}


def _stream(device: int):
    return triton.runtime.driver.active.get_current_stream(device)


class GluonCall:
    """A launch minus its addresses: config, grid and constexprs fixed for one call signature
    (``gemm.scaled_mm`` keeps one per signature, as it does a ``gemm_tma.PersistentCall``).
    Calling it launches with this call's tensors: a (M, K), w (N, K), out (M, N) with 16-byte rows,
    a_scale (M,) and w_scale (N,) float32, ``bias_arg`` the bias or any tensor when there is none.
    A gated config (``config.gated``): w the stacked (2N, K) [gate; up] weight, w_scale (2N,), no bias."""

    __slots__ = ("config", "grid", "constexprs", "chunk_n", "key", "tail")

    def __init__(self, config: GluonConfig, M: int, N: int, device: torch.device, has_bias: bool,
                 activation: str, grouped: bool = False) -> None:
        self.config = config
        tiles = cdiv(M, config.block_m) * cdiv(N, config.block_n)
        index = device.index if device.index is not None else torch.cuda.current_device()
        act = ACTIVATIONS.index(activation)
        halves = plain_only(config.tail_halves, has_bias, act, config.gated)  # the kernel's PLAIN_HALVES
        # Grouped: one program per SM at most (the routing's tile count is known on the device only).
        self.grid = ((min(num_sms(index), tiles),) if grouped else
                     (program_count(tiles, num_sms(index), config.balanced_grid, halves),))
        self.chunk_n = config.block_n // config.epilogue_split
        self.constexprs = dict(
            HAS_BIAS=has_bias, ACTIVATION=act, GROUP_M=config.group_m,
            STAGES=config.stages, CONSUMERS=config.consumers, EPILOGUE_SPLIT=config.epilogue_split,
            EPILOGUE_BUFFERS=config.epilogue_buffers, LOADER_REGS=config.loader_regs,
            CONSUMER_REGS=config.consumer_regs, GATED=config.gated, EARLY_SCALES=config.early_scales,
            SPLIT_M=config.split_m, STORE_WARP=config.store_mode, LEAN_START=config.lean_start,
            TAIL_ORDER=config.tail_order, PROLOGUE_LOADS=config.prologue_loads, TAIL_HALVES=config.tail_halves,
            GROUPED=grouped, num_warps=config.consumer_warps)
        # Per-call work kept off the hot path: the config's part of the compile key, and the
        # constexprs in signature order (after the 14 runtime arguments) for the cached launcher.
        self.key = (config, tuple(self.constexprs.items()))
        self.tail = tuple(self.constexprs[name] for name in _scaled_mm_kernel.arg_names[14:])

    def __call__(self, a, w, out, a_scale, w_scale, bias_arg, grouped_args: tuple | None = None) -> None:
        """``grouped_args`` (a grouped config): (block_expert, used, rows_per_expert, stride_se,
        num_experts), w the experts' stacked (E * rows_per_expert, K) weight."""
        cfg = self.config
        M, K = a.shape
        N = out.shape[1]
        extra = grouped_args or (a_scale, a_scale, 0, 0, 0)  # unused by the dense form
        # What the compiled binary depends on besides the config: the dtypes (descriptor element
        # types, the bias pointer), each integer's specialization and the pointers' alignment.
        key = (self.key, a.dtype, out.dtype, bias_arg.dtype, int_spec(M), int_spec(N), int_spec(K),
               aligned(a_scale, w_scale, bias_arg, extra[0], extra[1]))
        device = a.device.index if a.device.index is not None else torch.cuda.current_device()
        compiled = _COMPILED.get((device, key)) if CACHED_LAUNCH else None
        if compiled is None or launch_hooks_active():
            # Gluon's own launcher (validated descriptors); the compiled kernel is kept for later calls.
            a_desc = _descriptor(a, [cfg.block_m, cfg.block_k])
            w_desc = _weight_descriptor(w, [cfg.block_n, cfg.block_k])
            out_desc = _descriptor(out, [cfg.stored_rows, self.chunk_n], shape=[M, N], strides=[out.stride(0), 1])
            compiled = _scaled_mm_kernel[self.grid](a_desc, w_desc, out_desc, a_scale, w_scale, bias_arg, M, N, K,
                                                    *extra, **self.constexprs)
            if CACHED_LAUNCH and hasattr(compiled, "packed_metadata"):
                _COMPILED[(device, key)] = compiled
            return
        # The cached path (as launch.CachedLaunch does for the Triton kernels): the binary's own
        # launcher, with light descriptor objects carrying the fields it reads (base, shape,
        # strides, padding); the TMA maps are encoded from them as on Gluon's path.
        args = (_Descriptor(a, [M, K], [a.stride(0), 1], None), _Descriptor(w, [w.shape[0], K], [w.stride(0), 1], None),
                _Descriptor(out, [M, N], [out.stride(0), 1], None), a_scale, w_scale, bias_arg, M, N, K, *extra)
        compiled.run(self.grid[0], 1, 1, _stream(device), compiled.function, compiled.packed_metadata, None, None,
                     None, *args, *self.tail)


# The configs the first call of a (N, K, M bucket, dtype, epilogue) times; the fastest is kept.
# Measured on an H100 (benchmarks/NOTES-gemm.md, sessions 8-9): one of the first three was the
# fastest INT8 kernel at each of the 12 large-M points in session 8; in session 9 coop2_128x256 beat
# the tuned pick among them at all 8 points with M >= 4096 (1.01-1.07x); pp_128x128 stays for
# M = 1024, where the partial last wave matters. coop2_128x256_g16_lean (session 15) beat
# coop2_128x256_g16 at 7 of the 12 points with INT8 (plain; 562 against 593 us at 16384x6144), and
# coop2_128x256_g16_swt beat it by 1.09-1.14x at 6 of the 8 points with M >= 4096 in session 15's
# run 6 (H100, plain: 544 against 603 us at 16384x6144, 620 against 707 at 4096x28672).
# Session 20 put session 19's forms of the last two in their place (H200, INT8, plain, 7 rounds, 12
# points with M >= 1024, against the faster of coop2_128x256_g16_lean / _swt at each point:
# coop2_128x256_g16_lean_t3_pl1 1.002-1.055x, coop2_128x256_g16_swt_t3_pl1 1.009-1.078x).
# Session 49 added the two 128x128 forms with three prologue copies to both lists (see CONFIGS).
TUNE_CANDIDATES = ("pp_128x128", "pp_128x128_s6", "coop_128x256", "coop_128x256_k64", "coop2_128x256",
                   "coop2_128x256_g16_lean_t3_pl1", "coop2_128x256_g16_swt_t3_pl1", "coop2_128x128_lean_t3_pl3",
                   "pp_128x128_s6_pl3")
# FP8's (fast accumulation; plain, not gated): measured on an H100 in session 10 at the same 12
# points, each of these four was the fastest FP8 config at one point or more (pp_128x128 at
# 6144x4096, M = 1024; coop2_128x256_g16 at 9), and the fastest of them beat the Triton FP8 kernel
# at all 12 (1.004-1.082x, plain epilogue). Session 15 added the store-partition and lean-start
# forms of coop2_128x256_g16 (they differ from it with the plain epilogue only); the tuner picked one
# of them at 9 of the 12 points with M >= 1024 in that session's standard run (H100). Session 19
# put tail_order=3 and prologue_loads=1 on the lean-start and staging-in-turns forms (see CONFIGS); session
# 20 added the balanced store-partition form, session 21 the lean form with tail_halves.
FP8_TUNE_CANDIDATES = ("pp_128x128", "pp_128x128_s6", "coop_128x256", "coop2_128x256", "coop2_128x256_g16",
                       "coop2_128x256_g16_sw", "coop2_128x256_g16_swt_t3_pl1", "coop2_128x256_g16_lean_t3_pl1",
                       "coop2_128x256_g16_lean_t3_pl1_bal", "coop2_128x256_g16_swt_t3_pl1_bal",
                       "coop2_128x256_g16_lean_t3_pl1_th", "coop2_128x128_lean_t3_pl3", "pp_128x128_s6_pl3")
# The gated GEMM's candidates, INT8 and FP8 (all of GATED_CONFIGS): at gate_up 2 x 14336 x 4096
# on an H100 each was the fastest gated config of a dtype at one M or more of 256 ... 16384
# (sessions 10 and 11; gated_coop2_128x128 for FP8 and INT8 at M = 4096).
GATED_TUNE_CANDIDATES = ("gated_pp_128x64", "gated_coop_128x128", "gated_coop_128x128_k64", "gated_coop2_128x128",
                         "gated_coop2_128x128_pl1_bal")
# Rounds of timing per candidate at a key's first call; the order of the candidates rotates by
# one each round and the median is kept. One pass measured the same config 682 and 748 us in two
# H100 runs (FP8 28672x4096, M = 4096; session 10): a single sample is at the mercy of the
# clock and power state of the moment.
TUNE_ROUNDS = 3
_TUNED: dict[tuple, GluonConfig] = {}
# Per tuning key, every candidate's time (ms) when it was tuned: what the pick was made from.
TUNE_TIMES: dict[tuple, dict[str, float]] = {}


def tune_bucket(M: int) -> int:
    """The M part of tuned_call's key: powers of two, uncapped (not gemm_configs.m_bucket's cap at
    4096), for the plain and the gated GEMM alike: the best config changes past 4096. Gated (H100,
    gate_up 2 x 14336 x 4096): gated_pp_128x64 fastest at M = 1024 / 4096, 18 % slower than
    gated_coop_128x128_k64 at M = 16384. Plain (H100, session 13, when the key was capped):
    pp_128x128_s6 won the tuning at 28672x4096, M = 4096 by 2 % and then ran M = 16384 too,
    L2-bound there: 0.82x `_scaled_mm`, 3853 us against 2820 us for coop2_128x256_g16 in session 12."""
    return 1 << max(0, M - 1).bit_length()


def candidates(dtype: torch.dtype, gated: bool) -> tuple[str, ...]:
    """The config names ``tuned_call`` times for a call of this operand dtype and form."""
    if gated:
        return GATED_TUNE_CANDIDATES
    return TUNE_CANDIDATES if dtype == torch.int8 else FP8_TUNE_CANDIDATES


def config_named(name: str) -> GluonConfig:
    """A config of CONFIGS or GATED_CONFIGS by name."""
    return CONFIGS[name] if name in CONFIGS else GATED_CONFIGS[name]


def tuned_call(a, w, out, a_scale, w_scale, bias, activation: str, gated: bool = False) -> GluonCall:
    """The ``GluonCall`` of the fastest candidate config for this call's tuning key, timed on its
    first call with the call's own tensors (CUDA-graph replays, L2 flushed; the median of
    TUNE_ROUNDS rounds in rotating order; like Triton's autotuner, this cannot run inside a graph
    capture: warm up first), among ``candidates``.
    ``gated``: w is the stacked (2N, K) [gate; up] weight, out (M, N), no bias."""
    M, K = a.shape
    N = out.shape[1]
    has_bias = bias is not None
    bias_arg = bias if has_bias else w_scale
    key = (N, K, tune_bucket(M), a.dtype, has_bias, None if bias is None else bias.dtype, activation, out.dtype,
           a.device, gated)
    config = _TUNED.get(key)
    if config is None:
        if a.is_cuda:
            refuse_tuning_in_capture()
        calls = {name: GluonCall(config_named(name), M, N, a.device, has_bias, activation)
                 for name in candidates(a.dtype, gated)}
        times, _ = rotated_medians(calls, lambda call: _graph_bench_ms(
            lambda: call(a, w, out, a_scale, w_scale, bias_arg)), TUNE_ROUNDS)
        TUNE_TIMES[key] = times
        config = _TUNED[key] = config_named(min(times, key=times.get))
    return GluonCall(config, M, N, a.device, has_bias, activation)


def gluon_scaled_mm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, activation: str = "none",
                    out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | str | None = None) -> torch.Tensor:
    """``act((a @ w.T) * a_scale[:, None] * w_scale[None, :] + bias)`` as (M, N) ``out_dtype``.

    a: (M, K) int8 or float8_e4m3fn; w: (N, K) the same dtype, as stored; a_scale (M,) and
    w_scale (N,) float32; bias (N,) bf16 / fp16 / fp32 or None; activation one of
    reference.ACTIVATIONS. ``config``: a GluonConfig, a name in CONFIGS, or None for
    ``pick_config``. Needs ``available()``. Where N * 2 bytes is not a multiple of 16 the result
    is a view of a padded buffer (row stride rounded up to 8 elements).
    """
    if not available():
        raise RuntimeError(f"the Gluon GEMM needs an sm_90 GPU and the Gluon of triton 3.6 or 3.9 "
                           f"({_GLUON_ERROR or 'no GPU'})")
    _check(a, w, a_scale, w_scale, bias, activation, out_dtype)
    M, K = a.shape
    N = w.shape[0]
    if isinstance(config, str):
        config = CONFIGS[config]
    cfg = config or pick_config(N, K, M, a.dtype)
    if cfg.gated:
        raise ValueError(f"{cfg.name} is a gated config: use gluon_gated_scaled_mm")

    return _run(cfg, a, w, a_scale, w_scale, bias, activation, out_dtype, N)


def gluon_gated_scaled_mm(a: torch.Tensor, w_gate_up: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                          activation: str = "silu", out_dtype: torch.dtype = torch.bfloat16,
                          config: GluonConfig | str | None = None) -> torch.Tensor:
    """``act(gate) * up`` as (M, N) ``out_dtype``, one GEMM over the stacked (2N, K) [gate; up] weight:
    ``gate = (a @ w_gate_up[:N].T) * a_scale[:, None] * w_scale[None, :N]``, ``up`` the same with rows
    and scales N..2N-1 (the arithmetic of ``gemm.gated_scaled_mm``). a: (M, K) int8 or
    float8_e4m3fn; w_scale (2N,) float32. ``config``: a gated GluonConfig, a name in
    GATED_CONFIGS, or None (gated_coop_128x128). Needs ``available()``.
    """
    if not available():
        raise RuntimeError(f"the Gluon GEMM needs an sm_90 GPU and the Gluon of triton 3.6 or 3.9 "
                           f"({_GLUON_ERROR or 'no GPU'})")
    _check(a, w_gate_up, a_scale, w_scale, None, activation, out_dtype, gated=True)
    M, K = a.shape
    N = w_gate_up.shape[0] // 2
    if isinstance(config, str):
        config = GATED_CONFIGS[config]
    cfg = config or GATED_CONFIGS["gated_coop_128x128"]
    if not cfg.gated:
        raise ValueError(f"{cfg.name} is not a gated config; choose one of GATED_CONFIGS")

    return _run(cfg, a, w_gate_up, a_scale, w_scale, None, activation, out_dtype, N)


def _run(cfg: GluonConfig, a, w, a_scale, w_scale, bias, activation, out_dtype, N) -> torch.Tensor:
    """One launch of ``cfg`` into a fresh (M, N) output (a view of a padded buffer where N * 2
    bytes is not a multiple of 16: the TMA store needs 16-byte rows)."""
    M = a.shape[0]
    row = cdiv(N, 8) * 8
    storage = torch.empty((M, row), device=a.device, dtype=out_dtype)
    out = storage if row == N else storage[:, :N]
    a_scale = a_scale.reshape(-1).float().contiguous()
    w_scale = w_scale.reshape(-1).float().contiguous()
    bias_arg = bias.reshape(-1).contiguous() if bias is not None else w_scale
    GluonCall(cfg, M, N, a.device, bias is not None, activation)(a, w, out, a_scale, w_scale, bias_arg)
    return out


# The grouped (mixture of experts) form's configs: 128-row blocks (moe.block_m_for's prefill
# height), no half tiles (the tile count is the routing's, known on the device only).
GROUPED_CONFIGS = {False: "coop2_128x256_g16", True: "gated_coop2_128x128"}


def grouped_takes(config: GluonConfig) -> bool:
    """``config`` can run a grouped GEMM (expert blocks of ``config.block_m`` rows): no half tiles
    (their split needs the tile count on the host) and no copies from the prologue (it reads the
    first tile's expert before knowing whether the routing left the program a tile)."""
    return not (config.tail_halves or config.prologue_loads)


def gluon_grouped_mm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                     block_expert: torch.Tensor, used: torch.Tensor, activation: str = "none", gated: bool = False,
                     out: torch.Tensor | None = None, config: GluonConfig | str | None = None) -> torch.Tensor:
    """A mixture of experts' GEMM with its rows in slot order (``moe.grouped_slot_mm``): for each
    row r below ``used[0]``, ``out[r] = act(a[r] @ w[e].T * a_scale[r] * w_scale[e])`` (gated: the
    [gate; up] halves of w[e]'s rows, ``act(gate) * up``), e = ``block_expert[r // block_m]`` (its
    last expert for the run of no expert, whose rows come with zero scales). Rows from ``used[0]``
    on are not written. a (M, K) int8 / float8_e4m3fn, w (E, rows, K) the same dtype, a_scale (M,)
    and w_scale (E, rows) float32; out (M, N) bf16 / fp16 with 16-byte rows. Needs ``available()``."""
    if not available():
        raise RuntimeError(f"the Gluon GEMM needs an sm_90 GPU and the Gluon of triton 3.6 or 3.9 "
                           f"({_GLUON_ERROR or 'no GPU'})")
    if isinstance(config, str) or config is None:
        config = config_named(config or GROUPED_CONFIGS[gated])
    experts, rows, K = w.shape
    N = rows // 2 if gated else rows
    if tuple(w_scale.shape) != (experts, rows) or not w_scale.is_contiguous() or w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be a contiguous float32 ({experts}, {rows}) tensor (one per expert row), got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")
    _check(a, w.view(experts * rows, K), a_scale, w_scale.reshape(-1), None, activation,
           out.dtype if out is not None else torch.bfloat16, gated)
    if config.gated != gated or not grouped_takes(config) or not w.is_contiguous():
        raise ValueError(f"{config.name} cannot run this grouped GEMM (gated={gated}, contiguous weight "
                         f"{w.is_contiguous()}): pass a {'gated ' if gated else ''}config without tail_halves")
    M = a.shape[0]
    if M % config.block_m or block_expert.numel() != M // config.block_m:
        raise ValueError(f"a has {M} rows for {block_expert.numel()} blocks of {config.block_m}: pass the plan's slots")
    if out is None:
        out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16)
    if out.shape != (M, N) or out.stride(1) != 1 or (out.stride(0) * out.element_size()) % 16:
        raise ValueError(f"out must be ({M}, {N}) with 16-byte rows, got {tuple(out.shape)}")
    grouped_call(config, M, N, a.device, activation)(a, w, out, a_scale, w_scale, block_expert, used)
    return out


class GroupedCall:
    """``gluon_grouped_mm``'s launch for one (config, rows, columns, device, activation), for
    callers that validated the call's signature once (``moe.grouped_slot_mm`` keeps one per
    signature): ``call(a, w (E, rows, K), out, a_scale, w_scale (E, rows), block_expert, used)``."""

    __slots__ = ("call",)

    def __init__(self, config: GluonConfig, M: int, N: int, device: torch.device, activation: str) -> None:
        self.call = GluonCall(config, M, N, device, False, activation, grouped=True)

    def __call__(self, a, w, out, a_scale, w_scale, block_expert, used) -> None:
        experts, rows, K = w.shape
        self.call(a, w.view(experts * rows, K), out, a_scale, w_scale, w_scale,
                  (block_expert, used, rows, w_scale.stride(0), experts))


def grouped_call(config: GluonConfig, M: int, N: int, device: torch.device, activation: str) -> GroupedCall:
    """The ``GroupedCall`` of this launch shape, made once (a layer calls with the same plan
    capacity again and again; a server sees many, so the cache is bounded)."""
    key = (config, M, N, device, activation)
    call = _GROUPED_CALLS.get(key)
    if call is None:
        call = _GROUPED_CALLS.add(key, GroupedCall(config, M, N, device, activation))
    return call


# The grouped form's launches by (config, rows, columns, device, activation).
_GROUPED_CALLS = SignatureCache(max_entries=64)
