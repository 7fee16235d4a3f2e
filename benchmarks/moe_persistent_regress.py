"""The persistent grouped kernel's 128-row configs (Qwen3-30B-A3B expert shapes, 4096 and 8192
tokens), timed with the quantkit found on PYTHONPATH, each twice, with session 31's address-loaded
config as the anchor in the same process. Run s33b put copies of four commits' ``quantkit/``
(``git archive COMMIT quantkit``) beside the tree and ran one process per commit:

    PYTHONPATH=old/COMMIT python3 benchmarks/moe_persistent_regress.py COMMIT OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import moe_tma_sweep as sweep  # noqa: E402  (shapes, weights, routing, timer)


def main(tag: str, out: str) -> None:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    points = sweep.gemm_points(gen, {torch.float8_e4m3fn: (4096, 8192), torch.int8: (4096, 8192)})
    for name, tokens, gemm, gated, pairs, fn in points:
        persistent = dict(tma=True, persistent=True, block_m=128, block_n=128 if gated else 256, block_k=128,
                          num_warps=8, num_stages=4)
        anchor = sweep.session31_default(pairs, gated)
        variants = {"session31": anchor, "persistent": persistent, "session31_again": anchor,
                    "persistent_again": persistent}
        ref = fn(anchor).float()
        row = dict(commit=tag, dtype=name, tokens=tokens, gemm=gemm)
        for label, config in variants.items():
            err, us = sweep.error_and_us(fn, config, ref)
            row[label], row[label + "_err"] = round(us, 2), err
        rows.append(row)
        print(tag, name, tokens, gemm, {k: row[k] for k in variants}, flush=True)
    with open(out, "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
