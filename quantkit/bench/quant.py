"""Activation-quantization benchmarks: achieved GB/s against the measured copy bandwidth.

The kernels are memory-bound, so the figure of merit is the minimum bytes they must move (each
input read once, each output written once) over the time, compared with device-to-device copies
measured in the same run (bytes read + bytes written). A copy's bandwidth is the best of three
measurements (``copy_ceiling``): torch's memcpy and quantkit's SM copy kernel
(``quantkit.kernels.copy``) with the run's timer, and the memcpy with triton's do_bench. The
graph-timed memcpy alone is not a ceiling: in a CUDA graph it moved some sizes at 2.7 TB/s and
others a few KB apart at 4.1-4.3 TB/s on an H200 (session 43, ``benchmarks/gpu_checks_s43.py``).
- ``copy_gbs``: a copy moving 1 GiB (``fraction_of_copy``), its three measurements in
  ``copy_ceiling_gbs``;
- per row, ``same_size_copy_gbs``: a copy moving as many bytes as the kernel (the same launch
  ramp and tail; ``fraction_of_same_size_copy``), its three measurements in
  ``same_size_copies_gbs``.
"""

from __future__ import annotations

import math

import torch

from quantkit.bench.gemm import bench_graph_ms, bench_ms, environment_metadata, write_results
from quantkit.kernels import triton_ops
from quantkit.kernels.copy import device_copy

DEFAULT_SHAPES = [(4096, 4096), (16384, 4096), (4096, 14336), (16384, 14336)]


def quant_bytes(op: str, M: int, K: int) -> int:
    """Minimum bytes an op moves for (M, K) bf16 input: 1-byte q out, one fp32 scale per row,
    the bf16 norm weight once, and for ``add_rms_norm_quant`` the residual in + new residual out."""
    if op == "quantize_per_token":
        return M * K * 3 + M * 4
    if op == "quantize_per_tensor":
        return M * K * 3
    if op == "rms_norm_quant":
        return M * K * 3 + M * 4 + K * 2
    if op == "add_rms_norm_quant":
        return M * K * 7 + M * 4 + K * 2
    raise ValueError(f"op={op!r} is not a quantization op this module counts bytes for")


