"""Session 5, issue 4: a real margin over SDPA for decode attention at batch 8, 32k (was parity).

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/attention_s5.py --out $OUT/attn --deadline 200
    TRITON_INTERPRET=1 python benchmarks/attention_s5.py --smoke --out /tmp/s5   (CPU: no Python errors)

Shapes: 32 query / 8 kv heads, d=128, bf16 cache (B, 8, L, 128), q (B, 32, 128); SDPA (default
backend, ``enable_gqa=True``) on q (B, 32, 1, 128) is the baseline, as in NOTES-attention.md.

The question: does the balanced persistent schedule (``DecodeConfig(schedule="flat")``: one
program per resident slot, all the filled blocks cut evenly over 132 SMs, ranges not aligned to
(batch, kv head)) beat session 4's default (split grid: 2 splits x 64 = 128 programs on 132 SMs
at batch 8 32k), and which tile / stages / min_blocks for it. Same method as session 4's attention_s4.py (removed; `git show ad866fc:benchmarks/attention_s4.py`):

1. Every variant against the fp32 torch twin on the GPU (batch 8 over a sliced cache with random
   lengths incl. 0, 1 and the capacity; a CUDA graph replayed with new lengths, counters back at
   zero, replay bit-identical to an eager call; batch 1 at 32k and 1k caches; a sliding window).
   In ``--workers`` processes (they compile everything and fill Triton's disk cache).
2. Per point: SDPA and every variant in their own CUDA graph of n back-to-back calls, replayed in
   interleaved rounds (rotating order); median us, ratio SDPA / variant, ratio over each half of
   the rounds. Batch 8 32k first, then the other long caches, short ones, two partially filled
   caches (4k of 32k: SDPA gets the 4k slice, ours the whole cache with lengths 4k, as generate's
   captured decode does), and batch 8 32k once more at the end (the repeat).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kernels_only import ROOT  # noqa: E402  (quantkit without its __init__)
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.kernels import attention_decode, reference_attention  # noqa: E402
from quantkit.kernels.attention_decode import DecodeConfig  # noqa: E402

T0 = time.time()
N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
# (batch, length, capacity): long caches first, then short, then a cache 8x its length.
POINTS = [(8, 32768, 32768), (1, 32768, 32768), (8, 16384, 16384), (1, 16384, 16384),
          (8, 8192, 8192), (1, 8192, 8192), (8, 4096, 4096), (1, 4096, 4096),
          (8, 1024, 1024), (1, 1024, 1024), (1, 4096, 32768), (8, 4096, 32768), (8, 32768, 32768)]
RUN1_VARIANTS = {  # experiment run 1 (commit 9d305fd): flat lost everywhere but 4k of 32k at B=1
    "s4_default": DecodeConfig(128, 4, 3, 1, loads="tma", split_by_fill=False),  # run 1 predates split_by_fill
    "tma_st4": DecodeConfig(128, 4, 4, 1, loads="tma", split_by_fill=False),
    "flat": DecodeConfig(128, 4, 3, 1, loads="tma", schedule="flat", min_blocks=2),
    "flat_mb1": DecodeConfig(128, 4, 3, 1, loads="tma", schedule="flat", min_blocks=1),
    "flat_mb8": DecodeConfig(128, 4, 3, 1, loads="tma", schedule="flat", min_blocks=8),
    "flat_st4": DecodeConfig(128, 4, 4, 1, loads="tma", schedule="flat", min_blocks=2),
    "flat_sm2": DecodeConfig(128, 4, 2, 2, loads="tma", schedule="flat", min_blocks=2),
    "flat_n64_sm2": DecodeConfig(64, 4, 3, 2, loads="tma", schedule="flat", min_blocks=2),
    "flat_n64_sm3": DecodeConfig(64, 4, 3, 3, loads="tma", schedule="flat", min_blocks=2),
    "flat_mb4": DecodeConfig(128, 4, 3, 1, loads="tma", schedule="flat", min_blocks=4),
}
# Run 2: the split kernel with its splits cut over the filled blocks (split_by_fill) vs session 4's
# default; fewer / more bytes in flight (2 stages, 256-key tiles) and 8 warps for the batch-8 32k margin.
VARIANTS = {
    "s4_default": DecodeConfig(128, 4, 3, 1, loads="tma", split_by_fill=False),
    "fill": DecodeConfig(128, 4, 3, 1, loads="tma"),
    "fill_st2": DecodeConfig(128, 4, 2, 1, loads="tma"),
    "fill_w8": DecodeConfig(128, 8, 3, 1, loads="tma"),
    "fill_n256": DecodeConfig(256, 4, 2, 1, loads="tma"),
    "fill_n256_w8": DecodeConfig(256, 8, 2, 1, loads="tma"),
    "flat": DecodeConfig(128, 4, 3, 1, loads="tma", schedule="flat", min_blocks=2),
}
VARIANT_SETS = {"run1": RUN1_VARIANTS, "run2": VARIANTS}
WINDOW_CHECKED = ("s4_default", "fill", "fill_n256", "flat", "flat_n64_sm2")  # a window changes the kernels' key ranges
CHECK_LIMIT = 1e-2  # bf16 inputs: ~2-3e-3 expected vs the fp32 twin


def left(deadline: float) -> float:
    return deadline - (time.time() - T0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def write_json(path: Path, rows) -> None:
    path.write_text(json.dumps(rows, indent=1, default=str))


def kernel_stats() -> dict:
    """id -> (n_regs, shared bytes, num_warps, num_stages) of every compiled split kernel."""
    stats = {}
    try:
        for fn in (attention_decode._decode_split_kernel, attention_decode._decode_flat_kernel):
            for kernel in (k for cache in fn.device_caches.values() for k in cache[0].values()):
                meta = kernel.metadata
                stats[id(kernel)] = dict(n_regs=getattr(kernel, "n_regs", None), shared=meta.shared,
                                         num_warps=meta.num_warps, num_stages=meta.num_stages)
    except Exception as exc:  # the cache layout differs between triton versions: stats are optional
        stats["error"] = f"{type(exc).__name__}: {exc}"
    return stats


def programs_per_sm(stat: dict) -> int | None:
    """Resident programs per SM that a kernel's shared memory and registers allow (Hopper)."""
    if not isinstance(stat, dict) or stat.get("n_regs") is None:
        return None
    by_smem = (228 * 1024) // (stat["shared"] + 1024)
    by_regs = 65536 // (math.ceil(stat["n_regs"] / 8) * 8 * 32 * stat["num_warps"])
    return min(by_smem, by_regs, 32)


