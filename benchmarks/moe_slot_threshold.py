"""Where 128-row blocks (the slot-order path, Gluon on sm_90) start to beat 64-row ones (the
pair-order path) for the MoE layer: ``moe.block_m_for``'s 128-row threshold lowered from 192 pairs
an expert to 64, against the default, alternating, CUDA-graph replays, same process. Qwen3-30B-
A3B's expert shapes (``moe_kernels.layer``). Writes JSON to the path given."""

from __future__ import annotations

import sys
from pathlib import Path

import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import layer, routing  # noqa: E402
from moe_slot_layer import graph_us, record  # noqa: E402
from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.kernels import moe  # noqa: E402

DEFAULT = moe.block_m_for


def lowered(pairs: int, experts: int, slot_order: bool = False) -> int:
    return 128 if pairs / max(experts, 1) >= 64 else DEFAULT(pairs, experts, slot_order)


def main(out_path: str) -> None:
    report = {**environment_metadata(), "transformers": transformers.__version__, "rows": []}
    modules = {"fp8": layer("fp8"), "int8": layer("int8")}
    for tokens in (1024, 1536, 2048, 2560):
        hidden, index, weights = routing(tokens)
        row = {"tokens": tokens, "pairs_per_expert": tokens * 8 / 128}
        for name, module in modules.items():
            timings = {}
            for label in ("default", "rows128", "default_again", "rows128_again"):
                moe.block_m_for = lowered if label.startswith("rows128") else DEFAULT
                timings[label] = graph_us(lambda: module(hidden, index, weights))
            moe.block_m_for = DEFAULT
            timings["rows128_speedup"] = round((timings["default"] + timings["default_again"])
                                               / (timings["rows128"] + timings["rows128_again"]), 3)
            row[name] = timings
        record(report, row, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
