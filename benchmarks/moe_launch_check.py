"""Cached launches of the grouped MoE path on the GPU: the same outputs as triton's own launcher,
and the host time they save in eager calls.

Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, top-8), random quantized weights.
For token counts that hit and miss the cache in turn (the pair count is not specialized), the
layer's grouped path (routing plan, per-token quantization, gated GEMM, quantization, down GEMM
with the routing weights, the k-sum) runs with ``launch.ENABLED`` on and off; the outputs must be
bit-identical. Then the eager time per call of that path at a few tokens, both ways, alternating,
in this process. Writes JSON to the path given.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from quantkit.bench.common import environment_metadata
from quantkit.kernels import launch, moe, ops

E, H, I, TOP_K = 128, 2048, 768, 8


def weights(dtype, rows, K, gen):
    if dtype == torch.int8:
        w = torch.randint(-127, 128, (E, rows, K), device="cuda", generator=gen, dtype=torch.int8)
    else:
        w = (torch.randn(E, rows, K, device="cuda", generator=gen) * 100).clamp(-448, 448).to(dtype)
    return w, torch.rand(E, rows, device="cuda", generator=gen) * 2e-4 + 1e-4


def layer(x, index, weights_, w13, s13, w2, s2, dtype):
    experts = index.reshape(-1).contiguous()
    plan = ops.moe_route_plan(experts, E, backend="triton")
    q, scale = ops.quantize_per_token(x, dtype, backend="triton")
    h = ops.grouped_scaled_mm(q, w13, scale, s13, experts, TOP_K, "silu", True, torch.bfloat16, plan=plan,
                              backend="triton")
    q, scale = ops.quantize_per_token(h, dtype, backend="triton")
    out = ops.grouped_scaled_mm(q, w2, scale, s2, experts, 1, "none", False, torch.bfloat16,
                                weights_.reshape(-1).float().contiguous(), plan=plan, backend="triton")
    return out.view(x.shape[0], TOP_K, -1).sum(dim=1)


def inputs(tokens, gen, index_dtype=torch.int64):
    x = torch.randn(tokens, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    probs = torch.randn(tokens, E, device="cuda", generator=gen).softmax(-1)
    w, index = probs.topk(TOP_K, dim=-1)
    return x, index.to(index_dtype), (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def host_us(fn, calls: int = 200) -> float:
    """Wall time per call of ``calls`` back-to-back eager calls (the GPU work is small: host-bound)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / calls


def main(out_path: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {**environment_metadata(), "checks": [], "eager": []}
    for dtype in (torch.float8_e4m3fn, torch.int8):
        name = "fp8" if dtype != torch.int8 else "int8"
        w13, s13 = weights(dtype, 2 * I, H, gen)
        w2, s2 = weights(dtype, H, I, gen)
        # Alternate sizes and index dtypes: each cached key is hit again with other pair counts.
        for tokens, index_dtype in ((1, torch.int64), (13, torch.int64), (1, torch.int32), (200, torch.int64),
                                    (8, torch.int32), (13, torch.int64), (513, torch.int64), (3, torch.int64)):
            x, index, w = inputs(tokens, gen, index_dtype)
            results = {}
            for enabled in (True, False, True):
                launch.ENABLED = enabled
                results.setdefault(enabled, []).append(layer(x, index, w, w13, s13, w2, s2, dtype))
            launch.ENABLED = True
            same = all(torch.equal(results[True][0], r) for r in results[True][1:] + results[False])
            report["checks"].append(dict(dtype=name, tokens=tokens, index_dtype=str(index_dtype), bit_identical=same))
            print(name, tokens, index_dtype, "bit-identical" if same else "DIFFERENT", flush=True)
        for tokens in (1, 8, 64):
            x, index, w = inputs(tokens, gen)
            row = dict(dtype=name, tokens=tokens, cached_us=[], triton_us=[])
            for _ in range(3):  # alternating rounds
                for enabled, label in ((True, "cached_us"), (False, "triton_us")):
                    launch.ENABLED = enabled
                    layer(x, index, w, w13, s13, w2, s2, dtype)
                    row[label].append(host_us(lambda: layer(x, index, w, w13, s13, w2, s2, dtype)))
            launch.ENABLED = True
            row["cached_median_us"] = sorted(row["cached_us"])[1]
            row["triton_median_us"] = sorted(row["triton_us"])[1]
            report["eager"].append(row)
            print(name, tokens, f"eager per call: cached {row['cached_median_us']:.1f} us, "
                                f"triton's launcher {row['triton_median_us']:.1f} us", flush=True)
    report["all_bit_identical"] = all(c["bit_identical"] for c in report["checks"])
    with open(out_path, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
