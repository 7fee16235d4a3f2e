"""GPU check of ``quantkit.graphed`` through perplexity: eager windows vs CUDA-graph replays.

A Gemma-3-270M-shaped model (the bundled model's config; random weights, so no GGUF is needed:
speed and bit-equality do not depend on the values), bf16 on CUDA, in three forms: HF bf16,
quantkit fp8 and int8 + ``optimize(exact=False)``. For each, ``evaluate_perplexity`` over the same
random token stream with ``cuda_graph`` off and on, timed (wall, device-synchronized), and the two
negative log-likelihoods compared: equal logits give equal sums.

    python benchmarks/graphed_check.py --out DIR [--tokens 32768] [--window 1024]
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
import triton
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import quantkit
from quantkit.config import QuantConfig


def gemma3_270m_config() -> Gemma3TextConfig:
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    return Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256, layer_types=layer_types,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)


def build(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(gemma3_270m_config()).to("cuda", torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    if variant == "hf-bf16":
        return model
    model = quantkit.quantize(model, QuantConfig.preset(variant), progress=False)
    return quantkit.optimize(model, exact=False)


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--window", type=int, default=1024)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens = torch.randint(3, 262144, (args.tokens,), generator=torch.Generator().manual_seed(1))
    rows = []
    for variant in ("hf-bf16", "fp8", "int8"):
        model = build(variant)
        run = lambda graph: quantkit.evaluate_perplexity(model, tokens[:2 * args.window], window=args.window,
                                                         bos_token_id=2, progress=False, cuda_graph=graph)
        run(False), run(True)  # warm-up: compiles, autotuning, cuBLAS handles
        row = {"variant": variant}
        for label, graph in (("eager", False), ("graph", True), ("eager_again", False), ("graph_again", True)):
            result, seconds = timed(lambda: quantkit.evaluate_perplexity(
                model, tokens, window=args.window, bos_token_id=2, progress=False, cuda_graph=graph))
            row[f"{label}_s"] = seconds
            row[f"{label}_nll"] = result.nll
        windows = result.tokens / (args.window - 1)
        row["windows"] = windows
        row["nll_equal"] = row["eager_nll"] == row["graph_nll"] == row["eager_again_nll"] == row["graph_again_nll"]
        row["speedup"] = min(row["eager_s"], row["eager_again_s"]) / min(row["graph_s"], row["graph_again_s"])
        print(json.dumps(row), flush=True)
        rows.append(row)
        del model
        torch.cuda.empty_cache()
    environment = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "transformers": transformers.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   "model": "Gemma-3-270M config, random weights, bf16", "tokens": args.tokens, "window": args.window}
    (out / "graphed_check.json").write_text(json.dumps({"environment": environment, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
