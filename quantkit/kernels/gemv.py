"""INT8 / FP8 scaled GEMV for decode (1 <= M <= 4 rows of activation), without tensor cores.

    out[m, n] = act(acc[m, n] * a_scale[m] * w_scale[n] + bias[n])      (fp32, then cast once)
    acc       = sum_k a[m, k] * w[n, k]      int32 for INT8 (exact), fp32 for FP8 e4m3fn

The semantics, argument checks and epilogue are ``gemm.scaled_mm``'s (``gemm_checks``,
``gemm_epilogue.store_tile``, gated form included); the torch twin is
``reference.scaled_mm``. Only the mainloop differs.

Why a second kernel: at M <= 4 the GEMM is a stream of the (N, K) weight, 1 byte per element,
and nothing else. The tensor-core kernel pads M to a 16-row MMA tile and stages every weight tile
through shared memory for wgmma; measured on an H100 it streams the weight at ~2 TB/s, while
cuBLAS's bf16 GEMV reaches ~2.9 TB/s on twice the bytes. Here each program owns BLOCK_N weight
rows (output columns) and walks their whole K range in BLOCK_K-byte steps: every thread loads 16
contiguous bytes per row per step (one 128-bit load), multiplies them in registers with the
matching bytes of the BLOCK_M activation rows (BLOCK_M = next power of two >= M, so 1, 2 or 4;
row 3 of M = 3 repeats row 0 and is not stored) and reduces the step along K into a
(BLOCK_M, BLOCK_N) accumulator. With BLOCK_N = 4..16, N = 4096 already gives 256..1024 programs
for the 132 SMs, each with the full K: no split-K and no combine. The activation (M x K bytes)
stays in L1/L2; the weight is loaded ``evict_first`` (read once per call).

INT8 products are formed and summed in int32: the accumulator is exactly the integer dot product
(K <= gemm_checks.MAX_INT8_K); ``int8_gemv_accumulator`` returns it raw for the tests. FP8 values
are widened to fp32 (each e4m3 x e4m3 product is exact in fp32) and summed in fp32.

Layers: ``_scaled_gemv_kernel`` (@triton.jit) -> ``scaled_gemv`` launcher (validate, allocate,
grid, config). Tuning: autotuned over ``GEMV_CONFIGS`` once per (N, K, BLOCK_M, dtype, epilogue)
key on the GPU; the chosen config is then launched through ``launch.CachedLaunch``. Under the
interpreter one fixed config (``INTERPRETER_CONFIG``).

With programmatic dependent launch (``launch.PDL``, sm_90+) a GEMV may be scheduled while the
kernel before it ends, and waits for it (``griddepcontrol.wait``) before its first load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quantkit.kernels import launch
from quantkit.kernels.dependent_launch import wait_for_the_kernel_before
from quantkit.kernels.gemm_checks import ACTIVATION_CODES, check_scaled_mm_args
from quantkit.kernels.gemm_epilogue import store_tile
from quantkit.kernels.gemm_tma import AUTOTUNE_EXTRA
from quantkit.kernels.launch import (INTERPRETED, CachedLaunch, aligned, cdiv, check_runnable, config_dict,
                                     next_power_of_2)

# Largest M the GEMV takes: past 4 rows the products per weight byte (an int8 -> int32 widening
# plus M multiply-adds) start to cost as much issue time as the byte's load; use gemm.scaled_mm.
MAX_M = 4


@triton.jit
def _accumulate(acc, acc_up, a, w, w_up, IS_INT8: tl.constexpr, GATED: tl.constexpr):
    """One K step's products of the (BLOCK_M, 1, BLOCK_K) activation and (1, BLOCK_N, BLOCK_K)
    weight tiles, reduced along K into the (BLOCK_M, BLOCK_N) accumulators (the up rows' too when
    GATED)."""
    if IS_INT8:
        # |a * w| <= 128**2 and K <= MAX_INT8_K: every partial sum fits in int32, exactly.
        a_wide = a.to(tl.int32)
        acc += tl.sum(a_wide * w.to(tl.int32), axis=2)
        if GATED:
            acc_up += tl.sum(a_wide * w_up.to(tl.int32), axis=2)
    else:
        a_wide = a.to(tl.float32)
        acc += tl.sum(a_wide * w.to(tl.float32), axis=2)
        if GATED:
            acc_up += tl.sum(a_wide * w_up.to(tl.float32), axis=2)
    return acc, acc_up


@triton.jit
def _scaled_gemv_kernel(
    a_ptr, w_ptr, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_wn, stride_om,
    IS_INT8: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    W_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    RAW_ACC: tl.constexpr,
    GATED: tl.constexpr,
    INTERPRETED: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M / N wrap onto valid rows instead of being masked: the loads stay unmasked
    # (128-bit vectors) and the extra results are not stored.
    rows_a = offs_m % M
    rows_w = offs_n % N
    # (BLOCK_M, 1, BLOCK_K) activation and (1, BLOCK_N, BLOCK_K) weight tiles: their product
    # broadcasts to (BLOCK_M, BLOCK_N, BLOCK_K) and reduces along K in one tl.sum per step.
    a_ptrs = a_ptr + (rows_a.to(tl.int64) * stride_am)[:, None, None] + offs_k[None, None, :]
    w_ptrs = w_ptr + (rows_w.to(tl.int64) * stride_wn)[None, :, None] + offs_k[None, None, :]

    # GATED: w is the stacked (2N, K) [gate; up] weight; the up rows sit N rows below the gate rows.
    up_ptrs = w_ptrs + N * stride_wn

    acc_dtype = tl.int32 if IS_INT8 else tl.float32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_dtype)
    wait_for_the_kernel_before(PDL)
    for k_start in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, eviction_policy="evict_last")
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            w_up = tl.load(up_ptrs, eviction_policy="evict_first") if GATED else w
        else:
            k_mask = (offs_k < K - k_start)[None, None, :]
            a = tl.load(a_ptrs, mask=k_mask, other=0.0, eviction_policy="evict_last")
            w = tl.load(w_ptrs, mask=k_mask, other=0.0, eviction_policy="evict_first")
            w_up = tl.load(up_ptrs, mask=k_mask, other=0.0, eviction_policy="evict_first") if GATED else w
        acc, acc_up = _accumulate(acc, acc_up, a, w, w_up, IS_INT8, GATED)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        up_ptrs += BLOCK_K

    store_tile(acc, acc_up, offs_m, offs_n, M, N, out_ptr, stride_om, a_scale_ptr, w_scale_ptr, bias_ptr,
               A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS, ACTIVATION, GATED, RAW_ACC, INTERPRETED)


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------


def _cfg(block_n: int, block_k: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)


# Little's law on an H100: ~3.35 TB/s x ~0.6-0.8 us loaded DRAM latency wants 2-2.7 MB of weight
# in flight chip-wide, 15-20 KB per SM. Triton does not software-pipeline loads that feed no
# tl.dot (num_stages changes nothing in the compiled sm_90 code: no cp.async), so what is in
# flight is one K step, BLOCK_N x BLOCK_K bytes, per resident program. Per config: programs at
# N = 4096 (per SM), bytes per step per program, so bytes in flight per SM at N = 4096:
#   4 x 1024 w4:  1024 (7.8)  4 KB  ~31 KB        8 x 1024 w4:  512 (3.9)  8 KB  ~31 KB
#   4 x 2048 w4:  1024 (7.8)  8 KB  ~62 KB        8 x 2048 w8:  512 (3.9) 16 KB  ~62 KB
#   8 x 512 w4:    512 (3.9)  4 KB  ~16 KB       16 x 1024 w8:  256 (1.9) 16 KB  ~31 KB
# Every thread loads 16 contiguous bytes per row per 512 of BLOCK_K (one 128-bit load); a warp
# reads 512+ contiguous bytes of one weight row. No split-K: the smallest N of the four Llama-3-8B
# projections (4096) already gives 256-1024 programs with the full K each.
GEMV_CONFIGS = [
    _cfg(4, 1024, 4, 1),
    _cfg(4, 2048, 4, 1),
    _cfg(8, 512, 4, 1),
    _cfg(8, 1024, 4, 1),
    _cfg(8, 2048, 8, 1),
    _cfg(16, 1024, 8, 1),
]

# Under the interpreter cost is per program: wide N blocks; a 256-wide K step so the test shapes
# exercise several K steps and the masked K tail (K = 272, 1040) as well as a single short step.
INTERPRETER_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}


def _even_k(args):
    return args["K"] % args["BLOCK_K"] == 0


_scaled_gemv_autotuned = triton.autotune(
    configs=GEMV_CONFIGS,
    key=["N", "K", "BLOCK_M", "IS_INT8", "A_PER_TOKEN", "W_PER_CHANNEL", "HAS_BIAS", "ACTIVATION", "RAW_ACC", "GATED"],
    **AUTOTUNE_EXTRA,
)(triton.heuristics({"EVEN_K": _even_k})(_scaled_gemv_kernel))


def check_config(config: dict) -> None:
    """Raise ValueError for a config the kernel cannot take (explicit configs of benchmarks/tests)."""
    for name in ("BLOCK_N", "BLOCK_K"):
        value = config.get(name)
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"config {name}={value!r} must be a power of two")
    if config["BLOCK_K"] < 16:
        raise ValueError(f"config BLOCK_K={config['BLOCK_K']} must be >= 16 (one 128-bit load per thread and row)")


def config_name(cfg: dict) -> str:
    """``BNxBK wW`` for tables and logs."""
    return f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']}"


def parse_config(text: str) -> dict:
    """``BNxBKwW`` (e.g. ``4x2048w4``) -> a config dict for ``config=``."""
    try:
        blocks, warps = text.split("w")
        block_n, block_k = (int(v) for v in blocks.split("x"))
        cfg = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": int(warps), "num_stages": 1}
    except ValueError:
        raise ValueError(f"GEMV config {text!r} is not BNxBKwW, e.g. 4x2048w4") from None
    check_config(cfg)
    return cfg


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


_GEMV = CachedLaunch(_scaled_gemv_kernel)
# Autotuned config per tuning key, read back from the autotuner after its first run for a key.
_TUNED: dict = {}


def _launch(a, w, out, a_scale, w_scale, bias, activation: str, raw_acc: bool, config: dict | None,
            gated: bool = False) -> None:
    M, K = a.shape
    N = out.shape[1]
    bias_arg = bias if bias is not None else a_scale
    flags = dict(IS_INT8=a.dtype == torch.int8, A_PER_TOKEN=a_scale.numel() != 1, W_PER_CHANNEL=w_scale.numel() != 1,
                 HAS_BIAS=bias is not None, ACTIVATION=ACTIVATION_CODES[activation], RAW_ACC=raw_acc, GATED=gated)
    block_m = next_power_of_2(M)
    args = (a, w, out, a_scale, w_scale, bias_arg, M, N, K, a.stride(0), w.stride(0), out.stride(0))
    tune_key = (N, K, block_m, a.dtype, out.dtype, bias_arg.dtype, *flags.values())
    pdl = launch.pdl_enabled()
    if config is None:
        if INTERPRETED:
            config = INTERPRETER_CONFIG
        else:
            config = _TUNED.get(tune_key)
            if config is None:
                def grid(meta):
                    return (cdiv(N, meta["BLOCK_N"]),)

                _scaled_gemv_autotuned[grid](*args, **flags, INTERPRETED=False, PDL=pdl, BLOCK_M=block_m,
                                             **(launch.pdl_options(pdl) or {}))
                _TUNED[tune_key] = config_dict(_scaled_gemv_autotuned.best_config)
                return
    check_config(config)
    cfg = dict(config)
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 2)
    constexprs = dict(**flags, INTERPRETED=INTERPRETED, EVEN_K=K % cfg["BLOCK_K"] == 0, BLOCK_M=block_m,
                      BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], PDL=pdl)
    # What triton specializes: N and K (by value in tune_key), the row strides (by value here),
    # M == 1 (M is never a multiple of 16 here) and each pointer's 16-byte alignment.
    key = (tune_key, cfg["BLOCK_N"], cfg["BLOCK_K"], num_warps, num_stages, a.stride(0), w.stride(0), out.stride(0),
           M == 1, aligned(a, w, out, a_scale, w_scale, bias_arg))
    _GEMV((key, pdl), (cdiv(N, cfg["BLOCK_N"]),), args, constexprs, num_warps, num_stages,
          options=launch.pdl_options(pdl))


def _check_gemv_args(a, w, a_scale, w_scale, bias, activation, out_dtype) -> tuple[int, int, int]:
    M, N, K = check_scaled_mm_args(a, w, a_scale, w_scale, bias, activation, out_dtype)
    if M > MAX_M:
        raise ValueError(f"M={M} rows: the GEMV takes 1 <= M <= {MAX_M}; use gemm.scaled_mm for larger M")
    check_runnable(a, "a")
    return M, N, K


def scaled_gemv(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None = None, activation: str = "none", out_dtype: torch.dtype = torch.bfloat16,
                config: dict | None = None) -> torch.Tensor:
    """``act((a @ w.T) * a_scale[:, None] * w_scale[None, :] + bias)`` -> (M, N) out_dtype, for M <= 4.

    Same arguments and result as ``gemm.scaled_mm`` (a (M, K) int8 / float8_e4m3fn, w (N, K) of
    the same dtype, float32 a_scale (M,) or 1 element and w_scale (N,) or 1 element, bias (N,)
    or None, an activation of ``reference.ACTIVATIONS``, a bf16 / fp16 / fp32 output).
    ``config`` ({"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}) bypasses autotuning
    (benchmarks, tests).
    """
    M, N, K = _check_gemv_args(a, w, a_scale, w_scale, bias, activation, out_dtype)
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M and N:
        _launch(a, w, out, a_scale, w_scale, bias, activation, False, config)
    return out


def int8_gemv_accumulator(a: torch.Tensor, w: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """(M, K) int8 @ (N, K)^T int8 -> the GEMV's raw (M, N) int32 accumulator (exactness tests)."""
    if a.dtype != torch.int8:
        raise ValueError(f"a.dtype={a.dtype}; the raw accumulator exists for int8 only")
    ones = torch.ones(1, dtype=torch.float32, device=a.device)
    M, N, _ = _check_gemv_args(a, w, ones, ones, None, "none", torch.float32)
    out = torch.empty(M, N, dtype=torch.int32, device=a.device)
    if M and N:
        _launch(a, w, out, ones, ones, None, "none", True, config)
    return out
