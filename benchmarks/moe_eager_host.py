"""Where the MoE layer's eager call spends its host time (GPU): per token count and path, the host
time to enqueue a call, the wall time of back-to-back calls and the GPU time of a CUDA-graph
replay, then a cProfile of the slot-order and pair-order paths at one token count.

Qwen3-30B-A3B's expert shapes (``moe_kernels.layer``), random weights and routing. An eager call
is host-bound when its enqueue time is above its graph time. Writes ``<out>.json`` and the
profiles as ``<out>_profile_<dtype>_<path>.txt``.

    python benchmarks/moe_eager_host.py OUT.json [--no-profile] [--tokens 1,512,2048]

Run twice with another checkout's package first on PYTHONPATH, it compares two versions' host
time in one process lifetime each (same machine, same session).
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import layer, routing  # noqa: E402
from moe_slot_layer import graph_us, pair_order, record  # noqa: E402
from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.kernels import gemm_gluon  # noqa: E402

TOKENS = (1, 64, 512, 2048, 4096, 8192)
CALLS = 30


def host_times(fn, calls: int = CALLS) -> dict:
    """Median over 5 batches of ``calls`` back-to-back calls: enqueue time and wall time per call (µs)."""
    fn()
    torch.cuda.synchronize()
    enqueue, wall = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        queued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        enqueue.append(1e6 * (queued - start) / calls)
        wall.append(1e6 * (done - start) / calls)
    return {"enqueue_us": round(sorted(enqueue)[2], 1), "wall_us": round(sorted(wall)[2], 1)}


def profile(fn, path: Path, calls: int = 50) -> None:
    fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"{calls} calls\n")
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    path.write_text(text.getvalue())


def main(out_path: str, profile_tokens: int | None = 2048, token_counts=TOKENS) -> None:
    import quantkit

    report = {**environment_metadata(), "transformers": transformers.__version__, "gluon": gemm_gluon.available(),
              "package": str(Path(quantkit.__file__).parent), "calls": CALLS, "rows": []}
    modules = {"bf16": layer(None), "fp8": layer("fp8"), "int8": layer("int8")}
    base = Path(out_path).with_suffix("")
    with torch.no_grad():
        for tokens in token_counts:
            hidden, index, weights = routing(tokens)
            row = {"tokens": tokens}
            for name, module in modules.items():
                def call(module=module):
                    return module(hidden, index, weights)

                for path in (("slot", "pair") if name != "bf16" else ("eager_loop",)):
                    pair_order(path == "pair")
                    row[f"{name}_{path}"] = {**host_times(call), "graph_us": graph_us(call)}
                    if tokens == profile_tokens and name != "bf16":
                        profile(call, Path(f"{base}_profile_{name}_{path}.txt"))
                pair_order(False)
            record(report, row, out_path)


if __name__ == "__main__":
    args = sys.argv[1:]
    tokens = TOKENS
    if "--tokens" in args:
        tokens = tuple(int(t) for t in args.pop(args.index("--tokens") + 1).split(","))
        args.remove("--tokens")
    profile_at = None if "--no-profile" in args else 2048
    main([a for a in args if a != "--no-profile"][0], profile_at, tokens)
