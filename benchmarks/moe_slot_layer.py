"""The MoE layer's slot-order path (prefill sizes) on the GPU: checks, then the layer against the
pair-order path and transformers' bf16 experts, same process.

Qwen3-30B-A3B's expert shapes (``moe_kernels.layer``: hidden 2048, 128 experts of 768, top-8),
random weights and routing. Checks, FP8 and INT8, at 3072 and 8192 tokens: ``gather_slots`` and
``combine`` equal to their torch twins; ``grouped_slot_mm`` on the Gluon kernel equal to the
persistent Triton kernel in slot order (Gluon switched off) and to the pair-order kernel's row of
each routed pair, zeros past the routing; the layer's slot-order output against the pair-order
one, and a CUDA-graph replay of it equal to the eager call. Timings (CUDA-graph replays, µs):
the layer with the slot-order path, with the pair-order path (``ops.moe_slot_order`` off), twice
each in turn, and transformers' bf16 module. Writes JSON to the path given.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import transformers
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import layer, routing  # noqa: E402
from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.kernels import gemm_gluon, moe, ops, reference  # noqa: E402

TOKENS = (2048, 3072, 4096, 8192, 16384)


def graph_us(fn) -> float:
    return round(1e3 * triton.testing.do_bench_cudagraph(fn, rep=50), 2)


def record(report: dict, row: dict, out_path: str) -> None:
    """Append ``row``, print it and rewrite the JSON file (a run cut short keeps its rows)."""
    report["rows"].append(row)
    print(json.dumps(row), flush=True)
    with open(out_path, "w") as handle:
        json.dump(report, handle, indent=1)


def pair_order(enabled: bool) -> None:
    """Route every layer call through the pair-order path (True) or restore the slot-order rule."""
    ops.moe_slot_order = (lambda plan: False) if enabled else SLOT_ORDER


SLOT_ORDER = ops.moe_slot_order


def kernel_checks(module, hidden, index, weights) -> dict:
    grouped = module.__dict__["_grouped"]
    experts = index.reshape(-1).contiguous()
    plan = moe.plan_for(experts, 128, slot_order=True)
    assert plan.block_m == 128
    q, scale = ops.quantize_per_token(hidden, grouped.quant_dtype, backend="triton")
    flat_weights = weights.reshape(-1).contiguous()
    got = moe.gather_slots(q, scale, plan, 8, 128)
    used = int(plan.used)
    ref = reference.gather_slots(q, scale, plan.rows, plan.block_expert, used, 128, 8, 128)
    checks = {"gather_equal": all(torch.equal(g.view(torch.int8) if g.element_size() == 1 else g,
                                              r.view(torch.int8) if r.element_size() == 1 else r)
                                  for g, r in zip(got, ref))}
    a13, s13 = got
    gluon = moe.grouped_slot_mm(a13, grouped.w13, s13, grouped.s13, plan, "silu", True)
    available = gemm_gluon.available
    gemm_gluon.available = lambda: False
    try:
        triton_slots = moe.grouped_slot_mm(a13, grouped.w13, s13, grouped.s13, plan, "silu", True)
    finally:
        gemm_gluon.available = available
    pairs = moe.grouped_scaled_mm(q, grouped.w13, scale, grouped.s13, experts, 8, "silu", True, plan=plan)
    checks["gate_up_gluon_equals_triton_slot_order"] = bool(torch.equal(gluon, triton_slots))
    checks["gate_up_rows_equal_pair_order"] = bool(torch.equal(gluon[plan.slots.long()], pairs))
    checks["gate_up_zero_past_used"] = bool((gluon[used:] == 0).all())
    hq, hs = ops.quantize_per_token(gluon, grouped.quant_dtype, backend="triton")
    down = moe.grouped_slot_mm(hq, grouped.w2, hs, grouped.s2, plan)
    down_ref = reference.grouped_slot_mm(hq, grouped.w2, hs, grouped.s2, plan.block_expert, used, 128)
    checks["down_rel_err_vs_twin"] = ((down.float() - down_ref.float()).norm() / down_ref.float().norm()).item()
    combined = moe.combine(down, plan.slots, hidden.shape[0], 8)
    checks["combine_equal"] = bool(torch.equal(combined, reference.combine(down, plan.slots, hidden.shape[0], 8)))
    weighted = moe.combine(down, plan.slots, hidden.shape[0], 8, flat_weights)
    checks["combine_weighted_equal"] = bool(torch.equal(
        weighted, reference.combine(down, plan.slots, hidden.shape[0], 8, flat_weights)))
    # The layer: slot order against pair order, and a CUDA-graph replay against the eager call.
    with torch.no_grad():
        slot_out = module(hidden, index, weights)
        pair_order(True)
        pair_out = module(hidden, index, weights)
        pair_order(False)
        checks["layer_rel_diff_slot_vs_pair"] = ((slot_out.float() - pair_out.float()).norm()
                                                 / pair_out.float().norm()).item()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            module(hidden, index, weights)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = module(hidden, index, weights)
        graph.replay()
        torch.cuda.synchronize()
        checks["graph_equals_eager"] = bool(torch.equal(captured, slot_out))
    return checks


def main(out_path: str, deadline_s: float = 480.0) -> None:
    start = time.time()
    report = {**environment_metadata(), "transformers": transformers.__version__, "gluon": gemm_gluon.available(),
              "rows": []}
    modules = {"bf16": layer(None), "fp8": layer("fp8"), "int8": layer("int8")}
    for tokens in TOKENS:
        if time.time() - start > deadline_s:
            break
        hidden, index, weights = routing(tokens)
        row = {"tokens": tokens, "bf16_us": graph_us(lambda: modules["bf16"](hidden, index, weights))}
        for name in ("fp8", "int8"):
            module = modules[name]

            def call(module=module):
                return module(hidden, index, weights)

            timings = {}
            for label in ("pair", "slot", "pair_again", "slot_again"):
                pair_order(label.startswith("pair"))
                timings[label] = graph_us(call)
            pair_order(False)
            row[name] = dict(timings, speedup_vs_pair=round((timings["pair"] + timings["pair_again"])
                                                            / (timings["slot"] + timings["slot_again"]), 3),
                             slot_vs_bf16=round(2 * row["bf16_us"] / (timings["slot"] + timings["slot_again"]), 3),
                             pair_vs_bf16=round(2 * row["bf16_us"] / (timings["pair"] + timings["pair_again"]), 3))
            if tokens in (3072, 8192):
                row[name]["checks"] = kernel_checks(module, hidden, index, weights)
        record(report, row, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
