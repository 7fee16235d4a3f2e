"""Time and peak host memory of ``quantkit.load`` on a synthetic 0.85B-parameter Llama checkpoint.

    python benchmarks/load_memory.py make DIR          # quantize (fp8, random weights) and save
    python benchmarks/load_memory.py load DIR [--device cpu|cuda] [--dtype bfloat16]

``load`` prints one JSON line: seconds in ``quantkit.load``, seconds for the first forward (a CPU
load may leave tensors mapped from the file, paid for on first use), the process's peak resident
memory (ru_maxrss) and, on CUDA, the peak GPU memory. Run each measurement in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

import quantkit


def make(out_dir: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantkit.save(quantkit.quantize(model, "fp8", progress=False), out_dir, overwrite=True)


def load(ckpt: str, device: str, dtype: str) -> dict:
    start = time.perf_counter()
    model = quantkit.load(ckpt, device=device, dtype=getattr(torch, dtype))
    loaded = time.perf_counter()
    tokens = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    done = time.perf_counter()
    result = {
        "load_s": round(loaded - start, 3),
        "first_forward_s": round(done - loaded, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "logits_checksum": float(logits.sum()),
        "device": device, "dtype": dtype, "torch": torch.__version__,
    }
    if device.startswith("cuda"):
        result["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        result["gpu"] = torch.cuda.get_device_name()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("make", "load"))
    parser.add_argument("ckpt")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.action == "make":
        make(args.ckpt)
    else:
        print(json.dumps(load(args.ckpt, args.device, args.dtype)))


if __name__ == "__main__":
    main()
