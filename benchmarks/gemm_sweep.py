"""One GPU session for issue 3's open targets: compile/graph check, large-M GEMMs like for like,
quantization-kernel launch sweep. Ends before ``--deadline`` seconds.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_sweep.py --out $OUT --deadline 380

Parts, in order (each writes its results at once, so a time-out keeps what finished):
1. torch.compile(fullgraph=True) of a small MLP block built from the custom ops (RMSNorm+quant ->
   gated GEMM -> per-token quant -> GEMM), equal to eager, then replayed from a CUDA graph.
2. M in {1024, 4096} x Llama-3-8B shapes: bf16 F.linear; torch._scaled_mm rowwise with
   use_fast_accum True and False; torch._int_mm + epilogue; quantkit FP8 fast / promoted and
   INT8 with kernel auto / tiled / persistent. Every quantkit output is checked against
   reference.scaled_mm. CUDA-graph replay timing with an L2 flush per call (bench_graph_ms).
3. Warp-specialized persistent FP8 (guarded: may not compile on this triton).
4. Per-token and RMSNorm+quant launch variants vs the measured copy bandwidth (two timers).

The package is imported without running quantkit/__init__.py (it pulls in the whole pipeline
and its optional dependencies; the kernels need none of it).
"""

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.gemm import _rel_err, bench_graph_ms, write_results  # noqa: E402
from quantkit.kernels import gemm, gemm_tma, quant, reference, triton_ops  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = [1024, 4096]
FP8 = torch.float8_e4m3fn
T0 = time.time()


def left(deadline):
    return deadline - (time.time() - T0)


def do_bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


# ---------------------------------------------------------------------------------------------- 1


