"""Dev probe (session 16, not kept): does the tail split happen, and what does it cost."""
import sys, importlib.util, statistics
import kernels_only  # noqa
import torch
spec = importlib.util.spec_from_file_location("gemm_gluon_sk", "benchmarks/_gemm_gluon_sk.py")
mod = importlib.util.module_from_spec(spec); sys.modules["gemm_gluon_sk"] = mod; spec.loader.exec_module(mod)
from quantkit.bench.gemm import _bf16_operands, _quantized, adaptive_graph_ms
from quantkit.kernels.launch import rotated_medians

real_rule = mod.tail_split_for
for M, N, K in [(1024, 6144, 4096), (16384, 4096, 4096), (4096, 28672, 4096), (1024, 4096, 4096)]:
    x, w_bf16, _ = _bf16_operands(M, N, K, "cuda")
    a, a_s, w, w_s = _quantized(x, w_bf16, torch.float8_e4m3fn)
    a_s = a_s.reshape(-1).float().contiguous(); w_s = w_s.reshape(-1).float().contiguous()
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    calls = {}
    for name in ("coop2_128x256_g16_swt", "coop2_128x256_g16_swt_sk"):
        calls[name] = mod.GluonCall(mod.CONFIGS[name], M, N, a.device, False, "none")
    sk = calls["coop2_128x256_g16_swt_sk"]
    split = real_rule(sk.tiles, sk.grid[0], -(-K // 128))
    # Did it split? poison the partials, run, look.
    sk(a, w, out, a_s, w_s, w_s); torch.cuda.synchronize()
    ws = mod._TAIL_WORKSPACES
    touched = None
    if ws:
        partials, counters = next(iter(ws.values()))
        partials.fill_(float("nan")); torch.cuda.synchronize()
        sk(a, w, out, a_s, w_s, w_s); torch.cuda.synchronize()
        touched = int((~torch.isnan(partials)).sum().item())
        print("counters after:", int(counters.abs().sum().item()))
    ref = out.clone()
    calls["coop2_128x256_g16_swt"](a, w, out, a_s, w_s, w_s); torch.cuda.synchronize()
    print(f"{M}x{N}x{K}: tiles {sk.tiles} grid {sk.grid[0]} split {split}; partial floats written {touched}; "
          f"max diff vs unsplit {(ref.float() - out.float()).abs().max().item():.3g}")
    ops = {"swt": lambda: calls["coop2_128x256_g16_swt"](a, w, out, a_s, w_s, w_s),
           "swt_sk": lambda: sk(a, w, out, a_s, w_s, w_s)}
    def forced(n):
        def run():
            mod.tail_split_for = lambda *args: n
            try:
                sk(a, w, out, a_s, w_s, w_s)
            finally:
                mod.tail_split_for = real_rule
        return run
    ops["swt_sk_split1"] = forced(1)
    if split != 2: ops["swt_sk_split2"] = forced(2)
    if split != 3: ops["swt_sk_split3"] = forced(3)
    med, samples = rotated_medians(ops, adaptive_graph_ms, 5)
    print("   ", {k: round(v * 1e3, 2) for k, v in med.items()})
