"""GPU check of head sizes the attention kernels do not take natively (run zero-padded).

A random Llama (4 layers, 8 query heads over 2 KV heads) on CUDA at head_dim 80 and 96 (run at
128, padded) and at 128 itself, the control. Two forms of each:
- fp32, unquantized: the logits with quantkit's Triton attention against the same model on sdpa
  (relative max error), and ``quantkit.generate`` (static padded cache, CUDA-graph decode) against
  ``model.generate`` on sdpa: how many greedy tokens each row keeps before the first difference;
- bf16, fp8-quantized and optimized (what a user runs): the same two numbers, and decode time.
A padded size is right if its numbers look like the control's.

    python benchmarks/head_dim_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import quantkit
from quantkit.bench.common import environment_metadata
from quantkit.models.fast_attention import padded_head_dim, register_quantkit_attention


def build(head_dim: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # wide logit margins: greedy picks are not near-ties
    model = model.to(device, dtype).eval()
    model.set_attn_implementation("sdpa")
    return model if dtype == torch.float32 else quantkit.quantize(model, "fp8", progress=False)


@torch.no_grad()
def check(head_dim: int, device: str, dtype: torch.dtype) -> dict:
    model = build(head_dim, device, dtype)
    ids = torch.randint(3, 4096, (4, 300), generator=torch.Generator().manual_seed(1)).to(device)
    want_logits = model(ids).logits.float()
    want_tokens = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
    if dtype == torch.float32:
        model.set_attn_implementation(register_quantkit_attention("auto", device, model=model))
    else:
        quantkit.optimize(model)  # exact fast path; attention through quantkit's kernels
    got_logits = model(ids).logits.float()
    stats: dict = {}
    quantkit.generate_tokens(model, ids, 64, eos_token_id=None)  # warm-up: compiles, captures
    got_tokens = quantkit.generate_tokens(model, ids, 64, eos_token_id=None, stats=stats)
    new_want, new_got = want_tokens[:, 300:], got_tokens[:, 300:]
    # Tokens agree up to the first divergence of each row (after it, the rows continue different texts).
    first_diff = [(int((a != b).nonzero()[0]) if (a != b).any() else a.numel()) for a, b in zip(new_want, new_got)]
    return {
        "dtype": str(dtype),
        "head_dim": head_dim,
        "kernel_head_dim": padded_head_dim(head_dim),
        "logits_rel_max_err": float((got_logits - want_logits).abs().max() / want_logits.abs().max()),
        "prefill_argmax_agree": float((got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean()),
        "tokens_before_first_divergence": first_diff,
        "new_tokens": 64,
        "decode_ms_per_token": 1000 * stats["decode_s"] / stats["decode_steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu for a slow dry run")
    args = parser.parse_args()
    rows, kernels = [], []
    for head_dim in (64, 128, 256):
        for dtype in (torch.float32, torch.bfloat16):
            row = kernel_error(head_dim, dtype, args.device)
            print(json.dumps(row), flush=True)
            kernels.append(row)
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (128, 80, 96):
            try:
                row = check(head_dim, args.device, dtype)
            except Exception as exc:  # record it and go on to the other sizes
                row = {"dtype": str(dtype), "head_dim": head_dim, "error": f"{type(exc).__name__}: {exc}"[:500]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_dim_check.json").write_text(
        json.dumps({"meta": environment_metadata(), "kernels": kernels, "models": rows}, indent=2))


@torch.no_grad()
def kernel_error(head_dim: int, dtype: torch.dtype, device: str) -> dict:
    """Triton flash prefill and decode at a native size against float64 sdpa (relative max error)."""
    from quantkit.kernels import attention_ops

    torch.manual_seed(2)
    q, k, v = (torch.randn(2, heads, 333, head_dim, device=device) for heads in (8, 2, 2))
    scale = head_dim ** -0.5
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True, scale=scale, enable_gqa=True)
    backend = "triton" if device == "cuda" else "torch"
    got = attention_ops.flash_attention(q.to(dtype), k.to(dtype), v.to(dtype), scale, backend=backend).double()
    seqlens = torch.full((2,), 333, dtype=torch.int32, device=device)
    got_decode = attention_ops.decode_attention(q[:, :, -1].to(dtype), k.to(dtype), v.to(dtype), seqlens, scale,
                                                max_seqlen=333, backend=backend).double()
    return {"dtype": str(dtype), "head_dim": head_dim,
            "prefill_rel_max_err": float((got - want).abs().max() / want.abs().max()),
            "decode_rel_max_err": float((got_decode - want[:, :, -1]).abs().max() / want.abs().max())}


if __name__ == "__main__":
    main()
