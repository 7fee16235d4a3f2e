"""GPU check and timing of the decode GEMV (quantkit/kernels/gemv.py) against bf16 F.linear and
the tensor-core gemm.scaled_mm, at M = 1, 2, 4 and the Llama-3-8B projections.

    PYTHONUNBUFFERED=1 python benchmarks/gemv_check.py --out $OUT/gemv --deadline 540
    TRITON_INTERPRET=1 python benchmarks/gemv_check.py --out /tmp/gemv --smoke   # CPU dry run

1. Checks (raise on the first failure, before anything is timed): at M = 1..4, the four shapes
   and odd ones (K tails, N tails), INT8 and FP8, the autotuned pick and every config:
   INT8 raw accumulator equal to the float64 matmul of the int8 values (exact integers there,
   |sum| < 2**53), converted to int64; outputs (bias, silu, bf16) within one bf16 rounding plus
   the fp32 summation bound of the float64 reference; two launches bit-equal.
2. Timing, plain epilogue (per-token / per-channel scales, no bias, bf16 out), per point
   (shape, M, dtype): bf16 F.linear (cuBLAS), gemm.scaled_mm (autotuned, called a few times
   first), gemv autotuned, every GEMV config (and those of --extra-configs), and the read-only
   ceiling: ``copy.device_read`` of the same weight bytes. Two timers, ``rounds`` rounds with the op order
   rotated per round, medians: ``flush`` (CUDA-graph replay of n x (256 MB L2 flush + op) minus
   the flushes alone: quantkit.bench.gemm.adaptive_graph_ms) and ``rotate`` (a CUDA graph of
   back-to-back calls over weight copies totalling > 2x the 50 MB L2:
   quantkit.bench.gemm_splitk.rotate_timer). Reported: us, GB/s of weight bytes, x bf16, x scaled_mm.
Writes gemv_check.json / .txt under --out after every point (GPU name, versions, date).
Imports the kernels without running quantkit/__init__.py (the GPU image lacks its pipeline deps).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.kernels import copy, gemm, gemv, reference  # noqa: E402
from quantkit.kernels.launch import INTERPRETED, config_dict  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate+up, down
ODD_SHAPES = [(13, 16), (200, 1040), (96, 272), (4100, 4112)]
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
ROTATE_BYTES = 100 << 20  # 2 x the H100's 50 MB L2


# Configs outside GEMV_CONFIGS to check and time beside them (--extra-configs).
EXTRA_CONFIGS: list[dict] = []


def gemv_configs() -> list[dict]:
    return [gemv.INTERPRETER_CONFIG] if INTERPRETED else [config_dict(c) for c in gemv.GEMV_CONFIGS] + EXTRA_CONFIGS


def _quantized(M, N, K, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16)
    w_bf16 = (torch.randn(N, K, device=device, generator=gen) * K**-0.5).to(torch.bfloat16)
    a, sa = reference.quantize_per_token(x, dtype)
    w, sw = reference.quantize_per_channel(w_bf16, dtype)
    return x, w_bf16, a, sa, w, sw


# ---------------------------------------------------------------------------------------------- checks


def check_point(M, N, K, dtype_name, device, configs) -> list[dict]:
    dtype = DTYPES[dtype_name]
    _, _, a, sa, w, sw = _quantized(M, N, K, dtype, device, seed=M * 7 + N + K)
    bias = (torch.randn(N, device=device) * 0.1).to(torch.bfloat16)
    acc64 = a.double() @ w.double().t()  # exact integers for int8 (|sum| < 2**53)
    ref = reference.apply_activation(acc64 * sa.double()[:, None] * sw.double()[None, :] + bias.double(), "silu")
    # fp32 summation of exact products (tests/kernels/test_gemv.py: _fp8_bound), then one bf16 rounding.
    u = 2.0**-24
    abs_term = (a.double().abs() @ w.double().abs().t()) * (sa.double()[:, None] * sw.double()[None, :])
    bound = 1.13 * (K * u * abs_term + 8 * u * (abs_term + bias.double().abs())) + 2**-8 * ref.abs() + 1e-30
    rows = []
    for cfg in [None] + configs:
        name = "auto" if cfg is None else gemv.config_name(cfg)
        problems = []
        if dtype == torch.int8:
            acc = gemv.int8_gemv_accumulator(a, w, config=cfg)
            if not torch.equal(acc.long(), acc64.long()):
                problems.append(f"int8 acc differs in {(acc.long() != acc64.long()).sum().item()} elements")
        first = gemv.scaled_gemv(a, w, sa, sw, bias, "silu", torch.bfloat16, config=cfg)
        second = gemv.scaled_gemv(a, w, sa, sw, bias, "silu", torch.bfloat16, config=cfg)
        excess = ((first.double() - ref).abs() - bound).max().item()
        if first.isnan().any() or excess > 0:
            problems.append(f"output beyond bound by {excess:.3g}")
        if not torch.equal(first, second):
            problems.append("repeat not bit-equal")
        row = {"check": "gemv", "M": M, "N": N, "K": K, "dtype": dtype_name, "config": name,
               "ok": not problems, "problems": problems}
        rows.append(row)
        if problems:
            raise RuntimeError(f"GEMV check failed: {row}")
    return rows


def run_checks(device, smoke, deadline_left) -> list[dict]:
    configs = gemv_configs()
    rows = []
    shapes = ODD_SHAPES[:3] if smoke else ODD_SHAPES + SHAPES
    for N, K in shapes:
        for M in ((1, 3) if smoke else (1, 2, 3, 4)):
            for dtype_name in DTYPES:
                if deadline_left() < 60:
                    raise RuntimeError("deadline reached during the checks")
                rows.extend(check_point(M, N, K, dtype_name, device, configs))
        print(f"checked N={N} K={K}: {len(rows)} checks ok", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- timing


def time_point(M, N, K, dtype_name, rounds, device, timers) -> list[dict]:
    dtype = DTYPES[dtype_name]
    x, w_bf16, a, sa, w, sw = _quantized(M, N, K, dtype, device, seed=M + N + K)
    copies = max(2, -(-ROTATE_BYTES // (N * K)))
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    bf16_weights = [w_bf16] + [w_bf16.clone() for _ in range(max(1, -(-ROTATE_BYTES // (2 * N * K))) - 1)]
    sums = torch.empty(-(-N * K // (4 * copy.BLOCK)), dtype=torch.int32, device=device)

    def gemv_op(cfg):
        return lambda wq: (lambda: gemv.scaled_gemv(a, wq, sa, sw, None, "none", torch.bfloat16, config=cfg))

    ops = {"bf16_F.linear": (lambda wb: (lambda: F.linear(x, wb)), bf16_weights, 2 * N * K),
           # The cached (signature) path, as a model calls it: autotuned on its first call.
           "gemm.scaled_mm": (lambda wq: (lambda: gemm.scaled_mm(a, wq, sa, sw, None, "none", torch.bfloat16)),
                              weights, N * K),
           "gemv auto": (gemv_op(None), weights, N * K),
           # The read-only ceiling: the same weight bytes streamed in, one int32 per 16 KB out.
           "read ceiling": (lambda wq: (lambda: copy.device_read(wq, sums)), weights, N * K)}
    for cfg in gemv_configs():
        ops[f"gemv {gemv.config_name(cfg)}"] = (gemv_op(cfg), weights, N * K)
    tuned_before = set(gemv._TUNED)
    for make, ws, _ in ops.values():  # autotune / compile, then a few warm calls
        for _ in range(3):
            make(ws[0])()
    torch.cuda.synchronize()
    picks = [cfg for key, cfg in gemv._TUNED.items() if key not in tuned_before]
    pick = picks[0] if picks else None
    names = list(ops)
    samples = {(op, t): [] for op in names for t in timers}
    for t_name, timer in timers.items():
        for r in range(rounds):
            for op in names[r % len(names):] + names[:r % len(names)]:
                make, ws, _ = ops[op]
                samples[(op, t_name)].append(timer(make, ws) * 1e3)  # us
    rows = []
    for op in names:
        row = {"M": M, "N": N, "K": K, "dtype": dtype_name, "op": op, "weight_bytes": ops[op][2],
               "gemv_pick": gemv.config_name(pick) if pick and op == "gemv auto" else None}
        for t_name in timers:
            us = statistics.median(samples[(op, t_name)])
            row[f"us_{t_name}"] = us
            row[f"us_{t_name}_rounds"] = samples[(op, t_name)]
            row[f"GBps_{t_name}"] = ops[op][2] / (us * 1e-6) / 1e9
        rows.append(row)
    by_op = {r["op"]: r for r in rows}
    for row in rows:
        for t_name in timers:
            row[f"x_bf16_{t_name}"] = by_op["bf16_F.linear"][f"us_{t_name}"] / row[f"us_{t_name}"]
            row[f"x_scaled_mm_{t_name}"] = by_op["gemm.scaled_mm"][f"us_{t_name}"] / row[f"us_{t_name}"]
    del weights, bf16_weights
    return rows


def format_row(r, timers) -> str:
    cells = [f"{t} {r[f'us_{t}']:7.1f}us {r[f'GBps_{t}']:6.0f}GB/s x{r[f'x_bf16_{t}']:.2f}bf16 "
             f"x{r[f'x_scaled_mm_{t}']:.2f}mm" for t in timers]
    pick = f" [{r['gemv_pick']}]" if r.get("gemv_pick") else ""
    return f"M={r['M']} {r['N']:5d}x{r['K']:5d} {r['dtype']:4s} {r['op']:22s} {' | '.join(cells)}{pick}"


def write(out_dir: Path, meta, checks, rows, timers) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gemv_check.json").write_text(json.dumps({"meta": meta, "checks": checks, "rows": rows}, indent=1,
                                                        default=str))
    header = " ".join(f"{k}={v}" for k, v in meta.items() if not isinstance(v, (list, dict)))
    (out_dir / "gemv_check.txt").write_text(header + "\n" + "\n".join(format_row(r, timers) for r in rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--deadline", type=float, default=540.0, help="seconds from start; later points are skipped")
    parser.add_argument("--ms", default="1,2,4")
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--shapes", default=None, help="NxK,NxK,... (default: the four Llama-3-8B ones)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timers", default="flush,rotate")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--extra-configs", default="", help="GEMV configs beside GEMV_CONFIGS: BNxBKwW,... (4x4096w4)")
    parser.add_argument("--smoke", action="store_true", help="checks on tiny shapes only (CPU interpreter)")
    args = parser.parse_args()
    EXTRA_CONFIGS.extend(gemv.parse_config(c) for c in args.extra_configs.split(",") if c)
    start = time.time()

    def deadline_left() -> float:
        return args.deadline - (time.time() - start)

    device = "cpu" if INTERPRETED else "cuda"
    meta = environment_metadata()
    meta.update(configs=[gemv.config_name(c) for c in gemv_configs()], rounds=args.rounds, skipped_for_deadline=[])
    print(json.dumps({k: v for k, v in meta.items() if not isinstance(v, list)}), flush=True)
    checks = [] if args.skip_checks else run_checks(device, args.smoke, deadline_left)
    print(f"checks passed ({len(checks)}) in {time.time() - start:.0f}s", flush=True)
    if args.smoke or INTERPRETED:
        write(args.out, meta, checks, [], ())
        return
    from quantkit.bench.gemm import adaptive_graph_ms
    from quantkit.bench.gemm_splitk import rotate_timer

    all_timers = {"flush": lambda make, ws: adaptive_graph_ms(make(ws[0])), "rotate": rotate_timer}
    timers = {t: all_timers[t] for t in args.timers.split(",")}
    shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for M in (int(m) for m in args.ms.split(",")):
        for N, K in shapes:
            for dtype_name in args.dtypes.split(","):
                if deadline_left() < 40:
                    meta["skipped_for_deadline"].append(f"M={M} {N}x{K} {dtype_name}")
                    continue
                point = time_point(M, N, K, dtype_name, args.rounds, device, timers)
                rows.extend(point)
                for r in point:
                    print(format_row(r, timers), flush=True)
                write(args.out, meta, checks, rows, timers)
    write(args.out, meta, checks, rows, timers)
    print(f"done in {time.time() - start:.0f}s; skipped {meta['skipped_for_deadline']}", flush=True)


if __name__ == "__main__":
    main()
