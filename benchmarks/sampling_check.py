"""Sampled generation on the GPU: graph replay against eager decoding, and what sampling costs.

    PYTHONPATH=. python benchmarks/sampling_check.py OUT.json

A random model of the bundled Gemma-3-270M's shape (18 layers, hidden 640, vocabulary 262,144; no
weights need to travel), bf16, FP8 and INT8, through ``optimize(exact=True)``:
- checks: the same generator seed gives the same tokens with the CUDA graph as without (CUDA and
  CPU generators, batch 1 and 4, top-p and top-k), and they differ from the greedy tokens; the
  filtered distribution on CUDA equals the CPU's; the inverse CDF on CUDA picks each token of a
  small vocabulary with its probability (an evenly spread grid of uniforms). (top_k=1 against greedy
  is a CPU test: on these flat bf16 logits the maximum is often tied, and top-k keeps ties, as
  transformers' warper does.)
- timing: decode ms/token (median of 3 runs, graph replay) of greedy, temperature-only, top-k 50
  and top-p 0.95 sampling at batch 1 and 8, 128 new tokens after a 32-token prompt.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import quantkit
from quantkit.bench.common import environment_metadata
from quantkit.generate import Sampling

RESULTS: dict = {"checks": [], "timing": []}


def record(name: str, ok: bool, **info) -> None:
    RESULTS["checks"].append({"check": name, "ok": bool(ok), **info})
    print(f"[{'ok' if ok else 'FAIL'}] {name} {info}", flush=True)


def gemma3_270m_shaped() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32768,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)])
    # Random weights give nearly flat logits (top-p 0.95 keeps ~220k tokens), so sampled tokens differ
    # from the greedy ones, which the checks require: a misaligned uniform would then show.
    return Gemma3ForCausalLM(config).to("cuda", torch.bfloat16).eval()


def distribution_checks() -> None:
    logits = torch.randn(6, 262144, generator=torch.Generator().manual_seed(1)) * 4
    for temperature, top_k, top_p in ((1.0, None, None), (0.8, 50, None), (0.7, None, 0.95), (1.2, 64, 0.9)):
        sampling = Sampling.of(temperature, top_k, top_p)
        cpu, gpu = sampling.probabilities(logits), sampling.probabilities(logits.cuda()).cpu()
        # fp32 sums over 262k tokens differ by ~1e-5 between the two devices, so a token whose top-p
        # mass lies that close to the cut may be kept on one and not the other (at most one per row);
        # the rest are compared renormalized over the tokens both keep.
        mismatched = (cpu > 0) != (gpu > 0)
        common = (cpu > 0) & (gpu > 0)
        cpu_c, gpu_c = cpu * common, gpu * common
        cpu_c, gpu_c = cpu_c / cpu_c.sum(-1, keepdim=True), gpu_c / gpu_c.sum(-1, keepdim=True)
        error = float((cpu_c - gpu_c).abs().max())
        record("probabilities_cuda_equal_cpu", int(mismatched.sum(dim=1).max()) <= 1 and error <= 2e-5,
               temperature=temperature, top_k=top_k, top_p=top_p, kept=int((cpu > 0).sum()),
               support_mismatches=int(mismatched.sum()), max_abs_error=error)
    small = torch.randn(2, 13, generator=torch.Generator().manual_seed(2)).cuda() * 2
    sampling = Sampling.of(1.0, 8, 0.9)
    n = 50000
    grid = (torch.arange(n, dtype=torch.float64, device="cuda") + 0.5) / n
    for row in range(2):
        probs = sampling.probabilities(small[row:row + 1])[0].double()
        counts = torch.bincount(sampling.choose(small[row:row + 1].expand(n, -1), grid), minlength=13).double() / n
        record("inverse_cdf_frequencies", float((counts - probs).abs().max()) <= 1 / n + 1e-9
               and bool((counts[probs == 0] == 0).all()), row=row, max_error=float((counts - probs).abs().max()))


def generation_checks(model, scheme: str) -> None:
    vocab = model.config.vocab_size
    for batch in (1, 4):
        ids = torch.randint(3, vocab, (batch, 32), generator=torch.Generator().manual_seed(batch)).cuda()
        greedy = quantkit.generate_tokens(model, ids, 24, eos_token_id=None)
        for device in ("cuda", "cpu"):
            for kwargs in (dict(temperature=0.8, top_p=0.95), dict(temperature=1.5, top_k=40)):
                runs = [quantkit.generate_tokens(model, ids, 24, eos_token_id=None, do_sample=True, cuda_graph=graph,
                                                 generator=torch.Generator(device).manual_seed(5), **kwargs)
                        for graph in (True, False)]
                differs = float((runs[0] != greedy)[:, 32:].float().mean())
                record("graph_equals_eager_sampled", torch.equal(runs[0], runs[1]) and differs > 0.5, scheme=scheme,
                       batch=batch, generator=device, tokens_differing_from_greedy=differs, **kwargs)


def timing(model, scheme: str) -> None:
    vocab = model.config.vocab_size
    modes = {"greedy": {}, "temperature 1.0": dict(do_sample=True),
             "top_k 50": dict(do_sample=True, top_k=50), "top_p 0.95": dict(do_sample=True, top_p=0.95)}
    for batch in (1, 8):
        ids = torch.randint(3, vocab, (batch, 32), generator=torch.Generator().manual_seed(9)).cuda()
        for mode, kwargs in modes.items():
            per_token = []
            for run in range(4):  # the first run compiles and captures: not counted
                stats: dict = {}
                generator = torch.Generator("cuda").manual_seed(run) if kwargs else None
                quantkit.generate_tokens(model, ids, 128, eos_token_id=None, stats=stats, generator=generator, **kwargs)
                if run:
                    per_token.append(1000 * stats["decode_s"] / stats["decode_steps"])
            row = {"scheme": scheme, "batch": batch, "mode": mode, "decode_ms_per_token": statistics.median(per_token),
                   "runs_ms": per_token}
            RESULTS["timing"].append(row)
            print(row, flush=True)


def main() -> None:
    out = sys.argv[1]
    RESULTS["meta"] = environment_metadata()
    distribution_checks()
    base = gemma3_270m_shaped()
    for scheme in ("fp8", "int8"):
        model = quantkit.optimize(quantkit.quantize(copy.deepcopy(base), quantkit.QuantConfig.preset(scheme),
                                                    progress=False), exact=True)
        generation_checks(model, scheme)
        timing(model, scheme)
        del model
    write_results(out)


def write_results(out: str) -> None:
    """RESULTS to ``out`` as JSON, with whether every check passed (also printed)."""
    RESULTS["all_ok"] = all(c["ok"] for c in RESULTS["checks"])
    with open(out, "w") as handle:
        json.dump(RESULTS, handle, indent=1)
    print("all checks passed" if RESULTS["all_ok"] else "SOME CHECKS FAILED", flush=True)


if __name__ == "__main__":
    main()
