"""Grouped MoE GEMM on the GPU: tile sweep, and one MoE layer against transformers' bf16 experts.

Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, top-8), random weights and
routing. For each token count T: the grouped kernel's gate/up (gated) and down GEMMs over a tile
sweep (FP8; INT8 with the default and the FP8 sweep's best), and the whole experts layer, routing
and quantization included: transformers' bf16 module (its default ``grouped_mm`` implementation)
against quantkit's stacked FP8 / INT8 experts, eager (do_bench) and as a CUDA graph
(do_bench_cudagraph), same process. Writes JSON to the path given; ``--sweep`` adds the tile sweep.
``--skew S`` routes with a fixed per-expert bias of S standard deviations of the router logits (some
experts popular, others nearly idle; each row records the load's max / mean and its idle experts),
and times the GEMMs' 64- and 128-row defaults on that routing; ``--tokens 2048,8192`` picks the
token counts.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch
import transformers
import triton.testing

import quantkit
from quantkit.bench.common import environment_metadata
from quantkit.kernels import moe, ops

TOKENS = (1, 8, 64, 512, 2048, 4096, 8192)
SWEEP = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
         for bm, bn, bk, w, s in itertools.product((16, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4))
         if not (bm == 64 and bn == 32)] + [dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
                                            dict(block_m=64, block_n=256, block_k=64, num_warps=8, num_stages=3)]


def layer(scheme: str | None):
    """One Qwen3-MoE decoder layer's experts module: bf16 (transformers') or quantized and stacked."""
    config = transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=2048, intermediate_size=6144,
                                         moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                         num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4,
                                         head_dim=128)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if scheme is not None:
        quantkit.optimize(quantkit.quantize(model, scheme, progress=False), attention=False, rope=False)
    return model.model.layers[0].mlp.experts


def routing(tokens: int, experts: int = 128, k: int = 8, skew: float = 0.0):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, 2048, device="cuda", generator=gen, dtype=torch.bfloat16)
    bias = skew * torch.randn(experts, device="cuda", generator=torch.Generator(device="cuda").manual_seed(99))
    probs = (torch.randn(tokens, experts, device="cuda", generator=gen) + bias).softmax(-1)
    weights, index = probs.topk(k, dim=-1)
    return hidden, index, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


def times(fn) -> dict:
    row = {"eager_us": 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50)}
    try:
        row["graph_us"] = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50)
    except Exception as exc:  # not capturable: say why
        row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        torch.cuda.synchronize()
    return row


def main(out_path: str, sweep: bool, deadline_s: float = 500.0, skew: float = 0.0, token_counts=TOKENS) -> None:
    start = time.time()
    report = {**environment_metadata(), "transformers": transformers.__version__, "skew": skew, "tokens": {}}
    modules = {"bf16": layer(None), "fp8": layer("fp8"), "int8": layer("int8")}
    for tokens in token_counts:
        hidden, index, weights = routing(tokens, skew=skew)
        load = torch.bincount(index.reshape(-1), minlength=128).float()
        row = {name: times(lambda m=m: m(hidden, index, weights)) for name, m in modules.items()}
        row["load"] = dict(max_over_mean=float(load.max() / load.mean()), idle_experts=int((load == 0).sum()),
                           experts_under_64=int((load < 64).sum()))
        with torch.no_grad():
            base = modules["bf16"](hidden, index, weights).float()
            for name in ("fp8", "int8"):
                out = modules[name](hidden, index, weights).float()
                row[name]["rel_err_vs_bf16"] = ((out - base).norm() / base.norm()).item()
                for mode in ("eager", "graph"):
                    if f"{mode}_us" in row["bf16"] and f"{mode}_us" in row[name]:
                        row[name][f"{mode}_speedup_vs_bf16"] = row["bf16"][f"{mode}_us"] / row[name][f"{mode}_us"]
        # The two GEMMs alone over the tile sweep.
        experts = index.reshape(-1)
        for name in ("fp8", "int8"):
            grouped = modules[name].__dict__["_grouped"]
            q, scale = ops.quantize_per_token(hidden, grouped.quant_dtype, backend="triton")
            h = moe.grouped_scaled_mm(q, grouped.w13, scale, grouped.s13, experts, 8, "silu", True)
            hq, hs = ops.quantize_per_token(h, grouped.quant_dtype, backend="triton")
            # Plans made beforehand, as a layer makes one for both GEMMs: these time the GEMMs themselves.
            plans = {bm: moe.route_plan(experts, 128, bm) for bm in (16, 32, 64, 128)}

            def plan(c):
                return plans[(c or default)["block_m"]]

            gemms = {"gate_up": lambda c: moe.grouped_scaled_mm(q, grouped.w13, scale, grouped.s13, experts, 8,
                                                               "silu", True, plan=plan(c), config=c),
                     "down": lambda c: moe.grouped_scaled_mm(hq, grouped.w2, hs, grouped.s2, experts, 1,
                                                            plan=plan(c), config=c)}
            # The configs the calls below run with config=None (the block height is the same for both).
            defaults = {"gate_up": moe.default_config(experts.numel(), 128, 2048, gated=True),
                        "down": moe.default_config(experts.numel(), 128, 768)}
            default = defaults["gate_up"]
            block_m = default["block_m"]
            row[name]["route_plan_us"] = 1e3 * triton.testing.do_bench_cudagraph(
                lambda: moe.route_plan(experts, 128, block_m), rep=30)
            for gemm, fn in gemms.items():
                configs = [None]
                if skew:  # the block heights the average load chooses between, on a skewed load
                    K = 2048 if gemm == "gate_up" else 768
                    configs = [None, moe.default_config(64 * 128, 128, K, gemm == "gate_up"),
                               moe.default_config(512 * 128, 128, K, gemm == "gate_up")]
                if sweep:
                    configs = SWEEP if name == "fp8" else [None, row["fp8"].get(f"{gemm}_best_config")]
                results = []
                for config in configs:
                    if time.time() - start > deadline_s:
                        break
                    try:
                        results.append((1e3 * triton.testing.do_bench_cudagraph(lambda: fn(config), rep=30),
                                        config or defaults[gemm]))
                    except Exception as exc:
                        results.append((float("inf"), {**(config or {}), "error": str(exc).splitlines()[0][:80]}))
                finite = [r for r in results if r[0] < float("inf")]
                if finite:
                    best = min(finite, key=lambda r: r[0])
                    row[name][f"{gemm}_best_us"], row[name][f"{gemm}_best_config"] = best
                    row[name][f"{gemm}_default_us"] = 1e3 * triton.testing.do_bench_cudagraph(lambda: fn(None), rep=30)
                row[name][f"{gemm}_sweep"] = [[round(t, 2), c] for t, c in results]
        report["tokens"][str(tokens)] = row
        print(tokens, json.dumps({n: {k: v for k, v in r.items() if not k.endswith("sweep")} for n, r in row.items()
                                  if n != "load"}), row["load"],
              flush=True)
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    args = sys.argv[2:]

    def option(name, default):
        return args[args.index(name) + 1] if name in args else default

    main(sys.argv[1], sweep="--sweep" in args, skew=float(option("--skew", 0.0)),
         token_counts=tuple(int(t) for t in option("--tokens", ",".join(map(str, TOKENS))).split(",")))
