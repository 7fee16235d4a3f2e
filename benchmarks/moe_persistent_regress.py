"""The persistent grouped kernel's 128-row configs (Qwen3-30B-A3B expert shapes, 4096 and 8192
tokens), timed with the quantkit found on PYTHONPATH, each twice, with session 31's address-loaded
config as the anchor in the same process. Run s33b put copies of four commits' ``quantkit/``
(``git archive COMMIT quantkit``) beside the tree and ran one process per commit:

    PYTHONPATH=old/COMMIT python3 benchmarks/moe_persistent_regress.py COMMIT OUT.json
"""
import json, os, sys
import torch
sys.path.insert(0, "benchmarks")
import moe_tma_sweep as s
from quantkit.kernels import moe

tag, out = sys.argv[1], sys.argv[2]
rows = []
gen = torch.Generator(device="cuda").manual_seed(1)
for dtype in (torch.float8_e4m3fn, torch.int8):
    name = "fp8" if dtype != torch.int8 else "int8"
    w13, s13 = s.weights(dtype, 2 * s.I, s.H, gen)
    w2, s2 = s.weights(dtype, s.H, s.I, gen)
    for tokens in (4096, 8192):
        pairs, calls = s.gemm_calls(dtype, tokens, gen, w13, s13, w2, s2)
        for gemm, gated in (("gate_up", True), ("down", False)):
            fn = calls[gemm]
            pers = dict(tma=True, persistent=True, block_m=128, block_n=128 if gated else 256, block_k=128,
                        num_warps=8, num_stages=4)
            variants = {"session31": s.session31_default(pairs, gated), "persistent": pers,
                        "session31_again": s.session31_default(pairs, gated), "persistent_again": pers}
            ref = fn(variants["session31"]).float()
            row = dict(commit=tag, dtype=name, tokens=tokens, gemm=gemm)
            for label, c in variants.items():
                err, us = s.error_and_us(fn, c, ref)
                row[label] = round(us, 2)
                row[label + "_err"] = err
            rows.append(row)
            print(tag, name, tokens, gemm, {k: v for k, v in row.items() if not k.endswith("err") and isinstance(v, float)}, flush=True)
json.dump(rows, open(out, "w"), indent=1)
