"""Grouped MoE GEMMs at prefill sizes: address-loaded weight tiles against TMA-loaded ones.

Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts of 768, top-8), random quantized weights
and a random softmax top-8 routing. For each token count: the gate/up (gated SiLU) and down GEMMs
of ``kernels/moe.py`` over a tile sweep, the address-loaded kernel (``_grouped_kernel``) against
the TMA one (``_grouped_tma_kernel``), each output checked against the default config's (a swept
config without kernel flags runs the address-loaded kernel; ``moe.KERNEL_FLAGS``), timed with ``do_bench_cudagraph`` (plans made beforehand, as a layer makes one for both
GEMMs). Writes JSON to the path given.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch
import triton.testing

from quantkit.bench.common import environment_metadata
from quantkit.kernels import moe, ops

E, H, I, TOP_K = 128, 2048, 768, 8


def configs(gated: bool) -> list[dict]:
    widths = (64, 128) if gated else (128, 256)
    out = [dict(tma=True, block_m=bm, block_n=bn, block_k=128, num_warps=w, num_stages=s, n_fastest=nf)
           for bm, bn, w, s, nf in itertools.product((64, 128), widths, (4, 8), (3, 4), (False, True))]
    out += [dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)]
    return out


def weights(dtype, rows, K, gen):
    if dtype == torch.int8:
        w = torch.randint(-127, 128, (E, rows, K), device="cuda", generator=gen, dtype=torch.int8)
        scale = torch.rand(E, rows, device="cuda", generator=gen) * 2e-4 + 1e-4
    else:
        w = (torch.randn(E, rows, K, device="cuda", generator=gen) * 100).clamp(-448, 448).to(dtype)
        scale = torch.rand(E, rows, device="cuda", generator=gen) * 2e-4 + 1e-4
    return w, scale


def header() -> dict:
    return {**environment_metadata(), "shapes": dict(experts=E, hidden=H, intermediate=I, top_k=TOP_K), "rows": []}


def gemm_calls(dtype, tokens: int, gen, w13, s13, w2, s2) -> tuple[int, dict]:
    """A random softmax top-8 routing of ``tokens`` random rows, and the layer's two grouped GEMMs
    as ``fn(config)`` on it: gate/up (gated SiLU) and down (its input the first's output,
    quantized), each with the routing plan of its config's block height made beforehand."""
    hidden = torch.randn(tokens, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    probs = torch.randn(tokens, E, device="cuda", generator=gen).softmax(-1)
    experts = probs.topk(TOP_K, dim=-1).indices.reshape(-1).contiguous()
    q, scale = ops.quantize_per_token(hidden, dtype, backend="triton")
    h = moe.grouped_scaled_mm(q, w13, scale, s13, experts, TOP_K, "silu", True)
    hq, hs = ops.quantize_per_token(h, dtype, backend="triton")
    plans = {bm: moe.route_plan(experts, E, bm) for bm in (16, 32, 64, 128)}

    def gate_up(c):
        return moe.grouped_scaled_mm(q, w13, scale, s13, experts, TOP_K, "silu", True, plan=plans[c["block_m"]],
                                     config=c)

    def down(c):
        return moe.grouped_scaled_mm(hq, w2, hs, s2, experts, 1, plan=plans[c["block_m"]], config=c)

    return experts.numel(), {"gate_up": gate_up, "down": down}


def gemm_points(gen, tokens: dict):
    """Every (dtype name, tokens, gemm, gated, pairs, fn) to measure: FP8 then INT8, each dtype's
    random weights drawn once, then for each of ``tokens[dtype]`` a routing and its two GEMMs
    (``gemm_calls``), gate/up before down, all from ``gen`` in that order."""
    for dtype, token_counts in tokens.items():
        name = "fp8" if dtype != torch.int8 else "int8"
        w13, s13 = weights(dtype, 2 * I, H, gen)
        w2, s2 = weights(dtype, H, I, gen)
        for count in token_counts:
            pairs, calls = gemm_calls(dtype, count, gen, w13, s13, w2, s2)
            for gemm, gated in (("gate_up", True), ("down", False)):
                yield name, count, gemm, gated, pairs, calls[gemm]


def error_and_us(fn, config, ref) -> tuple[float, float]:
    """``fn(config)``'s relative error against ``ref`` and its time (µs, CUDA-graph replays)."""
    err = ((fn(config).float() - ref).norm() / ref.norm()).item()
    return err, 1e3 * triton.testing.do_bench_cudagraph(lambda: fn(config), rep=40)


def failure(config, exc) -> dict:
    """A config that did not run (out of shared memory or registers): recorded, not fatal."""
    torch.cuda.synchronize()
    return dict(config=config, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}")


def main(out_path: str, deadline_s: float = 520.0) -> None:
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = header()
    best_of = {}
    points = gemm_points(gen, {torch.float8_e4m3fn: (8192, 2048, 512), torch.int8: (8192, 2048)})
    for name, tokens, gemm, gated, pairs, fn in points:
        flops = 2 * pairs * (2 * I * H if gated else H * I)
        default = moe.default_config(pairs, E, H if gated else I, gated)
        ref = fn(default).float()
        candidates = [default] + (configs(gated) if tokens >= 2048 or (name, gemm) not in best_of
                                  else best_of[(name, gemm)])
        results = []
        for c in candidates:
            if time.time() - start > deadline_s:
                break
            try:
                err, us = error_and_us(fn, c, ref)
                results.append(dict(config=c, us=round(us, 2), tflops=round(flops / us / 1e6, 1),
                                    rel_err_vs_default=err))
            except Exception as exc:
                results.append(failure(c, exc))
        timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
        if tokens == 2048:
            best_of[(name, gemm)] = [r["config"] for r in timed[:6] if r["config"] is not default]
        row = dict(dtype=name, tokens=tokens, gemm=gemm, pairs=pairs, flops=flops,
                   default=next((r for r in results if r["config"] is default), None),
                   best=timed[0] if timed else None, results=results)
        report["rows"].append(row)
        d, b = row["default"], row["best"]
        print(f"{name} T={tokens} {gemm}: default {d and d.get('us')} us ({d and d.get('tflops')} TF/s), "
              f"best {b and b['us']} us ({b and b['tflops']} TF/s) {b and b['config']}", flush=True)
        for r in timed[:5]:
            print("   ", r["us"], r["tflops"], f"{r['rel_err_vs_default']:.1e}", r["config"], flush=True)
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=1)


