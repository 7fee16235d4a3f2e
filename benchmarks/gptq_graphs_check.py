"""GPTQ's column loop replayed as CUDA graphs against eager, on the GPU: equal codes, and the time.

    PYTHONPATH=. python benchmarks/gptq_graphs_check.py OUT.json

Random weights and correlated inputs (a low-rank mix plus noise, unequal channels) give each
layer's Hessian; the bundled Gemma-3-270M's layer shapes (N x K) and an 8B model's, with K not a
multiple of 128 once (a last, partial block runs eagerly). For INT8 and FP8: ``gptq_quantize``
eager, then with one ``ColumnGraphs`` cache shared by all shapes (so later layers of a shape replay a
graph captured by an earlier one), codes compared with torch.equal; times per layer, device-synchronized.
"""

from __future__ import annotations

import json
import sys

import torch

from quantkit.bench.common import environment_metadata
from quantkit.calibration.gptq import ColumnGraphs, gptq_quantize
from quantkit.kernels.reference import quantize_per_channel

from gptq_blockwise_time import timed  # this folder: on sys.path when run as a script

SHAPES = [(1024, 640), (256, 640), (640, 1024), (2048, 640), (640, 2048), (1024, 640), (2048, 640),
          (4096, 4096), (14336, 4096), (4096, 14336), (1000, 700)]


def layer(n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mix = torch.randn(k // 4, k, device="cuda", generator=gen) / (k // 4) ** 0.5
    x = (torch.randn(4096, k // 4, device="cuda", generator=gen) @ mix
         + 0.1 * torch.randn(4096, k, device="cuda", generator=gen)) * torch.exp(torch.randn(k, device="cuda", generator=gen))
    weight = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    return weight, 2 * x.t() @ x / x.shape[0]


def main(out_path: str) -> None:
    report = {**environment_metadata(), "rows": []}
    ok = True
    for dtype in (torch.int8, torch.float8_e4m3fn):
        graphs = ColumnGraphs()
        for i, (n, k) in enumerate(SHAPES):
            weight, hessian = layer(n, k, seed=i)
            _, scale = quantize_per_channel(weight, dtype)
            scale = scale.reshape(-1)
            eager, eager_s = timed(lambda: gptq_quantize(weight, hessian, scale, dtype))
            graphed, graph_s = timed(lambda: gptq_quantize(weight, hessian, scale, dtype, cuda_graphs=graphs))
            equal = torch.equal(eager.view(torch.uint8), graphed.view(torch.uint8))
            ok &= equal
            row = dict(dtype=str(dtype), n=n, k=k, equal=equal, eager_s=round(eager_s, 4), graph_s=round(graph_s, 4),
                       speedup=round(eager_s / graph_s, 2))
            report["rows"].append(row)
            print(row, flush=True)
    report["all_equal"] = ok
    print("all equal" if ok else "SOME DIFFER", flush=True)
    with open(out_path, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
