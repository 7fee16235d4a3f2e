"""GPU check of quantized mixture-of-experts models (run through the device tool).

A Qwen3-MoE-shaped model with random weights (hidden 2048, 64 experts of 768, top-8, 4 layers,
vocab 32000; 1.3B parameters, 1.2B of them experts) in bf16 on CUDA. For fp8 and int8 (dynamic):
quantize on the Triton backend and on the torch reference, compare the logits (and with bf16),
run twice and save and reload (the logits must be bit-identical), then time a 1 x 2048 prefill
and greedy decoding, plain (experts one by one, eager) and after optimize() (grouped experts,
eager and as a CUDA graph), against the bf16 model as transformers runs it (its default experts
implementation, and its eager loop), all in this process. Writes JSON to the path given.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile

import torch
import transformers
import triton.testing

import quantkit
from quantkit.bench.common import environment_metadata
from quantkit.kernels.reference import sqnr_db
from quantkit.models.experts import expert_modules


def build(seed: int = 0) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=64,
        num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    # Built on the CPU and moved, as a loaded model is: RoPE's inv_freq computed on the GPU
    # differs in the last bit from the CPU's, which quantkit.load computes (moe_gpu_s31c).
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.cuda().eval()


def timed_ms(fn) -> float:
    """Median ms of ``fn`` (eager, host time included) over ~200 ms after warm-up."""
    return triton.testing.do_bench(fn, warmup=50, rep=200)


def profile(fn, steps: int = 3) -> list[str]:
    """The GPU kernels that take the most time over ``steps`` calls (torch.profiler), as lines."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    return table.splitlines()


def decode_ms_per_token(model, prompt, new_tokens=64, cuda_graph=False) -> float:
    stats = {}
    quantkit.generate_tokens(model, prompt, new_tokens, cuda_graph=cuda_graph, stats=stats)
    return 1e3 * stats["decode_s"] / stats["decode_steps"]


def main(out_path: str) -> None:
    report = {**environment_metadata(), "transformers": transformers.__version__, "schemes": {}}
    model = build()
    report["experts_implementation"] = model.config._experts_implementation
    report["parameters"] = sum(p.numel() for p in model.parameters())
    ids = torch.randint(3, 32000, (1, 2048), generator=torch.Generator().manual_seed(1)).cuda()
    prompt = ids[:, :128]
    with torch.no_grad():
        base = model(input_ids=ids).logits.float()
        report["bf16"] = {"prefill_ms_1x2048": timed_ms(lambda: model(input_ids=ids)),
                          "decode_ms_per_token": decode_ms_per_token(model, prompt),
                          "graph_decode_ms_per_token": decode_ms_per_token(model, prompt, cuda_graph=True)}
        eager = copy.deepcopy(model)
        eager.config._experts_implementation = "eager"
        report["bf16_eager_experts"] = {"prefill_ms_1x2048": timed_ms(lambda: eager(input_ids=ids)),
                                        "decode_ms_per_token": decode_ms_per_token(eager, prompt)}
        del eager
    print(json.dumps(report, indent=1), flush=True)
    for scheme in ("fp8", "int8"):
        config = quantkit.QuantConfig.preset(scheme)
        qmodel = quantkit.quantize(copy.deepcopy(model), config.replace(backend="triton"), progress=False)
        reference = quantkit.quantize(copy.deepcopy(model), config.replace(backend="torch"), progress=False)
        row = {"experts_modules": len(expert_modules(qmodel)), "report": str(qmodel.quantkit_report)}
        with torch.no_grad():
            logits = qmodel(input_ids=ids).logits.float()
            row["deterministic"] = bool(torch.equal(qmodel(input_ids=ids).logits.float(), logits))
            ref = reference(input_ids=ids).logits.float()
        del reference
        row["triton_vs_torch_rel"] = ((logits - ref).norm() / ref.norm()).item()
        row["vs_bf16_sqnr_db"] = sqnr_db(base, logits)
        row["nan"] = bool(torch.isnan(logits).any())
        with tempfile.TemporaryDirectory() as tmp:
            quantkit.save(qmodel, f"{tmp}/ckpt")
            loaded = quantkit.load(f"{tmp}/ckpt", device="cuda", progress=False)
            with torch.no_grad():
                row["reload_bit_identical"] = bool(torch.equal(loaded(input_ids=ids).logits.float(), logits))
                ours = dict(qmodel.named_buffers()) | dict(qmodel.named_parameters())
                theirs = dict(loaded.named_buffers()) | dict(loaded.named_parameters())
                row["reload_differs"] = sorted(n for n in ours if n not in theirs or ours[n].dtype != theirs[n].dtype
                                               or not torch.equal(ours[n], theirs[n]))[:8]
            del loaded
        with torch.no_grad():
            row["prefill_ms_1x2048"] = timed_ms(lambda: qmodel(input_ids=ids))
            row["decode_ms_per_token"] = decode_ms_per_token(qmodel, prompt)
            tokens = quantkit.generate_tokens(qmodel, prompt, 16, cuda_graph=False)
            quantkit.optimize(qmodel)
            row["optimized"] = str(qmodel.quantkit_fast_path)
            fused = qmodel(input_ids=ids).logits.float()
            row["optimized_vs_plain_rel"] = ((fused - logits).norm() / logits.norm()).item()
            row["optimized_prefill_ms_1x2048"] = timed_ms(lambda: qmodel(input_ids=ids))
            row["optimized_prefill_profile"] = profile(lambda: qmodel(input_ids=ids))
            if scheme == "fp8":
                report["bf16"]["prefill_profile"] = profile(lambda: model(input_ids=ids))
            row["optimized_decode_ms_per_token"] = decode_ms_per_token(qmodel, prompt)
            row["optimized_graph_decode_ms_per_token"] = decode_ms_per_token(qmodel, prompt, cuda_graph=True)
            eager_tokens = quantkit.generate_tokens(qmodel, prompt, 16, cuda_graph=False)
            row["optimized_graph_same_tokens_as_eager"] = bool(torch.equal(
                quantkit.generate_tokens(qmodel, prompt, 16, cuda_graph=True), eager_tokens))
            row["optimized_same_tokens_as_plain"] = bool(torch.equal(eager_tokens, tokens))
        for key in ("prefill_ms_1x2048", "decode_ms_per_token"):
            row[f"{key}_ratio_bf16_over_ours"] = report["bf16"][key] / row[key]
            row[f"optimized_{key}_ratio_bf16_over_ours"] = report["bf16"][key] / row[f"optimized_{key}"]
        row["optimized_graph_decode_ratio_bf16_graph_over_ours"] = (report["bf16"]["graph_decode_ms_per_token"]
                                                                    / row["optimized_graph_decode_ms_per_token"])
        report["schemes"][scheme] = row
        print(json.dumps(row, indent=1), flush=True)
        del qmodel
        torch.cuda.empty_cache()
    with open(out_path, "w") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
