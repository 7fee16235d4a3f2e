"""GPU checks and timing of session 43's RMSNorm + quantization kernel, and of the copy the
quantization benchmark compares against.

1. The copy. The standard runs' "same-size copy" (a graph-timed ``dst.copy_(src)`` of uint8
   buffers) read about 4.0 TB/s for some sizes and about 2.7 TB/s for others a few KB apart
   (e.g. 176,177,152 against 176,205,824 bytes). Every size is timed here with the graph timer
   twice (fresh buffers each time), in both orders, with triton's do_bench, and as a bf16 copy.
2. The whole-row RMSNorm kernel now takes the sum of squares and the amax of the weighted row in
   one reduction. Bit for bit against the torch twin run on the GPU and against the previous
   kernel (``--old``: that commit's quant.py loaded as a module of its own), random rows, rows with
   an inf or a NaN, with and without a residual, Gemma's offset, FP8 and INT8.
3. Timing at the benchmark's four shapes, ``--rounds`` rounds in rotated order, medians, with the
   quantization benchmark's timer: the new kernel, the previous one, launch variants of the new
   one (warps, a register cap), per-token quantization and copies of the same bytes.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_checks_s43.py --old old_quant.py --out $OUT/s43
"""

import argparse
import json
from pathlib import Path

from kernels_only import load_module  # quantkit without its __init__
import torch
import triton
import triton.language as tl

from quantkit.bench.common import environment_metadata
from quantkit.bench.gemm import adaptive_graph_ms
from quantkit.bench.quant import DEFAULT_SHAPES, do_bench_ms, quant_bytes
from quantkit.kernels import quant, reference
from quantkit.kernels.launch import rotated_medians

RESULTS = []
# Half the bytes each benchmark row moves (a copy of n bytes moves 2n): the sizes of the
# standard run's rows, and powers of two.
COPY_HALVES = [25165824, 25174016, 58732544, 88088576, 88102912, 205543424, 352321536, 352354304, 352368640,
               822130688, 536870912, 1073741824]


def record(name, ok, **info):
    RESULTS.append({"check": name, "ok": bool(ok), **info})
    print(f"[{'ok' if ok else 'FAILED'}] {name} {info}", flush=True)


def copy_gbs(half, timer, dtype=torch.uint8):
    src = torch.empty(half // dtype.itemsize, dtype=dtype, device="cuda")
    src.view(torch.uint8).random_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * half / (ms * 1e-3) / 1e9


def copy_study():
    rows = []
    for order in ("up", "down"):
        for half in (COPY_HALVES if order == "up" else COPY_HALVES[::-1]):
            row = {"half_bytes": half, "order": order,
                   "graph_1": copy_gbs(half, adaptive_graph_ms), "graph_2": copy_gbs(half, adaptive_graph_ms),
                   "graph_bf16": copy_gbs(half, adaptive_graph_ms, torch.bfloat16),
                   "do_bench": copy_gbs(half, do_bench_ms)}
            rows.append(row)
            print("copy", " ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                  flush=True)
    return rows


def equal(a, b):
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return bool((a == b).all())


def check_rms(old, variants):
    for M, K in [(7, 4096), (33, 14336), (5, 2048), (3, 1000)] + list(DEFAULT_SHAPES):
        g = torch.Generator(device="cuda").manual_seed(M * K)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g) * 2
        res = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.5
        if M < 64:
            x[1, 3] = float("inf")
            x[2, 5] = float("nan")
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            for residual in (None, res):
                for offset in (0.0, 1.0):
                    new = quant.rms_norm_quant_per_token(x, w, 1e-6, qdtype, residual=residual, offset=offset)
                    ref = reference.rms_norm_quant_per_token(x, w, 1e-6, qdtype, residual=residual, offset=offset)
                    prev = old.rms_norm_quant_per_token(x, w, 1e-6, qdtype, residual=residual, offset=offset)
                    for vname, vmod in variants.items():
                        got = vmod.rms_norm_quant_per_token(x, w, 1e-6, qdtype, residual=residual, offset=offset)
                        same = all(equal(a, b) for a, b in zip(got, prev) if a is not None)
                        record(f"rms {vname} = previous {str(qdtype)[6:]} {M}x{K} residual={residual is not None} "
                               f"offset={offset}", same)
                    # INT8 NaN has no code: compare the finite rows there.
                    rows = slice(3, None) if (M < 64 and qdtype == torch.int8) else slice(None)
                    ok_ref = equal(new[0][rows], ref[0][rows]) and equal(new[1], ref[1])
                    ok_old = equal(new[0], prev[0]) and equal(new[1], prev[1])
                    if residual is not None:
                        ok_ref = ok_ref and equal(new[2], ref[2])
                        ok_old = ok_old and equal(new[2], prev[2])
                    # The twin sums the squares in another order: at most one grid step apart
                    # (the standard run's GPU check); here the new kernel must equal the previous one.
                    record(f"rms {str(qdtype)[6:]} {M}x{K} residual={residual is not None} offset={offset}",
                           ok_old, twin_bit_equal=ok_ref)


def direct(mod, x, w, q, s, qdtype, residual=None, num_warps=None, maxnreg=None):
    """Module ``mod``'s whole-row kernel launched by hand, with its own warps or others, and a
    register cap (``maxnreg``) or none."""
    M, K = x.shape
    plan = mod._rms_norm_plan(K, residual is not None, qdtype, None)
    constexprs, warps = plan[2], plan[3]  # the previous quant.py returns one item fewer
    new_residual = torch.empty_like(x) if residual is not None else x
    residual = x if residual is None else residual
    options = {"maxnreg": maxnreg} if maxnreg else {}
    return lambda: mod._rms_norm_quant_kernel[(M,)](x, residual, new_residual, w, q, s, M, K, K, K, K, K, 1e-6, 0.0,
                                                    **constexprs, num_warps=num_warps or warps, num_stages=3,
                                                    **options)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask, eviction_policy="evict_first"), mask=mask,
             eviction_policy="evict_first")


