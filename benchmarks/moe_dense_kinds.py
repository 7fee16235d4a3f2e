import json, sys, torch, triton.testing
sys.path.insert(0, "benchmarks")
from quantkit.kernels import gemm, ops
from quantkit.bench.common import environment_metadata
gen = torch.Generator(device="cuda").manual_seed(0)
rep = {**environment_metadata(), "rows": []}
for name, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
    for gated, N, K in ((True, 768, 2048), (False, 2048, 768)):
        M = 73728
        x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
        q, s = ops.quantize_per_token(x, dtype, backend="triton")
        w = torch.randn(N * (2 if gated else 1), K, device="cuda", generator=gen).mul(60).clamp(-127, 127).to(dtype)
        ws = torch.rand(w.shape[0], device="cuda", generator=gen) * 1e-3
        row = dict(dtype=name, gated=gated, M=M, N=N, K=K)
        for kind in ("auto", "persistent", "tiled"):
            f = (lambda: gemm.gated_scaled_mm(q, w, s, ws, "silu", torch.bfloat16, kernel=kind)) if gated else \
                (lambda: gemm.scaled_mm(q, w, s, ws, kernel=kind))
            try:
                f(); row[kind] = round(1e3 * triton.testing.do_bench_cudagraph(f, rep=40), 1)
            except Exception as e:
                row[kind] = f"{type(e).__name__}: {str(e)[:80]}"
        print(row, flush=True); rep["rows"].append(row)
json.dump(rep, open(sys.argv[1], "w"), indent=1)
