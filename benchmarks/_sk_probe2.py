import sys, importlib.util, statistics
import kernels_only  # noqa
import torch
spec = importlib.util.spec_from_file_location("gemm_gluon_sk", "benchmarks/_gemm_gluon_sk.py")
mod = importlib.util.module_from_spec(spec); sys.modules["gemm_gluon_sk"] = mod; spec.loader.exec_module(mod)
from quantkit.bench.gemm import _bf16_operands, _quantized
real_rule = mod.tail_split_for
for M, N, K in [(1024, 6144, 4096), (16384, 4096, 4096)]:
    x, w_bf16, _ = _bf16_operands(M, N, K, "cuda")
    a, a_s, w, w_s = _quantized(x, w_bf16, torch.float8_e4m3fn)
    a_s = a_s.reshape(-1).float().contiguous(); w_s = w_s.reshape(-1).float().contiguous()
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    sk = mod.GluonCall(mod.CONFIGS["coop2_128x256_g16_swt_sk"], M, N, a.device, False, "none")
    for forced in (None,):
        if forced: mod.tail_split_for = lambda *args: forced
        sk(a, w, out, a_s, w_s, w_s); torch.cuda.synchronize()
        partials, counters = next(iter(mod._TAIL_WORKSPACES.values()))
        partials[8000000:8000000 + 132 * 16].fill_(float('nan'))
        for _ in range(2): sk(a, w, out, a_s, w_s, w_s)
        torch.cuda.synchronize()
        tr = partials[8000000:8000000 + 132 * 2 * 8].view(torch.int32).view(132, 2, 8).long().cpu()
        mod.tail_split_for = real_rule
        t0 = tr[:, :, 0].min()
        rel = (tr - t0).float() / 1000.0  # us
        print(f"{M}x{N}x{K} split={'rule' if forced is None else forced}: us after the first tail start")
        for ev, name in [(0, 'tail start'), (1, 'unit mainloop done'), (2, 'published'), (3, 'collected'), (4, 'epilogue done'), (5, 'consumer end')]:
            v = rel[:, :, ev].flatten()
            v = v[(v > -1e5) & (v < 1e5)]
            if len(v): print(f"   {name:20s} n={len(v):3d} min {v.min():8.2f} med {v.median():8.2f} max {v.max():8.2f}")
        partials[8000000:8000000 + 132 * 16].fill_(float('nan'))
