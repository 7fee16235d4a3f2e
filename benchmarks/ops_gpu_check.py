"""Session 17 GPU check (not kept): every public op on CUDA, Triton backend against the torch
backend on the same tensors, after the ops' validation moved to shared checks."""
import json, sys
from pathlib import Path
from kernels_only import ROOT  # noqa
import torch
from quantkit.kernels import ops, reference

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
g = torch.Generator(device="cuda").manual_seed(0)
rows, ok_all = [], True
for dtype in (torch.int8, torch.float8_e4m3fn):
    for M, N, K in ((1, 4096, 4096), (13, 384, 272), (257, 4096, 4096), (2048, 6144, 4096)):
        x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
        wf = torch.randn(N, K, device="cuda", generator=g) * K**-0.5
        w, ws = reference.quantize_per_channel(wf, dtype)
        w2, ws2 = reference.quantize_per_channel(torch.randn(2 * N, K, device="cuda", generator=g) * K**-0.5, dtype)
        bias = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
        a, sa = ops.quantize_per_token(x, dtype, backend="triton")
        a_t, sa_t = ops.quantize_per_token(x, dtype, backend="torch")
        res = {"dtype": str(dtype), "M": M, "N": N, "K": K,
               "per_token_equal": torch.equal(a.view(torch.int8), a_t.view(torch.int8)) and torch.equal(sa, sa_t)}
        st = torch.tensor([0.02], device="cuda")
        res["per_tensor_equal"] = torch.equal(ops.quantize_per_tensor(x, st, dtype, backend="triton").view(torch.int8),
                                              ops.quantize_per_tensor(x, st, dtype, backend="torch").view(torch.int8))
        nw = torch.randn(K, device="cuda", generator=g).to(torch.bfloat16)
        q1, s1 = ops.rms_norm_quant_per_token(x, nw, 1e-6, dtype, backend="triton")[:2]
        q2, s2 = ops.rms_norm_quant_per_token(x, nw, 1e-6, dtype, backend="torch")[:2]
        res["rms_q_mismatch_frac"] = (q1.view(torch.int8) != q2.view(torch.int8)).float().mean().item()
        y1 = ops.scaled_mm(a, w, sa, ws, bias, "silu", torch.bfloat16, backend="triton").float()
        y2 = ops.scaled_mm(a, w, sa, ws, bias, "silu", torch.bfloat16, backend="torch").float()
        res["scaled_mm_rel"] = ((y1 - y2).norm() / y2.norm()).item()
        z1 = ops.gated_scaled_mm(a, w2, sa, ws2, "silu", torch.bfloat16, backend="triton").float()
        z2 = ops.gated_scaled_mm(a, w2, sa, ws2, "silu", torch.bfloat16, backend="torch").float()
        res["gated_rel"] = ((z1 - z2).norm() / z2.norm()).item()
        ok = (res["per_token_equal"] and res["per_tensor_equal"] and res["rms_q_mismatch_frac"] < 1e-3
              and res["scaled_mm_rel"] < 1e-2 and res["gated_rel"] < 1e-2)
        res["ok"] = ok; ok_all &= ok
        rows.append(res); print(res, flush=True)
try:
    ops.scaled_mm(torch.empty(4, 0, dtype=torch.int8, device="cuda"), torch.empty(8, 0, dtype=torch.int8, device="cuda"),
                  torch.ones(4, device="cuda"), torch.ones(8, device="cuda"), backend="triton")
    k0 = "no error"
except ValueError as e:
    k0 = str(e)
ok_all &= k0.startswith("K=0")
print("K=0:", k0, "| all ok:", ok_all)
(out / "ops_gpu_check.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                    "rows": rows, "k0": k0, "all_ok": ok_all}, indent=1))