class Harness:
    """Shapes, dtype and timer for the GPU run, or tiny ones for the CPU smoke test."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda"
        self.dtype = torch.bfloat16
        self.heads = (4, 2, 64) if smoke else (N_Q_HEADS, N_KV_HEADS, HEAD_DIM)

    def randn(self, *shape):
        return torch.randn(*shape, device=self.device, dtype=self.dtype)

    def sync(self):
        if not self.smoke:
            torch.cuda.synchronize()

    def decode(self, config, q, k, v, seqlens, window=None):
        scale = q.shape[-1] ** -0.5
        return attention_decode.decode_attention(q, k, v, seqlens, scale, window, block_config=config)

    def reference(self, q, k, v, seqlens, window=None):
        scale = q.shape[-1] ** -0.5
        return reference_attention.decode_attention(q.float(), k.float(), v.float(), seqlens, scale, window)

    def graphs(self, fns: dict, calls: int) -> dict:
        """name -> replay(): one CUDA graph of ``calls`` back-to-back calls per fn."""
        if self.smoke:
            return {name: (lambda fn=fn: [fn() for _ in range(calls)]) for name, fn in fns.items()}
        replays = {}
        for name, fn in fns.items():
            fn()
            fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
            replays[name] = graph.replay
        torch.cuda.synchronize()
        return replays

    def time_replay(self, replay) -> float:
        """Milliseconds of one replay."""
        if self.smoke:
            start = time.perf_counter()
            replay()
            return (time.perf_counter() - start) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


# ---------------------------------------------------------------------------------------------- 1


def check_variants(h: Harness, variants: dict, out_file: Path, deadline: float) -> dict:
    """name -> list of check rows; a variant with a failed check or an exception is marked failed."""
    hq, hkv, d = h.heads
    results = {}
    gen = torch.Generator(device=h.device).manual_seed(0)
    cap8 = 300 if h.smoke else 20000
    buffer_rows = 320 if h.smoke else 20480
    k8 = torch.randn(8, hkv, buffer_rows, d, device=h.device, dtype=h.dtype, generator=gen)[:, :, :cap8]
    v8 = torch.randn(8, hkv, buffer_rows, d, device=h.device, dtype=h.dtype, generator=gen)[:, :, :cap8]
    q8 = h.randn(8, hq, d)
    cap1 = 200 if h.smoke else 32000  # 32 splits, as at the timing points (same specialization)
    k1, v1, q1 = h.randn(1, hkv, cap1, d), h.randn(1, hkv, cap1, d), h.randn(1, hq, d)
    cap1s = 96 if h.smoke else 1024  # the 1k timing point's split count (its own compiled kernel)
    k1s, v1s = h.randn(1, hkv, cap1s, d), h.randn(1, hkv, cap1s, d)
    capw = 150 if h.smoke else 5000
    kw, vw, qw = h.randn(2, hkv, capw, d), h.randn(2, hkv, capw, d), h.randn(2, hq, d)

    def lengths8():
        lens = torch.randint(1, cap8 + 1, (8,), generator=torch.Generator().manual_seed(len(results)))
        lens[0], lens[1], lens[2] = 1, cap8, 0
        return lens.to(torch.int32).to(h.device)

    for name, config in variants.items():
        if left(deadline) < 30:
            print(f"check {name}: skipped, {left(deadline):.0f} s left", flush=True)
            continue
        rows = []

        def record(check, err):
            ok = err == err and err < CHECK_LIMIT
            rows.append({"variant": name, "check": check, "rel_err": err, "ok": ok})
            print(f"check {name:15s} {check:44s} rel_err={err:.2e} {'ok' if ok else 'FAIL'}", flush=True)

        start = time.time()
        before = kernel_stats()
        try:
            seqlens = lengths8()
            record("b8 sliced cap%d random lengths" % cap8,
                   rel_err(h.decode(config, q8, k8, v8, seqlens), h.reference(q8, k8, v8, seqlens)))
            if not h.smoke:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = h.decode(config, q8, k8, v8, seqlens)
                worst = 0.0
                for replay in range(3):
                    seqlens.copy_(torch.randint(1, cap8 + 1, (8,), device=h.device, dtype=torch.int32))
                    graph.replay()
                    worst = max(worst, rel_err(captured, h.reference(q8, k8, v8, seqlens)))
                record("b8 graph replays x3 new lengths", worst)
                eager = h.decode(config, q8, k8, v8, seqlens)
                again = h.decode(config, q8, k8, v8, seqlens)
                record("b8 eager == graph replay == eager, bitwise",
                       float(not (torch.equal(eager, captured) and torch.equal(eager, again))))
                counters = attention_decode._GROUP_COUNTERS[q8.device]
                record("arrival counters zero after replays", float(counters.abs().sum().item()))
                del graph, captured
            for kb, vb in ((k1, v1), (k1s, v1s)):
                cap = kb.shape[2]
                seqlens1 = torch.randint(cap // 2, cap + 1, (1,), dtype=torch.int32).to(h.device)
                record("b1 cap%d random length" % cap,
                       rel_err(h.decode(config, q1, kb, vb, seqlens1), h.reference(q1, kb, vb, seqlens1)))
            if name in WINDOW_CHECKED:
                seqlensw = torch.tensor([capw, capw // 3 + 1], dtype=torch.int32).to(h.device)
                window = capw // 5 + 3
                record("b2 window %d" % window, rel_err(h.decode(config, qw, kw, vw, seqlensw, window),
                                                        h.reference(qw, kw, vw, seqlensw, window)))
        except Exception as exc:  # a variant that does not compile on this triton is skipped, not fatal
            rows.append({"variant": name, "check": "exception", "error": f"{type(exc).__name__}: {exc}"[:2000],
                         "ok": False})
            print(f"check {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        h.sync()
        new = [st for key, st in kernel_stats().items() if key not in before and isinstance(st, dict)]
        rows.append({"variant": name, "check": "compiled kernels", "ok": all(r["ok"] for r in rows),
                     "compiled": new, "programs_per_sm_fit": [programs_per_sm(st) for st in new],
                     "programs_per_sm_planned": config.programs_per_sm, "seconds": time.time() - start})
        print(f"check {name}: {time.time() - start:.1f} s (compiles included); fit per SM "
              f"{[programs_per_sm(st) for st in new]} (planned {config.programs_per_sm}); "
              f"{[(st['n_regs'], st['shared']) for st in new]} (regs, shared B)", flush=True)
        results[name] = rows
        write_json(out_file, results)
    return results


def check_in_workers(variants: dict, workers: int, smoke: bool, out_dir: Path, deadline: float,
                     variant_set: str = "run2") -> dict:
    """Run the checks in parallel processes, a few variants each. The compiles dominate (~2-3 s per
    kernel, ~45 kernels) and Triton writes compiled kernels to its on-disk cache, so the timing
    process then loads them instead of compiling them one after another."""
    names = list(variants)
    groups = [names[i::workers] for i in range(workers) if names[i::workers]]
    procs = []
    for index, group in enumerate(groups):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--check-worker", str(index), "--variant-set", variant_set,
               "--variants", *group,
               "--out", str(out_dir), "--deadline", str(max(left(deadline) - 25, 10))]
        if smoke:
            cmd.append("--smoke")
        log = open(out_dir / f"check_worker{index}.log", "w")
        procs.append((index, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    results = {}
    for index, proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, left(deadline) - 20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        log_path = out_dir / f"check_worker{index}.log"
        print(log_path.read_text(), end="", flush=True)  # into the run's stdout log
        log_path.unlink()
        part = out_dir / f"attention_s5_checks_worker{index}.json"
        if part.exists():
            results.update(json.loads(part.read_text()))
            part.unlink()  # merged into attention_s5_checks.json (fewer files to bring back)
    return results


# ---------------------------------------------------------------------------------------------- 2


def time_point(h: Harness, batch: int, length: int, capacity: int, variants: dict, deadline: float,
               rounds: int, replay_ms: float) -> list[dict]:
    hq, hkv, d = h.heads
    gen = torch.Generator(device=h.device).manual_seed(batch * 100003 + length)
    q = torch.randn(batch, hq, d, device=h.device, dtype=h.dtype, generator=gen)
    k = torch.randn(batch, hkv, capacity, d, device=h.device, dtype=h.dtype, generator=gen)
    v = torch.randn(batch, hkv, capacity, d, device=h.device, dtype=h.dtype, generator=gen)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=h.device)
    q4, k_len, v_len = q[:, :, None], k[:, :, :length], v[:, :, :length]

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_len, v_len, enable_gqa=True)

    want = sdpa()[:, :, 0]
    fns, info = {"sdpa": sdpa}, {}
    for name, config in variants.items():
        if left(deadline) < 12:
            print(f"  B={batch} L={length}: {name} skipped ({left(deadline):.0f} s left)", flush=True)
            continue
        before = kernel_stats()
        start = time.time()
        try:
            fn = (lambda config=config: h.decode(config, q, k, v, seqlens))
            err = rel_err(fn()[:, :], want)
            h.sync()
        except Exception as exc:
            print(f"  B={batch} L={length}: {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        new = [s for key, s in kernel_stats().items() if key not in before and isinstance(s, dict)]
        info[name] = {"rel_err_vs_sdpa": err, "first_call_s": time.time() - start, "compiled": new,
                      "programs_per_sm_fit": [programs_per_sm(s) for s in new]}
        if not err < CHECK_LIMIT:
            print(f"  B={batch} L={length}: {name} rel_err {err:.2e} vs SDPA: not timed", flush=True)
            continue
        fns[name] = fn
    bytes_read = 2.0 * batch * hkv * length * d * 2
    est_us = bytes_read / 2.8e6 + 4.0  # ~2.8 TB/s plus a few us of fixed cost
    calls = 2 if h.smoke else max(3, min(600, int(replay_ms * 1e3 / est_us)))
    replays = h.graphs(fns, calls)
    names = list(replays)
    per_call = {name: [] for name in names}
    # Rounds that fit in the time left (each replays every graph once).
    round_s = max(len(names) * max(est_us * calls * 1e-6, 1e-4), 1e-3)
    rounds = max(2, min(rounds, int((left(deadline) - 8) / round_s)))
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            per_call[name].append(h.time_replay(replays[name]) * 1e3 / calls)
    del replays
    half = rounds // 2
    sdpa_all = per_call["sdpa"]
    rows = []
    for name in names:
        times = per_call[name]
        round_ratios = [s / t for s, t in zip(sdpa_all, times)]
        row = {
            "batch": batch, "seq": length, "capacity": capacity, "variant": name, "calls_per_graph": calls,
            "rounds": rounds, "us": statistics.median(times), "us_min": min(times),
            "sdpa_us": statistics.median(sdpa_all),
            "ratio": statistics.median(sdpa_all) / statistics.median(times),
            "ratio_first_half": statistics.median(sdpa_all[:half]) / statistics.median(times[:half]),
            "ratio_second_half": statistics.median(sdpa_all[half:]) / statistics.median(times[half:]),
            "round_ratio_min": min(round_ratios), "round_ratio_max": max(round_ratios),
            "gbps": bytes_read / (statistics.median(times) * 1e-6) / 1e9,
            "config": str(variants.get(name, "torch SDPA default backend, enable_gqa=True")),
            **info.get(name, {}),
        }
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> str:
    names = []
    for row in rows:
        if row["variant"] not in names:
            names.append(row["variant"])
    lines = ["ratio = SDPA us / variant us (median of interleaved graph replays); [first half, second half]",
             f"{'point':>22s} {'SDPA us':>8s} " + " ".join(f"{n:>20s}" for n in names if n != "sdpa")]
    points = []
    for row in rows:
        key = (row["batch"], row["seq"], row["capacity"], row.get("repeat", 0))
        if key not in points:
            points.append(key)
    for key in points:
        at = {r["variant"]: r for r in rows if (r["batch"], r["seq"], r["capacity"], r.get("repeat", 0)) == key}
        label = (f"B={key[0]} L={key[1]}" + (f" cap={key[2]}" if key[2] != key[1] else "")
                 + (f" #{key[3] + 1}" if key[3] else ""))
        cells = []
        for n in names:
            if n == "sdpa":
                continue
            r = at.get(n)
            cells.append(f"{r['ratio']:.3f} [{r['ratio_first_half']:.3f},{r['ratio_second_half']:.3f}]"
                         if r else f"{'-':>20s}")
        sdpa_us = at["sdpa"]["us"] if "sdpa" in at else float("nan")
        lines.append(f"{label:>22s} {sdpa_us:8.1f} " + " ".join(f"{c:>20s}" for c in cells))
    lines.append("best variant per point (ratio, min of halves):")
    for key in points:
        at = [r for r in rows if (r["batch"], r["seq"], r["capacity"], r.get("repeat", 0)) == key
              and r["variant"] != "sdpa"]
        if at:
            best = max(at, key=lambda r: min(r["ratio_first_half"], r["ratio_second_half"]))
            lines.append(f"  B={key[0]} L={key[1]} cap={key[2]} #{key[3] + 1}: {best['variant']} {best['ratio']:.4f} "
                         f"(halves {best['ratio_first_half']:.4f}/{best['ratio_second_half']:.4f}, "
                         f"{best['gbps']:.0f} GB/s)")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/attention_s5"))
    parser.add_argument("--deadline", type=float, default=200.0, help="stop before this many seconds")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes: no Python errors")
    parser.add_argument("--rounds", type=int, help="interleaved replay rounds per point (default 12; smoke 2)")
    parser.add_argument("--replay-ms", type=float, default=3.0, help="GPU time of one graph replay")
    parser.add_argument("--variant-set", choices=sorted(VARIANT_SETS), default="run2")
    parser.add_argument("--variants", nargs="+", help="subset of the set's variants (default: all)")
    parser.add_argument("--workers", type=int, default=6, help="check (and compile) in this many processes; 0: here")
    parser.add_argument("--check-worker", type=int, help=argparse.SUPPRESS)  # internal: one check process
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    h = Harness(args.smoke)
    rounds = args.rounds or (2 if args.smoke else 12)
    chosen = VARIANT_SETS[args.variant_set]
    variants = {n: chosen[n] for n in (args.variants or chosen)}
    if args.check_worker is not None:
        check_variants(h, variants, out_dir / f"attention_s5_checks_worker{args.check_worker}.json", args.deadline)
        return
    meta = environment_metadata()
    meta.update(points=[list(p) for p in POINTS], variants={n: str(c) for n, c in variants.items()},
                variant_set=args.variant_set)
    if not args.smoke:
        meta["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    write_json(out_dir / "attention_s5_meta.json", meta)
    print(f"{meta['gpu']} torch {meta['torch']} triton {meta['triton']} commit {meta['commit']}", flush=True)

    if args.workers > 0:
        checks = check_in_workers(variants, args.workers, args.smoke, out_dir, args.deadline, args.variant_set)
    else:
        checks = check_variants(h, variants, out_dir / "attention_s5_checks.json", args.deadline)
    write_json(out_dir / "attention_s5_checks.json", checks)
    passed = {n: c for n, c in variants.items() if checks.get(n) and all(r["ok"] for r in checks[n])}
    print(f"checked in {time.time() - T0:.0f} s; timing {list(passed)}", flush=True)

    points = [(1, 64, 64), (2, 130, 130), (1, 100, 400), (1, 64, 64)] if args.smoke else POINTS
    rows = []
    seen = {}
    for batch, length, capacity in points:
        if left(args.deadline) < 20:
            print(f"stop before B={batch} L={length}: {left(args.deadline):.0f} s left", flush=True)
            break
        start = time.time()
        point_rows = time_point(h, batch, length, capacity, passed, args.deadline, rounds, args.replay_ms)
        repeat = seen.get((batch, length, capacity), 0)
        seen[(batch, length, capacity)] = repeat + 1
        for r in point_rows:
            r["repeat"] = repeat
        rows.extend(point_rows)
        write_json(out_dir / "attention_s5_points.json", [{**r, **{k: meta[k] for k in ("gpu", "commit")}}
                                                           for r in rows])
        sdpa_us = next(r["us"] for r in point_rows if r["variant"] == "sdpa")
        line = " ".join(f"{r['variant']}={r['ratio']:.3f}" for r in point_rows if r["variant"] != "sdpa")
        print(f"B={batch} L={length} cap={capacity} ({time.time() - start:.1f} s): SDPA {sdpa_us:.1f} us; {line}",
              flush=True)
        if not args.smoke:
            torch.cuda.empty_cache()
    summary = summarize(rows) if rows else "no timing rows"
    (out_dir / "attention_s5_summary.txt").write_text(summary + "\n")
    print(summary, flush=True)
    print(f"elapsed {time.time() - T0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
