"""Session 17 probe (not kept): kernel-only durations (CUPTI, torch.profiler) of quantkit's FP8 GEMM
and torch._scaled_mm at M = 1024, N = 4096, K = 4096 / 14336, with the L2 flushed before every call,
next to the same ops' CUDA-graph replay time (the standard benchmark's timer)."""
import json, statistics, sys
from pathlib import Path
from kernels_only import ROOT  # noqa
import torch
from torch.profiler import profile, ProfilerActivity
from quantkit.bench.gemm import _make_operands, adaptive_graph_ms
from quantkit.bench.common import bench_ms, environment_metadata
from quantkit.kernels import triton_ops

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
res = {"meta": environment_metadata(), "points": []}
for K in (4096, 14336):
    M, N = 1024, 4096
    x, w_bf16, bias, a, a_scale, w, w_scale = _make_operands(M, N, K, torch.float8_e4m3fn, "cuda")
    ops = {
        "quantkit_fp8": lambda: triton_ops.scaled_mm(a, w, a_scale, w_scale, None, "none", torch.bfloat16),
        "scaled_mm": lambda: torch._scaled_mm(a, w.t(), scale_a=a_scale.view(-1, 1), scale_b=w_scale.view(1, -1),
                                              out_dtype=torch.bfloat16, use_fast_accum=True),
    }
    point = {"M": M, "N": N, "K": K}
    for name, op in ops.items():
        for _ in range(30):
            op()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(60):
                flush.zero_()
                op()
            torch.cuda.synchronize()
        summary = {}
        for ev in prof.key_averages():
            total = getattr(ev, "device_time_total", 0) or 0
            if total > 0:
                summary[ev.key[:100]] = {"count": ev.count, "avg_us": total / max(ev.count, 1)}
        point[name] = {"kernels": summary, "graph_ms": adaptive_graph_ms(op)}
        print(M, N, K, name, json.dumps(point[name]), flush=True)
    res["points"].append(point)
(out / "probe_s17.json").write_text(json.dumps(res, indent=1))