def compile_and_graph_check(out_dir):
    results = []
    torch.manual_seed(0)
    for dtype in (torch.int8, FP8):
        hidden, inter, M = 512, 1024, 512  # M >= 256: the GEMMs may take the persistent kernel
        norm_w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        w_gu, s_gu = reference.quantize_per_channel(torch.randn(2 * inter, hidden, device="cuda") * hidden**-0.5, dtype)
        w_d, s_d = reference.quantize_per_channel(torch.randn(hidden, inter, device="cuda") * inter**-0.5, dtype)

        class QuantMLPBlock(torch.nn.Module):
            def forward(self, x, residual):
                a, sa, new_residual = triton_ops.rms_norm_quant_per_token(x, norm_w, 1e-6, dtype, residual)
                h = triton_ops.gated_scaled_mm(a, w_gu, sa, s_gu, "silu", torch.bfloat16)
                a2, sa2 = triton_ops.quantize_per_token(h, dtype)
                return triton_ops.scaled_mm(a2, w_d, sa2, s_d, None, "none", torch.bfloat16) + new_residual

        block = QuantMLPBlock()
        x = torch.randn(M, hidden, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        eager = block(x, res)
        compiled = torch.compile(block, fullgraph=True)
        out_c = compiled(x, res)
        ok_compile = torch.equal(eager, out_c)
        # Capture the compiled module in a CUDA graph, replay on new inputs.
        sx, sr = x.clone(), res.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            compiled(sx, sr)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = compiled(sx, sr)
        nx, nr = torch.randn_like(x), torch.randn_like(res)
        sx.copy_(nx)
        sr.copy_(nr)
        graph.replay()
        torch.cuda.synchronize()
        ok_graph = torch.equal(static_out, block(nx, nr))
        ref = reference
        a, sa, nres = ref.rms_norm_quant_per_token(nx, norm_w, 1e-6, dtype, nr)
        h = ref.gated_scaled_mm(a, w_gu, sa, s_gu, "silu", torch.bfloat16)
        a2, sa2 = ref.quantize_per_token(h, dtype)
        err = _rel_err(static_out, ref.scaled_mm(a2, w_d, sa2, s_d, None, "none", torch.float32) + nres.float())
        row = {"check": f"compile_fullgraph_and_cuda_graph_{dtype}", "compile_equal_eager": ok_compile,
               "graph_replay_equal_eager": ok_graph, "rel_err_vs_reference": err, "M": M}
        print(row, flush=True)
        results.append(row)
    Path(out_dir, "gemm_compile_check.json").write_text(json.dumps(results, indent=1))
    return results


# ---------------------------------------------------------------------------------------------- 2


def _operands(M, N, K, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_bf16 = (torch.randn(N, K, device="cuda", generator=gen) * K**-0.5).to(torch.bfloat16)
    a, a_scale = reference.quantize_per_token(x, dtype)
    w, w_scale = reference.quantize_per_channel(w_bf16, dtype)
    return x, w_bf16, a, a_scale, w, w_scale


def gemm_point(M, N, K, timer):
    rows = []
    base = {"M": M, "N": N, "K": K, "epilogue": "plain"}
    flops = 2.0 * M * N * K

    def add(op, ms, **extra):
        rows.append({**base, "op": op, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, **extra})
        print(f"M={M:5d} N={N:5d} K={K:5d} {op:34s} {ms*1e3:8.1f}us {flops/(ms*1e-3)/1e12:7.1f} TFLOP/s "
              + " ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()), flush=True)

    x, w_bf16, *_ = _operands(M, N, K, torch.int8)
    add("bf16_F.linear", timer(lambda: F.linear(x, w_bf16)))
    for dtype_name, dtype in (("fp8", FP8), ("int8", torch.int8)):
        _, _, a, sa, w, sw = _operands(M, N, K, dtype)
        ref = reference.scaled_mm(a, w, sa, sw, None, "none", torch.float32)
        exact = reference.fp64_scaled_mm(a, w, sa, sw) if M * N <= 4096 * 6144 else None
        if dtype == FP8:
            for fast in (True, False):
                try:
                    fn = (lambda fast=fast: torch._scaled_mm(a, w.t(), scale_a=sa.view(-1, 1), scale_b=sw.view(1, -1),
                                                             out_dtype=torch.bfloat16, use_fast_accum=fast))
                    err = _rel_err(fn(), ref)
                    add(f"torch._scaled_mm_rowwise_fast_accum={fast}", timer(fn), rel_err=err)
                except RuntimeError as e:  # record, keep going
                    rows.append({**base, "op": f"torch._scaled_mm_rowwise_fast_accum={fast}", "error": str(e)[:300]})
            modes = (("fast", True), ("promoted", False))
        else:
            def int_mm():
                acc = torch._int_mm(a, w.t())
                return (acc.float() * sa.view(-1, 1) * sw.view(1, -1)).to(torch.bfloat16)

            add("torch._int_mm+epilogue", timer(int_mm), rel_err=_rel_err(int_mm(), ref))
            modes = (("exact", True),)
        for mode, fast in modes:
            for kernel in ("auto", "tiled", "persistent"):
                def ours(fast=fast, kernel=kernel):
                    return gemm.scaled_mm(a, w, sa, sw, None, "none", torch.bfloat16, fp8_fast_accum=fast, kernel=kernel)

                out = ours()
                torch.cuda.synchronize()
                err = _rel_err(out, ref)
                extra = {"rel_err": err}
                if exact is not None:
                    extra["rel_err_fp64"] = _rel_err(out, exact)
                if kernel == "auto":
                    extra["picked"] = "persistent" if M >= gemm.PERSISTENT_MIN_M else "tiled"
                bad = out.isnan().any().item() or err > 4e-3
                add(f"quantkit_{dtype_name}_{mode}_{kernel}", timer(ours), **extra, ok=not bad)
                if bad:
                    raise RuntimeError(f"quantkit {dtype_name} {mode} {kernel} wrong at M={M} N={N} K={K}: {err}")
    return rows


def autotune_picks():
    picks = {"tiled": {str(k): str(v) for k, v in getattr(gemm._scaled_mm_autotuned, "cache", {}).items()},
             "persistent": {str(k): str(v) for k, v in getattr(gemm_tma._autotuned(), "cache", {}).items()}}
    return picks


def summarize(rows):
    """Ratios per point: like-for-like FP8 and INT8, and vs bf16."""
    out = []
    for (M, N, K) in sorted({(r["M"], r["N"], r["K"]) for r in rows}):
        pt = {r["op"]: r.get("ms") for r in rows if (r["M"], r["N"], r["K"]) == (M, N, K) and "ms" in r}
        s = {"M": M, "N": N, "K": K}
        bf16 = pt.get("bf16_F.linear")
        for ours, base in (("quantkit_fp8_fast_auto", "torch._scaled_mm_rowwise_fast_accum=True"),
                           ("quantkit_fp8_promoted_auto", "torch._scaled_mm_rowwise_fast_accum=False"),
                           ("quantkit_int8_exact_auto", "torch._int_mm+epilogue")):
            if ours in pt:
                if base in pt:
                    s[f"{ours}/{base}"] = pt[base] / pt[ours]
                s[f"{ours}/bf16"] = bf16 / pt[ours]
        s["fp8_fast_best_kernel_vs_scaled_mm_fast"] = pt.get("torch._scaled_mm_rowwise_fast_accum=True", float("nan")) / min(
            pt.get("quantkit_fp8_fast_tiled", 1e9), pt.get("quantkit_fp8_fast_persistent", 1e9))
        out.append(s)
    return out


# ---------------------------------------------------------------------------------------------- 3


def warp_specialize_probe():
    res = []
    M = N = K = 4096
    _, _, a, sa, w, sw = _operands(M, N, K, FP8)
    ref = reference.scaled_mm(a, w, sa, sw, None, "none", torch.float32)
    for bm, bn, bk, warps, stages in ((128, 256, 128, 8, 3), (128, 128, 128, 4, 4), (128, 256, 64, 8, 4)):
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPILOGUE_SPLIT": 2, "WARP_SPECIALIZE": True,
               "num_warps": warps, "num_stages": stages}
        for ws in (True, False):
            cfg["WARP_SPECIALIZE"] = ws
            try:
                fn = (lambda cfg=dict(cfg): gemm.scaled_mm(a, w, sa, sw, config=cfg, kernel="persistent"))
                err = _rel_err(fn(), ref)
                ms = bench_graph_ms(fn)
                row = {"config": str(cfg), "ms": ms, "tflops": 2 * M * N * K / ms / 1e9, "rel_err": err}
            except Exception as e:  # noqa: BLE001 - a compile failure is a result here
                row = {"config": str(cfg), "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print("ws_probe", row, flush=True)
            res.append(row)
    return res


# ---------------------------------------------------------------------------------------------- 4


def copy_ceilings():
    out = {}
    for n_bytes in (256 << 20, 1 << 30):
        src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        for tname, timer in (("graph", bench_graph_ms), ("do_bench", do_bench_ms)):
            ms = timer(lambda: dst.copy_(src))
            out[f"copy_{n_bytes >> 20}MB_{tname}_gbs"] = 2 * n_bytes / (ms * 1e-3) / 1e9
        del src, dst
    print("copy", out, flush=True)
    return out


# Run 1 (H100): two passes in 4096-wide chunks won at K=14336 (per-token), nothing beat the
# whole-row RMSNorm kernel; run 2 checks the new defaults and the chunked RMSNorm kernel.
PER_TOKEN_VARIANTS = {
    "default": {},
    "single_w16": {"single_pass": True, "num_warps": 16},
    "single_w8": {"single_pass": True, "num_warps": 8},
    "2pass_c4096_w4": {"single_pass": False, "chunk_k": 4096, "num_warps": 4},
    "2pass_c4096_w8": {"single_pass": False, "chunk_k": 4096, "num_warps": 8},
    "2pass_c4096_w16": {"single_pass": False, "chunk_k": 4096, "num_warps": 16},
    "2pass_c8192_w8": {"single_pass": False, "chunk_k": 8192, "num_warps": 8},
    "2pass_c2048_w2": {"single_pass": False, "chunk_k": 2048, "num_warps": 2},
}
RMS_VARIANTS = {
    "default": {},
    "single_w16": {"chunk_k": 0, "num_warps": 16},
    "single_w8": {"chunk_k": 0, "num_warps": 8},
    "chunk1024_w4": {"chunk_k": 1024, "num_warps": 4},
    "chunk2048_w4": {"chunk_k": 2048, "num_warps": 4},
    "chunk2048_w8": {"chunk_k": 2048, "num_warps": 8},
    "chunk4096_w8": {"chunk_k": 4096, "num_warps": 8},
    "chunk4096_w16": {"chunk_k": 4096, "num_warps": 16},
}


def _close(q, s, ref_q, ref_s):
    """Same scales to 1e-6 and quantized values at most one grid step apart on < 1 % of elements."""
    from quantkit.bench.gemm import _grid_steps

    steps = _grid_steps(q, ref_q)
    return bool(((s - ref_s).abs() / ref_s).max().item() < 1e-6 and steps.max().item() <= 1
                and (steps > 0).float().mean().item() < 0.01)


def quant_sweep(deadline, ceilings):
    rows = []
    for M, K in ((4096, 14336), (16384, 14336), (4096, 4096), (16384, 4096)):
        if left(deadline) < 25:
            break
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
        weight = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn_like(x)
        for dtype_name, dtype in (("fp8", FP8), ("int8", torch.int8)):
            ref_q, ref_s = quant.quantize_per_token(x, dtype)
            rms_q, rms_s, _ = quant.rms_norm_quant_per_token(x, weight, 1e-6, dtype)
            add_q, add_s, add_r = quant.rms_norm_quant_per_token(x, weight, 1e-6, dtype, residual)
            for op, variants, n_bytes in (("quantize_per_token", PER_TOKEN_VARIANTS, M * K * 3 + M * 4),
                                          ("rms_norm_quant", RMS_VARIANTS, M * K * 3 + M * 4 + K * 2),
                                          ("add_rms_norm_quant", RMS_VARIANTS, M * K * 7 + M * 4 + K * 2)):
                for name, cfg in variants.items():
                    if op == "quantize_per_token":
                        fn = (lambda cfg=cfg: quant.quantize_per_token(x, dtype, config=cfg))
                        q, s = fn()
                        same = torch.equal(q.view(torch.int8), ref_q.view(torch.int8)) and torch.equal(s, ref_s)
                    elif op == "rms_norm_quant":
                        fn = (lambda cfg=cfg: quant.rms_norm_quant_per_token(x, weight, 1e-6, dtype, config=cfg))
                        q, s, _ = fn()
                        same = _close(q, s, rms_q, rms_s)
                    else:
                        fn = (lambda cfg=cfg: quant.rms_norm_quant_per_token(x, weight, 1e-6, dtype, residual, config=cfg))
                        q, s, r = fn()
                        same = _close(q, s, add_q, add_s) and torch.equal(r, add_r)
                    try:
                        ms_g = bench_graph_ms(fn)
                        ms_d = do_bench_ms(fn)
                    except Exception as e:  # noqa: BLE001
                        rows.append({"op": f"{op}_{dtype_name}", "variant": name, "M": M, "K": K, "error": str(e)[:200]})
                        continue
                    row = {"op": f"{op}_{dtype_name}", "variant": name, "M": M, "K": K, "bytes": n_bytes,
                           "ms_graph": ms_g, "ms_do_bench": ms_d, "gbs_graph": n_bytes / ms_g / 1e6,
                           "gbs_do_bench": n_bytes / ms_d / 1e6, "same_as_default": same}
                    row["frac_copy_graph"] = row["gbs_graph"] / ceilings["copy_1024MB_graph_gbs"]
                    row["frac_copy_do_bench"] = row["gbs_do_bench"] / ceilings["copy_1024MB_do_bench_gbs"]
                    rows.append(row)
                    print(f"{op}_{dtype_name:4s} {name:16s} M={M:5d} K={K:5d} graph {row['gbs_graph']:6.0f} GB/s "
                          f"({100*row['frac_copy_graph']:.0f}%) do_bench {row['gbs_do_bench']:6.0f} GB/s "
                          f"({100*row['frac_copy_do_bench']:.0f}%) same={same}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=380.0)
    parser.add_argument("--skip", default="")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = environment_metadata()
    # The device copy of the tree may carry a stale .git: the commit passed in wins.
    meta["commit"] = os.environ.get("QUANTKIT_COMMIT", meta["commit"])
    meta["timer"] = "bench_graph_ms (CUDA-graph replay, L2 flushed before each call)"
    print(meta, flush=True)
    if "compile" not in skip:
        try:
            compile_and_graph_check(out)
        except Exception:  # noqa: BLE001 - report and go on to the timings
            traceback.print_exc()
            Path(out, "gemm_compile_check.json").write_text(json.dumps({"error": traceback.format_exc()}))
    rows = []
    if "gemm" not in skip:
        for M in MS:
            for N, K in SHAPES:
                if left(args.deadline) < 120:
                    print("deadline: skipping GEMM point", M, N, K, flush=True)
                    continue
                rows.extend(gemm_point(M, N, K, bench_graph_ms))
                meta["summary"] = summarize(rows)
                meta["autotune"] = autotune_picks()
                write_results(rows, out, "gemm_large_m", meta)
        for s in meta.get("summary", []):
            print(json.dumps(s), flush=True)
    extra = {"meta": meta}
    if "ws" not in skip and left(args.deadline) > 90:
        extra["warp_specialize_probe"] = warp_specialize_probe()
    if "quant" not in skip and left(args.deadline) > 40:
        extra["copy"] = copy_ceilings()
        extra["quant"] = quant_sweep(args.deadline, extra["copy"])
    Path(out, "gemm_quant_sweep.json").write_text(json.dumps(extra, indent=1, default=str))
    if rows:
        try:
            from quantkit.bench.gemm import plot_tflops

            plot_tflops(rows, out / "gemm_large_m.png", f"W8A8 GEMM M>=1024, {meta['gpu']}, commit {meta['commit']}")
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    print(f"done in {time.time() - T0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
