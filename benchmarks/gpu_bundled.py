"""GPU checks on the bundled Gemma-3-270M that CI cannot run (through the device tool).

1. Greedy generation (issue 4): the exact fast path (``quantkit.optimize``: fused MLPs, swapped
   norms, quantkit attention, static cache, CUDA-graph decode) against the plain QuantLinear model
   decoded by the same ``quantkit.generate`` (and, for reference, HF ``model.generate``), bf16,
   Triton backend, fp8 and int8, several prompts.
2. Streaming calibration (issue 5): the model in host memory, SmoothQuant + GPTQ calibrated on
   the GPU one decoder block at a time; peak GPU memory against the model's size and the stated
   bound, and the quantized weights against the same recipe run with the model resident on the GPU.

    python benchmarks/gpu_bundled.py OUT.json [--skip-greedy] [--skip-streaming]
"""

from __future__ import annotations

import copy
import json
import sys
import time

import torch
import transformers

import quantkit
from quantkit.bench.common import environment_metadata
from quantkit.calibration.offload import decoder_blocks
from quantkit.nn import QuantLinear

PROMPTS = [
    "The river city was built",
    "In 1854, the first railway line",
    "The theory of evolution by natural selection",
    "Paris is the capital of",
]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def greedy_checks(model, tokenizer, new_tokens: int) -> dict:
    rows = {}
    for scheme in ("int8", "fp8"):
        plain = quantkit.quantize(copy.deepcopy(model), quantkit.QuantConfig.preset(scheme), progress=False)
        fast = quantkit.optimize(copy.deepcopy(plain), exact=True)
        rows[f"{scheme}/fast_path"] = str(fast.quantkit_fast_path)
        print(scheme, rows[f"{scheme}/fast_path"], flush=True)
        for i, prompt in enumerate(PROMPTS):
            ids = tokenizer(prompt, return_tensors="pt")["input_ids"].cuda()
            want = quantkit.generate_tokens(plain, ids, new_tokens)
            got = quantkit.generate_tokens(fast, ids, new_tokens)
            hf = plain.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            same = (got == want)[0, ids.shape[1]:]
            rows[f"{scheme}/{i}"] = {
                "prompt": prompt,
                "fast_equals_plain": bool(torch.equal(got, want)),
                "first_difference": None if bool(same.all()) else int((~same).nonzero()[0]),
                "plain_equals_hf_generate": bool(torch.equal(want, hf[:, : want.shape[1]])),
                "text": tokenizer.decode(got[0, ids.shape[1]:]),
            }
            print(scheme, i, rows[f"{scheme}/{i}"], flush=True)
        del plain, fast
    return rows


def streaming_check(tokenizer, blocks: torch.Tensor) -> dict:
    config = quantkit.QuantConfig.preset("int8", smoothquant_alpha=0.5, gptq=True)
    host, _ = quantkit.load_model(quantkit.BUNDLED_MODEL, device="cpu", dtype=torch.bfloat16)
    stack = decoder_blocks(host)
    inside = {id(p) for p in stack.parameters()}
    outside = [p for p in host.parameters() if id(p) not in inside]
    largest_block = max(nbytes(b.parameters()) for b in stack)
    model_bytes = nbytes(host.parameters())
    # Upper bound of one block's GPTQ Hessians (layers reading the same input share one); read
    # before quantizing, which replaces the Linears.
    hessians = max(sum(4 * m.in_features ** 2 for m in b.modules() if isinstance(m, torch.nn.Linear)) for b in stack)
    resident = copy.deepcopy(host)  # moved to the GPU only after the streamed run is measured

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    quantkit.quantize(host, config, blocks, progress=False, offload_device="cuda")
    streamed_s = time.perf_counter() - start
    streamed_peak = torch.cuda.max_memory_allocated() - before
    resident = resident.cuda()
    assert all(p.device.type == "cpu" for p in host.parameters()), "the streamed model must end in host memory"

    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    quantkit.quantize(resident, config, blocks, progress=False)
    resident_s = time.perf_counter() - start
    resident_peak = torch.cuda.max_memory_allocated()
    equal = differ = 0
    for name, module in host.named_modules():
        if isinstance(module, QuantLinear):
            other = resident.get_submodule(name)
            if torch.equal(module.weight, other.weight.cpu()) and torch.equal(module.weight_scale, other.weight_scale.cpu()):
                equal += 1
            else:
                differ += 1
    return {
        "recipe": "int8 + SmoothQuant 0.5 + GPTQ",
        "calibration_blocks": list(blocks.shape),
        "model_bytes": model_bytes,
        "outside_blocks_bytes": nbytes(outside),
        "largest_block_bytes": largest_block,
        "hessian_bytes_upper_bound_one_block": hessians,
        # offload.py's bound: SmoothQuant upcasts 16-bit parameters to float32 (outside the blocks:
        # 16-bit + float32 during the cast), one block in float32, one block's Hessians; the
        # activations of one calibration batch come on top.
        "stated_bound_without_activations_bytes": 3 * nbytes(outside) + 2 * largest_block + hessians,
        "streamed_peak_bytes": streamed_peak,
        "resident_peak_bytes": resident_peak,
        "streamed_peak_over_model": streamed_peak / model_bytes,
        "streamed_s": streamed_s,
        "resident_s": resident_s,
        "layers_bit_equal_streamed_vs_resident": equal,
        "layers_differing": differ,
    }


def main(out_path: str) -> None:
    report = {**environment_metadata(), "transformers": transformers.__version__}
    model, tokenizer = quantkit.load_model(quantkit.BUNDLED_MODEL, device="cuda")
    if "--skip-greedy" not in sys.argv:
        report["greedy"] = greedy_checks(model, tokenizer, new_tokens=32)
    del model
    torch.cuda.empty_cache()
    if "--skip-streaming" not in sys.argv:
        blocks = quantkit.prepare_calibration_data(tokenizer, quantkit.BUNDLED_DATASET, 16, 512)
        report["streaming"] = streaming_check(tokenizer, blocks)
        print(json.dumps(report["streaming"], indent=1), flush=True)
    with open(out_path, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
