"""Time and peak memory of ``quantkit.load`` on a synthetic Llama checkpoint (random weights, fp8).

    python benchmarks/load_memory.py make DIR [--size 0.85b|3.6b] [--device cpu|cuda]
    python benchmarks/load_memory.py load DIR [--device cpu|cuda] [--dtype bfloat16] [--reference FILE]
    python benchmarks/load_memory.py check OUT.json     # CUDA: save -> load bit-identical, tied head

``load`` prints one JSON line: seconds in ``quantkit.load``, seconds for the first forward (a CPU
load may leave tensors mapped from the file, paid for on first use; on CUDA it includes kernel
compilation), the process's peak resident memory (ru_maxrss) and, on CUDA, the peak GPU memory.
``--reference`` takes ``load`` from another copy of quantkit/checkpoint.py (an earlier commit's,
for a before/after in the same run). Run each measurement in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

import quantkit


SIZES = {  # Llama shapes: a TinyLlama-like 0.85B and a Llama-3.2-3B-like 3.6B (untied head)
    "0.85b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4),
    "3.6b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                 num_attention_heads=24, num_key_value_heads=8),
}


def make(out_dir: str, size: str, device: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SIZES[size], max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantkit.save(quantkit.quantize(model, "fp8", progress=False), out_dir, overwrite=True)


def _reference_load(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("reference_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.load


def load(ckpt: str, device: str, dtype: str, reference: str | None = None) -> dict:
    load_fn = _reference_load(reference) if reference else quantkit.load
    start = time.perf_counter()
    model = load_fn(ckpt, device=device, dtype=getattr(torch, dtype))
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
        "device": device, "dtype": dtype, "torch": torch.__version__, "load_from": reference or "quantkit",
    }
    if device.startswith("cuda"):
        result["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
        result["gpu"] = torch.cuda.get_device_name()
    return result


def check(out_path: str) -> None:
    """On CUDA (Triton backend): a quantized model saved and loaded gives bit-identical logits, for
    a tied (Gemma-3) and an untied (Llama) head, both schemes; the loaded tensors live on the GPU."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    configs = {
        "gemma3-tied": Gemma3TextConfig(vocab_size=4099, hidden_size=640, intermediate_size=2048, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                        sliding_window=64, max_position_embeddings=1024),
        "llama-untied": LlamaConfig(vocab_size=4099, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                    tie_word_embeddings=False),
    }
    import tempfile

    results = {}
    tokens = torch.randint(0, 4099, (2, 77), generator=torch.Generator().manual_seed(1)).cuda()
    for name, config in configs.items():
        for scheme in ("fp8", "int8"):
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
            qmodel = quantkit.quantize(model, scheme, progress=False)
            with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
                quantkit.save(qmodel, f"{tmp}/ckpt")
                loaded = quantkit.load(f"{tmp}/ckpt", device="cuda", progress=False)
                same = bool(torch.equal(loaded(tokens).logits, qmodel(tokens).logits))
            devices = sorted({str(t.device) for t in [*loaded.parameters(), *loaded.buffers()]})
            tied = loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
            results[f"{name}/{scheme}"] = {"bit_identical": same, "devices": devices, "head_tied": tied}
            print(name, scheme, results[f"{name}/{scheme}"])
    with open(out_path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("make", "load", "check"))
    parser.add_argument("path", help="checkpoint directory (make, load) or JSON report (check)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--size", default="0.85b", choices=sorted(SIZES))
    parser.add_argument("--reference", help="a copy of quantkit/checkpoint.py to take load() from")
    args = parser.parse_args()
    if args.action == "make":
        make(args.path, args.size, args.device)
    elif args.action == "check":
        check(args.path)
    else:
        print(json.dumps(load(args.path, args.device, args.dtype, args.reference)))


if __name__ == "__main__":
    main()
