"""GPU check of the fast path's one-launch RoPE (``quantkit/models/fast_rope.py``).

    PYTHONPATH=. python benchmarks/rope_check.py --out $OUT

1. Kernel vs transformers' ``apply_rotary_pos_emb`` on Llama-3-8B attention shapes in bf16 and
   fp16 (prefill 4 x 2048 and 1 x 2048, decode batch 8): whether the bits are equal, and the GPU
   time of each (CUDA-graph replay of 20 calls, median of 5).
2. Small random Llama and Gemma-3 models (bench.e2e's check configs), bf16, INT8 and FP8:
   ``optimize`` (exact False and True) with the one-launch RoPE against the same with ``rope=False``:
   whether logits and greedy tokens (``quantkit.generate``, CUDA-graph decode) are equal, and
   the largest logit difference. ("passed" = bit-equal, the goal of the kernel's rounding; the
   H100 run of 2026-11-23 did not pass: see NOTES-e2e.md.)
"""

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from quantkit.api import quantize  # noqa: E402
from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.e2e import _small_configs, build_model  # noqa: E402
from quantkit.config import QuantConfig  # noqa: E402
from quantkit.generate import generate  # noqa: E402
from quantkit.kernels import attention_ops  # noqa: E402
from quantkit.kernels.launch import median_replay_ms  # noqa: E402
from quantkit.models.fast_path import optimize  # noqa: E402

DEVICE = "cuda"
SHAPES = {"prefill 4x2048": (4, 2048), "prefill 1x2048": (1, 2048), "decode b8": (8, 1)}


def graph_us(fn, calls: int = 20, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_replay_ms(graph, reps) * 1e3 / calls


def kernel_rows() -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for label, (batch, seq) in SHAPES.items():
            gen = torch.Generator(device="cuda").manual_seed(seq)
            # HF's layout: projections viewed as (B, S, H, D), then transposed to (B, H, S, D).
            q = (3 * torch.randn(batch, seq, 32, 128, device="cuda", generator=gen)).to(dtype).transpose(1, 2)
            k = (3 * torch.randn(batch, seq, 8, 128, device="cuda", generator=gen)).to(dtype).transpose(1, 2)
            pos = torch.randint(0, 8192, (batch, seq), device="cuda", generator=gen).float()
            inv_freq = 1.0 / 500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128)
            emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            want = apply_rotary_pos_emb(q, k, cos, sin)
            got = attention_ops.apply_rope(q, k, cos, sin, backend="triton")
            row = {"dtype": str(dtype).removeprefix("torch."), "shape": label,
                   "q_equal": bool(torch.equal(got[0], want[0])), "k_equal": bool(torch.equal(got[1], want[1])),
                   "elements_differing": int((got[0] != want[0]).sum() + (got[1] != want[1]).sum()),
                   "elements": got[0].numel() + got[1].numel(),
                   "hf_us": graph_us(lambda: apply_rotary_pos_emb(q, k, cos, sin)),
                   "quantkit_us": graph_us(lambda: attention_ops.apply_rope(q, k, cos, sin, backend="triton"))}
            row["speedup"] = row["hf_us"] / row["quantkit_us"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def model_rows() -> list[dict]:
    rows = []
    for arch, config in _small_configs().items():
        torch.manual_seed(0)
        base = build_model(config, DEVICE, torch.bfloat16)
        ids = torch.randint(3, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        for scheme in ("int8", "fp8"):
            plain = quantize(copy.deepcopy(base), QuantConfig.preset(scheme), progress=False)
            for exact in (False, True):
                fused = optimize(copy.deepcopy(plain), exact=exact)
                separate = optimize(copy.deepcopy(plain), exact=exact, rope=False)
                # The two models share the modeling module, so each forward's own marks decide.
                want, got = separate(ids).logits, fused(ids).logits
                tokens_want = generate(separate, ids, 16, eos_token_id=None)
                tokens_got = generate(fused, ids, 16, eos_token_id=None)
                row = {"arch": arch, "scheme": scheme, "exact": exact,
                       "rope_layers": len(fused.quantkit_fast_path.fused_rope),
                       "logits_equal": bool(torch.equal(got, want)),
                       "logits_max_abs_diff": (got.float() - want.float()).abs().max().item(),
                       "tokens_equal": bool(torch.equal(tokens_got, tokens_want))}
                row["passed"] = row["rope_layers"] > 0 and row["logits_equal"] and row["tokens_equal"]
                if exact:
                    # Exact mode's promise: the fast path's greedy tokens equal the plain model's.
                    row["tokens_equal_plain"] = bool(torch.equal(tokens_got, generate(plain, ids, 16, eos_token_id=None)))
                    row["passed"] = row["passed"] and row["tokens_equal_plain"]
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU: model rows only (the kernel is CUDA-only here)")
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    kernels, models = ([] if args.smoke else kernel_rows()), model_rows()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "rope_check.json").write_text(
        json.dumps({"meta": environment_metadata(), "kernel": kernels, "models": models}, indent=1))
    equal = sum(r["q_equal"] and r["k_equal"] for r in kernels)
    print(f"rope check: kernel bit-equal {equal}/{len(kernels)}, models {sum(r['passed'] for r in models)}/{len(models)}",
          flush=True)


if __name__ == "__main__":
    main()
