"""Session-6 host overhead on the GPU: eager prefill at 1x2048, Llama-3-8B shape, per variant.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/host_gpu_s6.py --out $OUT [--layers 32]

What the CPU harness (host_overhead_cpu.py) cannot see: triton's own launch cost and the CUDA
allocator. Per variant (hf-bf16, int8-fast, fp8-fast; one after another in this process), blocks
of forwards in every mode, interleaved ``--reps`` times:

- ``gc-on`` / ``gc-off`` / ``gc-freeze`` (Python's default; ``gc.disable()``; ``gc.collect();
  gc.freeze()``): collections per forward (gc.callbacks) and their time;
- ``cache-off`` (quantkit variants): ``launch.ENABLED = False``, every kernel through triton's own
  launch path, as RoPE and flash prefill were before session 6.

Each forward gives its issue time (until the call returns) and its eager time (until the GPU is
done); then the same forward captured in a CUDA graph gives the GPU time. The caching allocator's
counters (device allocations / frees / retries per forward) tell whether a forward waited on
cudaMalloc / cudaFree, the other process-dependent host cost besides gc. ``--device cpu --tiny``
runs the plumbing on a tiny model (torch backend), without the graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantkit.api import quantize  # noqa: E402
from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.e2e import build_model, llama3_8b_config  # noqa: E402
from quantkit.config import QuantConfig  # noqa: E402
from quantkit.kernels import launch  # noqa: E402
from quantkit.models.fast_path import optimize  # noqa: E402

VARIANTS = ("hf-bf16", "int8-fast", "fp8-fast")


class GcMeter:
    def __init__(self) -> None:
        self.counts, self.seconds, self._start = [0, 0, 0], 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._start


def _set_mode(mode: str) -> None:
    gc.unfreeze()
    gc.enable()
    launch.ENABLED = mode != "cache-off"
    if mode == "gc-off":
        gc.disable()
    elif mode == "gc-freeze":
        gc.collect()
        gc.freeze()


def _allocator_counts(device: str) -> list[int]:
    if device != "cuda":
        return [0, 0, 0]
    stats = torch.cuda.memory_stats()
    return [stats.get("num_device_alloc", 0), stats.get("num_device_free", 0), stats.get("num_alloc_retries", 0)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(variant: str, config, device: str, tokens: int, reps: int, block: int) -> dict:
    model = build_model(config, device)
    if variant != "hf-bf16":
        quantize(model, QuantConfig.preset(variant.split("-")[0]), progress=False)
        optimize(model, exact=False)
    ids = torch.randint(0, config.vocab_size, (1, tokens)).to(device)

    @torch.no_grad()
    def forward():
        return model(ids, use_cache=False, logits_to_keep=1)

    for _ in range(3):
        forward()
    _sync(device)
    modes = ["gc-on", "gc-off", "gc-freeze"] + (["cache-off"] if variant != "hf-bf16" else [])
    samples = {mode: {"issue_ms": [], "eager_ms": []} for mode in modes}
    meter, collections = GcMeter(), {mode: [[0, 0, 0], 0.0, 0] for mode in modes}
    allocator = {mode: [0, 0, 0] for mode in modes}  # device allocs, frees, retries during timed forwards
    gc.callbacks.append(meter)
    try:
        for _ in range(reps):
            for mode in modes:
                _set_mode(mode)
                forward()  # untimed: the mode switch (and a cache-off compile lookup) settles
                _sync(device)
                meter.counts, meter.seconds = [0, 0, 0], 0.0
                before = _allocator_counts(device)
                for _ in range(block):
                    start = time.perf_counter()
                    forward()
                    issued = time.perf_counter()
                    _sync(device)
                    samples[mode]["issue_ms"].append((issued - start) * 1e3)
                    samples[mode]["eager_ms"].append((time.perf_counter() - start) * 1e3)
                allocator[mode] = [a + now - then for a, now, then in
                                   zip(allocator[mode], _allocator_counts(device), before)]
                stats = collections[mode]
                stats[0] = [a + b for a, b in zip(stats[0], meter.counts)]
                stats[1] += meter.seconds
                stats[2] += block
    finally:
        gc.callbacks.remove(meter)
        _set_mode("gc-on")
    row = {"variant": variant, "layers": config.num_hidden_layers, "tokens": tokens}
    for mode in modes:
        counts, seconds, n = collections[mode]
        row[mode] = {key: {"median": statistics.median(v), "min": min(v)} for key, v in samples[mode].items()}
        row[mode]["collections_per_forward_gen0_1_2"] = [c / n for c in counts]
        row[mode]["gc_ms_per_forward"] = seconds / n * 1e3
        row[mode]["device_allocs_frees_retries_per_forward"] = [c / n for c in allocator[mode]]
    if device == "cuda":
        graph = launch.capture_graph(forward)
        row["graph_ms"] = launch.median_replay_ms(graph, 20)
        del graph
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (plumbing check, e.g. on CPU)")
    args = parser.parse_args()
    overrides = dict(num_hidden_layers=args.layers)
    if args.tiny:
        overrides.update(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, vocab_size=256)
    config = llama3_8b_config(**overrides)
    result = {"environment": environment_metadata(), "settings": vars(args), "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        result["rows"].append(measure(variant, config, args.device, args.tokens, args.reps, args.block))
        (out / "host_gpu_s6.json").write_text(json.dumps(result, indent=1, default=str))
        gc.collect()  # the variant's model went with measure()'s frame
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