def session31_default(pairs: int, gated: bool) -> dict:
    """The defaults before the TMA kernel (session 31): address-loaded tiles, 16- to 64-row blocks."""
    average = pairs / E
    block_m = 16 if average <= 16 else 32 if average <= 32 else 64
    large = block_m == 64
    return dict(tma=False, block_m=block_m, block_n=128, block_k=128, num_warps=8 if large and gated else 4,
                num_stages=4 if large and gated else 3)


def compare(out_path: str) -> None:
    """Session 31's defaults against the current ones, same process, and from 2048 to 4096 tokens
    (128-256 pairs an expert) the 64-row defaults against the 128-row ones (the persistent
    kernel; from run s33c). Before, at 4096 tokens only, the default's kernel in 64- and 128-row
    blocks ("default_bm64/128"; s33a added "persistent_bm128"). Runs s32b, s32c and s32f
    labelled those "tma_bm64" / "tma_bm128": for the gated GEMM, whose default at 4096 tokens is
    address-loaded, they ran the address-loaded kernel (the default's flags were merged in)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    report = header()
    counts = (64, 256, 512, 1024, 2048, 3072, 4096, 8192)
    points = gemm_points(gen, {torch.float8_e4m3fn: counts, torch.int8: counts})
    for name, tokens, gemm, gated, pairs, fn in points:
        new = moe.default_config(pairs, E, H if gated else I, gated)
        variants = {"session31": session31_default(pairs, gated), "default": new}
        if 2048 <= tokens <= 4096:  # where 64- and 128-row blocks meet: both defaults
            K = H if gated else I
            variants["rows64"] = moe.default_config(64 * E, E, K, gated)
            variants["rows128"] = moe.default_config(512 * E, E, K, gated)
        ref = fn(variants["session31"]).float()
        row = dict(dtype=name, tokens=tokens, gemm=gemm, pairs=pairs)
        for label, c in variants.items():
            err, us = error_and_us(fn, c, ref)
            row[label] = dict(config=c, us=round(us, 2), rel_err_vs_session31=err)
        row["speedup"] = row["session31"]["us"] / row["default"]["us"]
        report["rows"].append(row)
        print(name, tokens, gemm, {k: v["us"] for k, v in row.items() if isinstance(v, dict)},
              f"speedup {row['speedup']:.3f}", flush=True)
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=1)


def persistent(out_path: str, deadline_s: float = 300.0) -> None:
    """The persistent TMA kernel (tile and K loops flattened) against the default configs."""
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(2)
    report = header()
    points = gemm_points(gen, {torch.float8_e4m3fn: (8192, 2048), torch.int8: (8192, 2048)})
    for name, tokens, gemm, gated, pairs, fn in points:
        default = moe.default_config(pairs, E, H if gated else I, gated)
        variants = {"default": default}
        for bm, stages in itertools.product((64, 128), (3, 4)):
            variants[f"persistent_bm{bm}_s{stages}"] = dict(
                tma=True, persistent=True, block_m=bm, block_n=128 if gated else 256, block_k=128,
                num_warps=8, num_stages=stages)
        variants["default_again"] = default
        ref = fn(default).float()
        row = dict(dtype=name, tokens=tokens, gemm=gemm, pairs=pairs)
        for label, c in variants.items():
            if time.time() - start > deadline_s:
                break
            try:
                err, us = error_and_us(fn, c, ref)
                row[label] = dict(config=c, us=round(us, 2), rel_err_vs_default=err)
            except Exception as exc:
                row[label] = failure(c, exc)
        report["rows"].append(row)
        print(name, tokens, gemm, {k: (v.get("us"), f"{v['rel_err_vs_default']:.0e}" if "us" in v
                                        else v.get("error")) for k, v in row.items() if isinstance(v, dict)},
              flush=True)
        with open(out_path, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    if "--persistent" in sys.argv[2:]:
        persistent(sys.argv[1])
    elif "--compare" in sys.argv[2:]:
        compare(sys.argv[1])
    else:
        main(sys.argv[1])
