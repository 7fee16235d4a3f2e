"""Wall time of block-by-block GPTQ statistics: recorded block inputs against whole-model passes.

    PYTHONPATH=. python benchmarks/gptq_blockwise_time.py OUT.json [--device cuda] [--layers 18]
        [--samples 16] [--seq-len 512]

A random model of the bundled Gemma-3-270M's shape (vocabulary cut to 4096: the blocks are what
run), float32. For per_block and sequential GPTQ of every Linear in the blocks: the time with the
blocks' inputs recorded once and stepped through the blocks (``calibration.blockwise``), and with
whole-model forwards through blocks 0..i for block i (the path kept for models whose blocks are
not a chain), same process, alternating; the results must be equal. Also the time of the
rounding alone (the Hessians given), so the forwards' share shows.

``--stream``: instead, the public API streaming a host-resident bf16 model of that shape (the full
262,144-token vocabulary, so the parts outside the blocks weigh what they do) to the GPU, int8 +
SmoothQuant 0.5 + GPTQ (per block) and + sequential GPTQ: the peak of GPU memory and the time,
block inputs recorded against whole-model passes, and whether the quantized weights are equal.
``--resident``: the same with the model on the GPU (no streaming), where the whole-model path is
one forward collecting every layer's Hessian at once.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import transformers

from quantkit.bench.common import environment_metadata
from quantkit.calibration import gptq
from quantkit.calibration.blockwise import BlockInputs
from quantkit.convert import target_linears
from quantkit.config import QuantConfig


def option(name: str, default: str) -> str:
    args = sys.argv[2:]
    return args[args.index(name) + 1] if name in args else default


def model_of(layers: int, device: str, vocab: int = 4096, dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=640, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
        max_position_embeddings=32768,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
    return transformers.Gemma3ForCausalLM(config).to(device, dtype).eval()


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(out_path: str) -> None:
    device, layers = option("--device", "cpu"), int(option("--layers", "18"))
    samples, seq_len = int(option("--samples", "16")), int(option("--seq-len", "512"))
    model = model_of(layers, device)
    names = list(target_linears(model, QuantConfig.preset("int8")))
    data = torch.randint(3, 4096, (samples, seq_len), generator=torch.Generator().manual_seed(1))
    report = {**environment_metadata(), "device": device, "layers": layers, "samples": samples, "seq_len": seq_len,
              "rows": []}
    record = BlockInputs.record
    rounding = []
    layer = gptq._gptq_layer

    def counted_layer(*args):
        out, seconds = timed(lambda: layer(*args))
        rounding.append(seconds)
        return out

    gptq._gptq_layer = counted_layer
    for mode in ("per_block", "sequential"):
        results = {}
        for path in ("blockwise", "whole_model"):
            BlockInputs.record = record if path == "blockwise" else classmethod(lambda cls, *a, **k: None)
            rounding.clear()
            results[path], seconds = timed(lambda: gptq.gptq_quantize_weights(
                model, data, names, progress=False, batch_size=4, **{mode: True}))
            row = dict(mode=mode, path=path, seconds=round(seconds, 2), rounding_seconds=round(sum(rounding), 2))
            report["rows"].append(row)
            print(row, flush=True)
        BlockInputs.record = record
        equal = all(torch.equal(a, b) for n in names for a, b in zip(results["blockwise"][n], results["whole_model"][n]))
        report["rows"][-1]["equal_to_blockwise"] = equal
        print(mode, "results equal:", equal, flush=True)
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=1)


def streamed(out_path: str, resident: bool = False) -> None:
    import copy

    import quantkit
    from quantkit.nn import QuantLinear

    layers, samples, seq_len = int(option("--layers", "18")), int(option("--samples", "64")), int(option("--seq-len", "512"))
    host = model_of(layers, "cpu", vocab=262144, dtype=torch.bfloat16)
    data = torch.randint(3, 262144, (samples, seq_len), generator=torch.Generator().manual_seed(1))
    report = {**environment_metadata(), "layers": layers, "samples": samples, "seq_len": seq_len,
              "resident": resident, "rows": []}
    record = BlockInputs.record
    paths = option("--paths", "blockwise,whole_model").split(",")  # e.g. whole_model,blockwise,whole_model,blockwise
    for sequential in [False, True][: int(option("--modes", "2"))]:
        config = QuantConfig.preset("int8", smoothquant_alpha=0.5, gptq=True, gptq_sequential=sequential)
        weights = {}
        for path in paths:
            BlockInputs.record = record if path == "blockwise" else classmethod(lambda cls, *a, **k: None)
            model = copy.deepcopy(host)
            if resident:
                model = model.cuda()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            _, seconds = timed(lambda: quantkit.quantize(model, config, data, progress=False,
                                                         offload_device=None if resident else "cuda"))
            weights[path] = {n: (m.weight, m.weight_scale) for n, m in model.named_modules() if isinstance(m, QuantLinear)}
            row = dict(sequential=sequential, path=path, seconds=round(seconds, 2),
                       peak_gpu_bytes=torch.cuda.max_memory_allocated() - before)
            report["rows"].append(row)
            print(row, flush=True)
        BlockInputs.record = record
        report["rows"][-1]["equal_to_blockwise"] = weights["blockwise"].keys() == weights["whole_model"].keys() and all(
            torch.equal(a, b) for n, pair in weights["blockwise"].items() for a, b in zip(pair, weights["whole_model"][n]))
        print("equal:", report["rows"][-1]["equal_to_blockwise"], flush=True)
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    if "--stream" in sys.argv[2:] or "--resident" in sys.argv[2:]:
        streamed(sys.argv[1], resident="--resident" in sys.argv[2:])
    else:
        main(sys.argv[1])
