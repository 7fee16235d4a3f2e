"""Grouped MoE GEMMs in 128-row blocks: activation rows gathered by address against rows put in
slot order first and loaded by TMA (``config["sorted_a"]``).

The persistent kernel (``moe._grouped_persistent_kernel``) loads a block's activation rows by
address (cp.async, a pointer per row in registers, issued by the warps that run the MMAs), because
Hopper's TMA has no row gather. With ``sorted_a`` the rows are first copied into slot order (one
``index_select`` of the plan's rows), and the kernel then moves both operands by TMA, as the dense
GEMM does. (The ``sorted_a`` flag lived in ``moe.py`` from 13a00f6 to 0de9e45, for runs s35a/b; the
slot-order path, ``moe.grouped_slot_mm``, replaced it, so this mode needs a checkout of that range;
``--sweep``, run s35d, does not.)
Timed per (dtype, tokens, GEMM), CUDA-graph replays, same process: the default, the
sorted form with the default's tiles and with 3 stages, the default again (the spread), the copy
alone, and the dense quantkit GEMM of the same (pairs, N, K) as a ceiling (no routing). Each
output is compared with the default's. Writes JSON to the path given.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_tma_sweep import E, H, I, error_and_us, failure, gemm_points, header  # noqa: E402
from quantkit.kernels import moe, ops  # noqa: E402


def main(out_path: str, deadline_s: float = 420.0) -> None:
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(3)
    report = header()
    counts = (4096, 8192, 16384)
    for name, tokens, gemm, gated, pairs, fn in gemm_points(gen, {torch.float8_e4m3fn: counts, torch.int8: counts}):
        if time.time() - start > deadline_s:
            break
        K = H if gated else I
        n_out = I if gated else H
        default = moe.default_config(pairs, E, K, gated)
        variants = {"default": default, "sorted": {**default, "sorted_a": True},
                    "sorted_s3": {**default, "sorted_a": True, "num_stages": 3}, "default_again": default}
        ref = fn(default)
        row = dict(dtype=name, tokens=tokens, gemm=gemm, pairs=pairs, flops=2 * pairs * n_out * K * (2 if gated else 1))
        for label, c in variants.items():
            try:
                out = fn(c)
                err, us = error_and_us(fn, c, ref.float())
                row[label] = dict(config=c, us=round(us, 2), equal=bool(torch.equal(out, ref)), rel_err=err,
                                  tflops=round(row["flops"] / us / 1e6, 1))
            except Exception as exc:
                row[label] = failure(c, exc)
        # The copy alone: the rows of a (P / row_div or P, K) activation in slot order.
        rows = moe.route_plan(torch.randint(0, E, (pairs,), device="cuda", generator=gen), E, 128).rows
        a = torch.empty(pairs // (8 if gated else 1), K, device="cuda", dtype=torch.int8)
        index = rows.clamp(min=0) // (8 if gated else 1)
        row["copy_us"] = round(1e3 * triton.testing.do_bench_cudagraph(lambda: a.index_select(0, index), rep=40), 2)
        row["copy_rows"] = rows.numel()
        # Dense ceiling: the same FLOPs as one (pairs, N, K) GEMM, no routing.
        dtype = torch.int8 if name == "int8" else torch.float8_e4m3fn
        x = torch.randn(pairs, K, device="cuda", generator=gen, dtype=torch.bfloat16)
        q, s = ops.quantize_per_token(x, dtype, backend="triton")
        w = torch.randn(n_out * (2 if gated else 1), K, device="cuda", generator=gen).mul(60).clamp(-127, 127).to(dtype)
        ws = torch.rand(w.shape[0], device="cuda", generator=gen) * 1e-3
        if gated:
            dense = lambda: ops.gated_scaled_mm(q, w, s, ws, "silu", torch.bfloat16, backend="triton")  # noqa: E731
        else:
            dense = lambda: ops.scaled_mm(q, w, s, ws, out_dtype=torch.bfloat16, backend="triton")  # noqa: E731
        try:
            dense()
            us = 1e3 * triton.testing.do_bench_cudagraph(dense, rep=40)
            row["dense"] = dict(us=round(us, 2), tflops=round(row["flops"] / us / 1e6, 1))
        except Exception as exc:
            row["dense"] = failure("dense", exc)
        report["rows"].append(row)
        print(name, tokens, gemm, {k: (v.get("us"), v.get("equal")) for k, v in row.items() if isinstance(v, dict)},
              "copy", row["copy_us"], flush=True)
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=1)


def sweep_configs(gated: bool) -> list[dict]:
    """Persistent-kernel tiles in 128-row blocks whose ring (one-byte operands) fits the CTAs an SM
    is asked to hold."""
    out = []
    for bn, bk, stages, warps, ctas in itertools.product((64, 128) if gated else (128, 256), (64, 128), (3, 4, 5),
                                                         (4, 8), (1, 2)):
        ring = stages * bk * (128 + (2 if gated else 1) * bn)
        if ctas * ring > 200_000 or (warps == 4 and bn * (2 if gated else 1) > 128):
            continue
        out.append(dict(tma=True, persistent=True, block_m=128, block_n=bn, block_k=bk, num_stages=stages,
                        num_warps=warps, ctas_per_sm=ctas))
    return out


def sweep(out_path: str, deadline_s: float = 500.0) -> None:
    """The persistent kernel's tiles, warps, stages and CTAs an SM at 8192 tokens (512 pairs an
    expert), the default timed first and last."""
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(4)
    report = header()
    for name, tokens, gemm, gated, pairs, fn in gemm_points(gen, {torch.float8_e4m3fn: (8192,), torch.int8: (8192,)}):
        K = H if gated else I
        default = moe.default_config(pairs, E, K, gated)
        ref = fn(default)
        results = []
        for c in [default] + sweep_configs(gated) + [default]:
            if time.time() - start > deadline_s:
                break
            try:
                err, us = error_and_us(fn, c, ref.float())
                results.append(dict(config=c, us=round(us, 2), equal=bool(torch.equal(fn(c), ref))))
            except Exception as exc:
                results.append(failure(c, exc))
        report["rows"].append(dict(dtype=name, tokens=tokens, gemm=gemm, pairs=pairs, results=results))
        timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
        print(name, tokens, gemm, "default", [r.get("us") for r in (results[0], results[-1])], flush=True)
        for r in timed[:6]:
            print("   ", r["us"], r["equal"], {k: v for k, v in r["config"].items() if k not in ("tma", "persistent")},
                  flush=True)
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--sweep":
        sweep(sys.argv[2])
    else:
        main(sys.argv[1])
