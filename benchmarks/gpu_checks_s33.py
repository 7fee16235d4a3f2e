"""GPU checks of session 32's code that had only run on the CPU, in one device call.

    PYTHONPATH=. python benchmarks/gpu_checks_s33.py OUT.json

- MoE grouped GEMMs with float32 outputs: every default kernel (64- and 128-row blocks, gated and
  plain, FP8 and INT8; Qwen3-30B-A3B expert shapes, random weights and routing) against the torch
  twin in float32. INT8 accumulators are exact, so its outputs must equal the twin's; FP8 within
  fp32 summation order.
- Repetition penalty in ``generate`` with the CUDA-graph decode: a random model of the bundled
  Gemma-3-270M's shape, bf16 (transformers' model) and FP8 / INT8 through ``optimize(exact=True)``; greedy and sampled
  (seeded) tokens with the penalty, graph against eager, must be equal and differ from the tokens
  without it.
"""

from __future__ import annotations

import copy
import sys

import torch

import quantkit
from quantkit.bench.common import environment_metadata
from quantkit.kernels import moe, ops, reference

sys.path.insert(0, "benchmarks")
import moe_tma_sweep  # noqa: E402  (shapes, weights, routing)
from sampling_check import RESULTS, gemma3_270m_shaped, record, write_results  # noqa: E402


def moe_float32_outputs() -> None:
    E, H, I, k = moe_tma_sweep.E, moe_tma_sweep.H, moe_tma_sweep.I, moe_tma_sweep.TOP_K
    gen = torch.Generator(device="cuda").manual_seed(3)
    for dtype in (torch.float8_e4m3fn, torch.int8):
        w13, s13 = moe_tma_sweep.weights(dtype, 2 * I, H, gen)
        w2, s2 = moe_tma_sweep.weights(dtype, H, I, gen)
        for tokens in (1024, 2048, 8192):  # 64-, 64- and 128-row blocks
            hidden = torch.randn(tokens, H, device="cuda", generator=gen, dtype=torch.bfloat16)
            probs = torch.randn(tokens, E, device="cuda", generator=gen).softmax(-1)
            top = probs.topk(k, dim=-1)
            experts = top.indices.reshape(-1).contiguous()
            weights = top.values.reshape(-1).float().contiguous()
            q, scale = ops.quantize_per_token(hidden, dtype, backend="triton")
            h = moe.grouped_scaled_mm(q, w13, scale, s13, experts, k, "silu", True)
            hq, hs = ops.quantize_per_token(h, dtype, backend="triton")
            calls = {
                "gate_up": ((q, w13, scale, s13, experts, k, "silu", True), {}),
                "down": ((hq, w2, hs, s2, experts, 1), {"row_scale": weights}),
            }
            for gemm, (args, kwargs) in calls.items():
                gated = gemm == "gate_up"
                config = moe.default_config(experts.numel(), E, args[1].shape[2], gated, torch.float32)
                out = moe.grouped_scaled_mm(*args, out_dtype=torch.float32, **kwargs)
                ref = reference.grouped_scaled_mm(*args, out_dtype=torch.float32, **kwargs)
                half = moe.grouped_scaled_mm(*args, **kwargs)  # the bf16 default, same kernel family
                err = float(((out - ref).norm() / ref.norm()))
                # One rounding of out to bf16 is at most half a bf16 ulp from half's, if both are right.
                ulps = float(((out.to(torch.bfloat16).float() - half.float()).abs()
                              / half.float().abs().clamp_min(1e-30)).max() * 2 ** 8)
                if dtype == torch.int8 and not gated:
                    ok = torch.equal(out, ref)  # exact accumulators, the twin's epilogue order
                elif dtype == torch.int8:  # the kernel's sigmoid against torch's: ulps of fp32
                    ok = err < 1e-6
                else:  # Hopper's FP8 MMAs accumulate with fewer mantissa bits than fp32 (~1e-3 at K 2048)
                    ok = err < 3e-3
                # FP8 128-row blocks: 128-wide tiles in fp32 against 256-wide in bf16 (the MMA's
                # accumulation may differ), so there only the norm of the difference is held.
                near = ulps <= 1.0 if dtype == torch.int8 else float(
                    (out.to(torch.bfloat16).float() - half.float()).norm() / half.float().norm()) < 3e-3
                record("moe_float32_output", ok and near and bool(torch.isfinite(out).all()),
                       dtype=str(dtype), tokens=tokens, gemm=gemm, config=config, rel_error_vs_twin=err,
                       bf16_ulps_vs_bf16_output=ulps)


def penalty_graph() -> None:
    base = gemma3_270m_shaped()
    for scheme in ("bf16", "fp8", "int8"):
        model = copy.deepcopy(base)
        if scheme != "bf16":  # bf16: the transformers model as it is
            model = quantkit.optimize(quantkit.quantize(model, quantkit.QuantConfig.preset(scheme), progress=False),
                                      exact=True)
        for batch in (1, 4):
            ids = torch.randint(3, 262144, (batch, 32), generator=torch.Generator().manual_seed(batch)).cuda()
            # Repeated prompt tokens make the penalty matter from the first step.
            ids[:, 16:] = ids[:, :16]
            plain = quantkit.generate_tokens(model, ids, 40, eos_token_id=None)
            for kwargs in ({}, dict(do_sample=True, temperature=0.7, top_k=40)):
                runs = []
                for graph in (True, False):
                    generator = torch.Generator("cuda").manual_seed(7) if kwargs else None
                    runs.append(quantkit.generate_tokens(model, ids, 40, eos_token_id=None, cuda_graph=graph,
                                                         repetition_penalty=1.3, generator=generator, **kwargs))
                differs = float((runs[0] != plain)[:, 32:].float().mean())
                record("penalty_graph_equals_eager", torch.equal(runs[0], runs[1]) and differs > 0, scheme=scheme,
                       batch=batch, tokens_differing_from_unpenalized_greedy=differs, **kwargs)
        del model


def main() -> None:
    out = sys.argv[1]
    RESULTS["meta"] = environment_metadata()
    moe_float32_outputs()
    penalty_graph()
    write_results(out)


if __name__ == "__main__":
    main()