def copies(half):
    """Copies of ``half`` bytes (2 x half moved): torch's (a memcpy; in a CUDA graph a memcpy
    node), a Triton kernel (16-byte accesses, 4096 int32 per program), and torch's elementwise
    conversion kernel (bf16 -> fp16, the same bytes)."""
    src = torch.empty(half // 4, dtype=torch.int32, device="cuda")
    src.view(torch.uint8).random_()
    dst = torch.empty_like(src)
    n = src.numel()
    src16 = src.view(torch.bfloat16)
    dst16 = torch.empty(src16.shape, dtype=torch.float16, device="cuda")
    return {"copy_memcpy": lambda: dst.copy_(src),
            "copy_triton": lambda: _copy_kernel[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096, num_warps=8),
            "copy_convert": lambda: dst16.copy_(src16)}


def time_rms(old, variants, rounds, sweep):
    rows = []
    for M, K in DEFAULT_SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        w = torch.randn(K, device="cuda", dtype=torch.bfloat16)
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            q = torch.empty(M, K, dtype=qdtype, device="cuda")
            s = torch.empty(M, dtype=torch.float32, device="cuda")
            n_bytes = quant_bytes("rms_norm_quant", M, K)
            res_bytes = quant_bytes("add_rms_norm_quant", M, K)
            ops = {"per_token": lambda: quant.quantize_per_token(x, qdtype)}
            # The launchers as a model calls them (their own warps and register cap).
            for name, mod in (("old", old), ("new", quant)):
                ops[f"{name}_launcher"] = lambda mod=mod: mod.rms_norm_quant_per_token(x, w, 1e-6, qdtype)
                ops[f"{name}_launcher_res"] = lambda mod=mod: mod.rms_norm_quant_per_token(x, w, 1e-6, qdtype, res)
            caps = ((None, 64, 72, 80, 96) if K > 8192 else (None, 40, 48)) if sweep else ()
            for name, mod in ({"old": old, "new": quant, **variants}.items() if sweep else ()):
                for cap in caps:
                    ops[f"{name}_r{cap or 0}"] = direct(mod, x, w, q, s, qdtype, maxnreg=cap)
                ops[f"{name}_res"] = direct(mod, x, w, q, s, qdtype, residual=res)
            ops.update(copies(n_bytes // 2))
            ops.update({f"{k}_res": v for k, v in copies(res_bytes // 2).items()})
            medians, times = rotated_medians(ops, adaptive_graph_ms, rounds)
            for name, ts in times.items():
                ms = medians[name]
                moved = (quant_bytes("quantize_per_token", M, K) if name == "per_token" else
                         res_bytes if name.endswith("_res") else n_bytes)
                if name.startswith("copy"):
                    moved = 2 * ((res_bytes if name.endswith("_res") else n_bytes) // 2)
                rows.append({"M": M, "K": K, "dtype": str(qdtype)[6:], "op": name, "us": ms * 1e3,
                             "gbs": moved / (ms * 1e-3) / 1e9, "samples_us": [t * 1e3 for t in ts]})
            for name in ("copy_memcpy", "copy_triton", "copy_convert"):
                ms = do_bench_ms(ops[name])
                rows.append({"M": M, "K": K, "dtype": str(qdtype)[6:], "op": f"{name}_do_bench", "us": ms * 1e3,
                             "gbs": 2 * (n_bytes // 2) / (ms * 1e-3) / 1e9})
            print(M, K, qdtype, " ".join(f"{r['op']}={r['us']:.1f}us/{r['gbs']:.0f}" for r in rows
                                         if r["M"] == M and r["K"] == K and r["dtype"] == str(qdtype)[6:]),
                  flush=True)
    return rows


PER_TOKEN_CONFIGS = {  # K = 14336; "launcher" is the launch default of the code being run
    "launcher": None,
    "chunked_w16": {"single_pass": False, "chunk_k": 8192, "num_warps": 16, "evict": True},
    "chunked_w8": {"single_pass": False, "chunk_k": 8192, "num_warps": 8, "evict": True},
    "whole_w8": {"single_pass": True, "num_warps": 8, "evict": True},
    "whole_w8_keep": {"single_pass": True, "num_warps": 8, "keep_input_dtype": True, "evict": True},
    "whole_w8_keep_noevict": {"single_pass": True, "num_warps": 8, "keep_input_dtype": True, "evict": False},
}


def per_token_round(rounds):
    """Per-token launch configurations at long rows: bit for bit against the twin on the GPU
    (random rows, a NaN row, an inf, a zero row), then timed in rotated rounds."""
    for M, K in [(5, 9000), (7, 14336), (3, 16384), (4096, 14336)]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
        x[0, 7] = float("nan")
        x[1, 2] = float("inf")
        x[2] = 0
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            ref_q, ref_s = reference.quantize_per_token(x, qdtype)
            for name, cfg in PER_TOKEN_CONFIGS.items():
                q, s = quant.quantize_per_token(x, qdtype, config=cfg)
                # Rows 3 on: bit for bit. The NaN and inf rows: their NaN / inf scales (the codes of
                # a row that is not finite are unspecified, reference.py; run b compared FP8 NaN
                # positions, and the kernels' x * (1 / inf) correction makes the whole row NaN
                # where the twin has zeros). The zero row: MIN_SCALE and zeros.
                edge_ok = equal(s, ref_s) and equal(q[2], ref_q[2])
                record(f"per-token {name} {str(qdtype)[6:]} {M}x{K}", equal(q[3:], ref_q[3:]) and edge_ok)
    rows_out = []
    for M, K in [(4096, 14336), (16384, 14336)]:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for qdtype in (torch.int8, torch.float8_e4m3fn):
            ops = {name: (lambda cfg=cfg: quant.quantize_per_token(x, qdtype, config=cfg))
                   for name, cfg in PER_TOKEN_CONFIGS.items()}
            ops.update({f"copy_{k}": v for k, v in copies(quant_bytes("quantize_per_token", M, K) // 2).items()
                        if k != "copy_convert"})
            medians, times = rotated_medians(ops, adaptive_graph_ms, rounds)
            for name, ts in times.items():
                ms = medians[name]
                moved = quant_bytes("quantize_per_token", M, K)
                rows_out.append({"M": M, "K": K, "dtype": str(qdtype)[6:], "op": name, "us": ms * 1e3,
                                 "gbs": moved / (ms * 1e-3) / 1e9, "samples_us": [t * 1e3 for t in ts]})
            print("per-token", M, K, qdtype, " ".join(f"{r['op']}={r['us']:.1f}us/{r['gbs']:.0f}" for r in rows_out
                                                      if r["M"] == M and r["dtype"] == str(qdtype)[6:]), flush=True)
    return rows_out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", help="the previous commit's quantkit/kernels/quant.py (required but with --per-token)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-copy", action="store_true")
    parser.add_argument("--per-token", action="store_true",
                        help="only the per-token round: long-row launch configurations, checked and timed")
    parser.add_argument("--sweep", action="store_true",
                        help="also each module's kernel launched by hand with register caps, and with a residual")
    parser.add_argument("--variant", action="append", default=[], help="NAME=path of another quant.py to time")
    args = parser.parse_args()
    if args.per_token:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"meta": environment_metadata(), "per_token_timing": per_token_round(args.rounds), "checks": RESULTS}
        (out / "gpu_checks_s43_per_token.json").write_text(json.dumps(result, indent=1))
        failed = [r for r in RESULTS if not r["ok"]]
        print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed", flush=True)
        raise SystemExit(1 if failed else 0)
    if not args.old:
        parser.error("--old is required (but with --per-token)")
    old = load_module(args.old, "quant_old")
    variants = {spec.split("=")[0]: load_module(spec.split("=")[1], "quant_" + spec.split("=")[0])
                for spec in args.variant}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check_rms(old, variants)
    result = {"meta": environment_metadata(), "checks": RESULTS}
    result["copies"] = [] if args.skip_copy else copy_study()
    (out / "gpu_checks_s43.json").write_text(json.dumps(result, indent=1))
    result["rms_timing"] = time_rms(old, variants, args.rounds, args.sweep)
    (out / "gpu_checks_s43.json").write_text(json.dumps(result, indent=1))
    failed = [r for r in RESULTS if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