def boundary_inputs(scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp32 inputs whose quotients by ``scale`` sit on, and one ulp either side of, the rounding
    boundaries of ``dtype``'s grid (int8: k + 0.5; float8_e4m3fn: the midpoints between neighbours),
    both signs: where a quantizer's division must round exactly like the twin's."""
    if dtype == torch.int8:
        bounds = torch.arange(-128, 128, dtype=torch.float64) + 0.5
    else:
        grid = torch.arange(0, 127, dtype=torch.int16).to(torch.int8).view(torch.float8_e4m3fn).double()
        grid = grid[torch.isfinite(grid)].unique()
        bounds = (grid[:-1] + grid[1:]) / 2
        bounds = torch.cat([bounds, -bounds])
    x = (bounds * scale).float()
    up, down = torch.full_like(x, math.inf), torch.full_like(x, -math.inf)
    return torch.cat([x, torch.nextafter(x, up), torch.nextafter(x, down)])


def static_quant_edge_inputs(scale: float, dtype: torch.dtype, K: int = 272, nan: bool = False) -> torch.Tensor:
    """(rows, K) fp32 inputs for checking a static quantizer against its twin at ``scale``: signed
    zeros, values that saturate, overflow the quotient or underflow it, infinities (``nan``: NaN of
    both signs too), scaled by ``scale`` where it is a moderate finite one; ``boundary_inputs``; then
    random values up to a whole even number of rows (K = 272 is odd against 4096-wide blocks)."""
    special = [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 1e30, -1e30, 3.0e38, -3.0e38, math.inf, -math.inf,
               5.0, -5.0, 0.3, -0.3, 448.0, -1000.0] + ([math.nan, -math.nan] if nan else [])
    finite_scale = math.isfinite(scale) and scale > 0
    x = torch.cat([torch.tensor(special) * (scale if finite_scale and scale < 1e10 else 1.0),
                   boundary_inputs(scale if finite_scale else 1.0, dtype)])
    return torch.cat([x, torch.randn(2 * K - x.numel() % (2 * K)) * 3]).reshape(-1, K)


def do_bench_ms(fn) -> float:
    """triton's do_bench median (L2 cleared before every repetition), a shorter budget than bench_ms."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def copy_bandwidth_gbs(n_bytes: int = 1 << 30, timer=bench_ms, device: str = "cuda", kernel: str = "memcpy") -> float:
    """GB/s of a device-to-device copy of ``n_bytes // 2`` bytes: n_bytes moved (read + write).
    ``kernel``: "memcpy" (torch's ``copy_``) or "sm" (``quantkit.kernels.copy.device_copy``)."""
    if kernel not in ("memcpy", "sm"):
        raise ValueError(f"kernel={kernel!r}; use 'memcpy' or 'sm'")
    half = max(n_bytes // 2, 1)
    src = torch.empty(half, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer((lambda: dst.copy_(src)) if kernel == "memcpy" else (lambda: device_copy(dst, src)))
    return 2 * half / (ms * 1e-3) / 1e9


def copy_ceiling(n_bytes: int, timer=bench_graph_ms, device: str = "cuda") -> dict:
    """The copy bandwidth for ``n_bytes`` moved: its three measurements (GB/s) and the best."""
    found = {"memcpy": copy_bandwidth_gbs(n_bytes, timer, device),
             "sm": copy_bandwidth_gbs(n_bytes, timer, device, kernel="sm"),
             "memcpy_do_bench": copy_bandwidth_gbs(n_bytes, do_bench_ms, device)}
    return {**found, "best": max(found.values())}


def run_quant_benchmark(shapes=None, out_dir="benchmarks/results", timer=bench_graph_ms) -> list[dict]:
    """Per-token, per-tensor and fused RMSNorm(+residual) quantization of bf16 activations."""
    if not torch.cuda.is_available():
        raise ValueError("the quantization benchmark needs a CUDA GPU")
    meta = environment_metadata()
    ceiling = copy_ceiling(1 << 30, timer=timer)
    copy_gbs = ceiling["best"]
    meta.update(copy_gbs=copy_gbs, copy_ceiling_gbs=ceiling, timer=getattr(timer, "__name__", str(timer)))
    rows, same_size_copies = [], {}
    for M, K in shapes or DEFAULT_SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        weight = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        static_scale = torch.tensor([0.05], device="cuda")
        for dtype_name, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
            cases = {
                "quantize_per_token": lambda: triton_ops.quantize_per_token(x, dtype),
                "quantize_per_tensor": lambda: triton_ops.quantize_per_tensor(x, static_scale, dtype),
                "rms_norm_quant": lambda: triton_ops.rms_norm_quant_per_token(x, weight, 1e-6, dtype),
                "add_rms_norm_quant": lambda: triton_ops.rms_norm_quant_per_token(x, weight, 1e-6, dtype, residual),
            }
            for name, fn in cases.items():
                n_bytes = quant_bytes(name, M, K)
                ms = timer(fn)
                gbs = n_bytes / (ms * 1e-3) / 1e9
                if n_bytes not in same_size_copies:
                    same_size_copies[n_bytes] = copy_ceiling(n_bytes, timer=timer)
                same_size = same_size_copies[n_bytes]
                rows.append({"op": f"{name}_{dtype_name}", "M": M, "K": K, "ms": ms, "bytes": n_bytes, "gbs": gbs,
                             "fraction_of_copy": gbs / copy_gbs, "same_size_copy_gbs": same_size["best"],
                             "same_size_copies_gbs": same_size, "fraction_of_same_size_copy": gbs / same_size["best"]})
                print(f"{name}_{dtype_name:4s} M={M:5d} K={K:5d} {ms*1e3:8.1f}us {gbs:7.0f} GB/s "
                      f"{100*gbs/copy_gbs:5.1f}% of a 1 GiB copy ({copy_gbs:.0f} GB/s), "
                      f"{100*gbs/same_size['best']:5.1f}% of a same-size copy ({same_size['best']:.0f})", flush=True)
    write_results(rows, out_dir, "gemm_quant", meta)
    return rows
