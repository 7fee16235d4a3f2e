"""Activation-quantization benchmarks: achieved GB/s against the measured copy bandwidth.

The kernels are memory-bound, so the figure of merit is the minimum bytes they must move (each
input read once, each output written once) over the time, compared with a device-to-device
copy measured in the same run (bytes read + bytes written).
"""

from __future__ import annotations

import torch

from quantkit.bench.gemm import bench_graph_ms, bench_ms, environment_metadata, write_results
from quantkit.kernels import triton_ops

DEFAULT_SHAPES = [(4096, 4096), (16384, 4096), (4096, 14336), (16384, 14336)]


def copy_bandwidth_gbs(n_bytes: int = 1 << 30, timer=bench_ms) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def run_quant_benchmark(shapes=None, out_dir="benchmarks/results", timer=bench_graph_ms) -> list[dict]:
    """Per-token, per-tensor and fused RMSNorm(+residual) quantization of bf16 activations."""
    if not torch.cuda.is_available():
        raise ValueError("the quantization benchmark needs a CUDA GPU")
    meta = environment_metadata()
    copy_gbs = copy_bandwidth_gbs(timer=timer)
    meta["copy_gbs"] = copy_gbs
    meta["timer"] = getattr(timer, "__name__", str(timer))
    rows = []
    for M, K in shapes or DEFAULT_SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        weight = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        static_scale = torch.tensor([0.05], device="cuda")
        for dtype_name, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
            cases = {
                # (callable, bytes moved): bf16 in, 1-byte q out, fp32 scale per row.
                "quantize_per_token": (lambda: triton_ops.quantize_per_token(x, dtype), M * K * 3 + M * 4),
                "quantize_per_tensor": (lambda: triton_ops.quantize_per_tensor(x, static_scale, dtype), M * K * 3),
                "rms_norm_quant": (lambda: triton_ops.rms_norm_quant_per_token(x, weight, 1e-6, dtype),
                                   M * K * 3 + M * 4 + K * 2),
                # + residual read and the new residual written, both bf16.
                "add_rms_norm_quant": (lambda: triton_ops.rms_norm_quant_per_token(x, weight, 1e-6, dtype, residual),
                                       M * K * 7 + M * 4 + K * 2),
            }
            for name, (fn, n_bytes) in cases.items():
                ms = timer(fn)
                gbs = n_bytes / (ms * 1e-3) / 1e9
                rows.append({"op": f"{name}_{dtype_name}", "M": M, "K": K, "ms": ms, "bytes": n_bytes, "gbs": gbs,
                             "fraction_of_copy": gbs / copy_gbs})
                print(f"{name}_{dtype_name:4s} M={M:5d} K={K:5d} {ms*1e3:8.1f}us {gbs:7.0f} GB/s "
                      f"{100*gbs/copy_gbs:5.1f}% of copy ({copy_gbs:.0f} GB/s)", flush=True)
    write_results(rows, out_dir, "gemm_quant", meta)
    return rows
