"""GPU time of the operations one sampled decode step adds, at the bundled model's vocabulary.

    PYTHONPATH=. python benchmarks/sampling_ops.py OUT.json

Each operation is captured 20 times in a CUDA graph and replayed (median of 5 replays, divided by
20), so launch overhead is out and the numbers are GPU time, as in graph-replayed decoding.
Compared: torch's one-level ``cumsum`` over (B, 262144) against ``generate.row_cumsum`` (two
levels), and ``Sampling.choose`` as shipped against the same step with one-level scans.
"""

from __future__ import annotations

import json
import math
import statistics
import sys

import torch

from quantkit.bench.common import environment_metadata
from quantkit.generate import Sampling, row_cumsum

VOCAB = 262144


def graph_time_us(fn, repeats: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / repeats)
    return statistics.median(times)


def one_level_choose(sampling: Sampling, logits, uniform):
    """Sampling.choose as it was before row_cumsum (torch's cumsum for both scans)."""
    scores = sampling._scaled_top_k(logits)
    order = None
    if sampling._top_p_active:
        scores, order = torch.sort(scores, dim=-1, descending=True)
        ranked = scores.softmax(dim=-1)
        probs = ranked.masked_fill(ranked.cumsum(dim=-1) - ranked >= sampling.top_p, 0.0)
    else:
        probs = scores.softmax(dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform.double() * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True).clamp_max(cdf.shape[-1] - 1)
    return (index if order is None else order.gather(1, index))[:, 0]


def main(out_path: str) -> None:
    rows = []
    generator = torch.Generator("cuda").manual_seed(0)
    for batch in (1, 8):
        logits = torch.randn(batch, VOCAB, device="cuda", generator=generator).to(torch.bfloat16) * 3
        probs = logits.float().softmax(dim=-1)
        probs64 = probs.double()
        uniform = torch.rand(batch, device="cuda", generator=generator)
        ops = {
            "softmax fp32": lambda: logits.float().softmax(dim=-1),
            "cumsum fp64 (torch)": lambda: probs64.cumsum(dim=-1),
            "cumsum fp64 (row_cumsum)": lambda: row_cumsum(probs64),
            "cumsum fp32 (torch)": lambda: probs.cumsum(dim=-1),
            "cumsum fp32 (row_cumsum)": lambda: row_cumsum(probs),
            "sort descending": lambda: torch.sort(probs, dim=-1, descending=True),
            "topk 50": lambda: torch.topk(probs, 50, dim=-1),
        }
        for name, fn in ops.items():
            rows.append({"batch": batch, "op": name, "us": round(graph_time_us(fn), 2)})
            print(rows[-1], flush=True)
        # the two scans agree to rounding
        error = (row_cumsum(probs64) - probs64.cumsum(dim=-1)).abs().max().item()
        rows.append({"batch": batch, "op": "max |row_cumsum - cumsum| fp64", "value": error})
        for label, sampling in (("temperature 0.8", Sampling.of(0.8)), ("top-k 50", Sampling.of(1.0, 50)),
                                ("top-p 0.95", Sampling.of(1.0, None, 0.95))):
            new = graph_time_us(lambda: sampling.choose(logits, uniform))
            old = graph_time_us(lambda: one_level_choose(sampling, logits, uniform))
            same = bool(torch.equal(sampling.choose(logits, uniform), one_level_choose(sampling, logits, uniform)))
            rows.append({"batch": batch, "op": f"choose {label}", "us": round(new, 2), "one_level_us": round(old, 2),
                         "speedup": round(old / new, 3), "same_tokens": same})
            print(rows[-1], flush=True)
    with open(out_path, "w") as f:
        json.dump({**environment_metadata(), "vocab": VOCAB, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
