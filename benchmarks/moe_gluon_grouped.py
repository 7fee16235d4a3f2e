"""The warp-specialized (Gluon) GEMM in its grouped form against the Triton grouped kernels.

Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, top-8), random quantized weights
and routing, 128-row blocks (the prefill plan). The Gluon form (``gemm_gluon.gluon_grouped_mm``)
takes its rows in slot order: here they are put there by ``index_select`` before the timed call
(in a layer, the layer does it once, and the first GEMM's output is the second one's input in
that order). Per (dtype, tokens, GEMM): the default Triton kernel (pair order, rows gathered by
address) and each Gluon config, CUDA-graph replays, same process; each Gluon output row compared
with the Triton kernel's row of the same pair. Writes JSON to the path given.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_tma_sweep import E, H, I, TOP_K, header, weights  # noqa: E402
from quantkit.kernels import gemm_gluon, moe, ops  # noqa: E402

CONFIGS = {True: ("gated_coop2_128x128", "gated_coop_128x128", "gated_pp_128x64"),
           False: ("coop2_128x256_g16", "coop_128x256", "pp_128x128")}


def slot_rows(plan, row_div: int):
    """The activation row of each slot, and a mask of the slots that compute a routed pair."""
    slots = torch.arange(plan.rows.numel(), device=plan.rows.device)
    routed = (plan.rows >= 0) & (plan.block_expert[slots // plan.block_m] < E) & (slots < plan.used)
    return plan.rows.clamp(min=0) // row_div, routed


def us(fn) -> float:
    return round(1e3 * triton.testing.do_bench_cudagraph(fn, rep=40), 2)


def main(out_path: str, deadline_s: float = 450.0) -> None:
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(5)
    report = header()
    for dtype in (torch.float8_e4m3fn, torch.int8):
        name = "fp8" if dtype != torch.int8 else "int8"
        w13, s13 = weights(dtype, 2 * I, H, gen)
        w2, s2 = weights(dtype, H, I, gen)
        for tokens in (4096, 8192, 16384):
            if time.time() - start > deadline_s:
                break
            hidden = torch.randn(tokens, H, device="cuda", generator=gen, dtype=torch.bfloat16)
            experts = torch.randn(tokens, E, device="cuda", generator=gen).softmax(-1).topk(TOP_K, -1).indices
            experts = experts.reshape(-1).contiguous()
            plan = moe.route_plan(experts, E, 128)
            q, scale = ops.quantize_per_token(hidden, dtype, backend="triton")
            h = moe.grouped_scaled_mm(q, w13, scale, s13, experts, TOP_K, "silu", True, plan=plan)
            hq, hs = ops.quantize_per_token(h, dtype, backend="triton")
            for gemm, gated, a, a_scale, w, w_scale, row_div in (
                    ("gate_up", True, q, scale, w13, s13, TOP_K), ("down", False, hq, hs, w2, s2, 1)):
                activation = "silu" if gated else "none"
                n_out = I if gated else H
                flops = 2 * experts.numel() * n_out * (H if gated else I) * (2 if gated else 1)

                def triton_call():
                    return moe.grouped_scaled_mm(a, w, a_scale, w_scale, experts, row_div, activation, gated,
                                                 plan=plan)

                ref = triton_call()
                index, routed = slot_rows(plan, row_div)
                a_slots = a.index_select(0, index)
                scale_slots = torch.where(routed, a_scale[index], 0.0)
                ref_slots = ref[plan.rows.clamp(min=0).long()]
                row = dict(dtype=name, tokens=tokens, gemm=gemm, pairs=experts.numel(), flops=flops,
                           used=int(plan.used), capacity=plan.rows.numel(), triton_us=us(triton_call))
                row["copy_us"] = us(lambda: a.index_select(0, index))
                for config in CONFIGS[gated]:
                    out = torch.empty(plan.rows.numel(), n_out, device="cuda", dtype=torch.bfloat16)

                    def gluon_call(config=config, out=out):
                        return gemm_gluon.gluon_grouped_mm(a_slots, w, scale_slots, w_scale, plan.block_expert,
                                                           plan.used, activation, gated, out=out, config=config)
                    try:
                        got = gluon_call()
                        diff = (got[routed].float() - ref_slots[routed].float()).abs()
                        row[config] = dict(us=us(gluon_call), equal_rows=int((diff == 0).all(1).sum()),
                                           routed_rows=int(routed.sum()), max_abs_diff=float(diff.max()),
                                           ref_max=float(ref.float().abs().max()))
                        row[config]["tflops"] = round(flops / row[config]["us"] / 1e6, 1)
                    except Exception as exc:
                        torch.cuda.synchronize()
                        row[config] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                row["triton_again_us"] = us(triton_call)
                report["rows"].append(row)
                print(name, tokens, gemm, "triton", row["triton_us"], row["triton_again_us"], "copy", row["copy_us"],
                      {c: (row[c].get("us"), row[c].get("equal_rows"), row[c].get("routed_rows"),
                           row[c].get("max_abs_diff"), row[c].get("error")) for c in CONFIGS[gated]}, flush=True)
                with open(out_path, "w") as handle:
                    json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
