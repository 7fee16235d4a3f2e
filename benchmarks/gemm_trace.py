"""Where does a Gluon GEMM tile's time go? Per-tile SM-clock timestamps from inside the kernel (session 14).

    PYTHONUNBUFFERED=1 python benchmarks/gemm_trace.py --out $OUT/trace [--configs coop2_128x256_g16,pp_128x128]

The cooperative FP8 kernel needs ~3.5k cycles per 128x256 tile beyond its MMAs (ncu, NOTES-gemm
sessions 13-14), and shortening its epilogue did not move that. This builds a traced copy of
quantkit/kernels/gemm_gluon.py at run time (the source with a few lines added, each substitution
checked; nothing of it is kept) in which every consumer warpgroup reads ``%clock64`` at five points
of every tile and stores them to a trace buffer:

    t0 tile start (before the ping-pong turn wait)   t1 the tile's first K slice has landed
    t2 the last MMA is issued                         t3 every MMA has retired (wait 0)
    t4 the tile's output is stored (TMA stores issued)

Per config and point it reports, over all tiles of all programs, the median and mean cycles of
first-data wait (t1 - t0), mainloop (t2 - t1), drain (t3 - t2), epilogue (t4 - t3) and the gap to
the consumer's next tile (t0' - t4), against the MMA cycles a tile needs at the dense FP8 rate
(4096 MACs per SM per cycle), and the first-data wait split into tiles that start a program (cold)
and the rest. Also the traced kernel's time against the untraced one (CUDA events, median of 20).
Session 19 added per-consumer means, the split tile's two halves against each other (tail_order),
per-program stamps (entry, the loader's or the prologue's first copy, each consumer's exit after
its last stores read the staging: these stores delay the first data, whose times are then not
the untraced kernel's) and CUPTI kernel times of the untraced kernel and of ``_scaled_mm``.
``--configs`` takes ``name+field=value`` for a variant of a config.
FP8, plain epilogue, H100 only. Writes gemm_trace.json / .txt.
"""

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from kernels_only import ROOT, load_module  # noqa: E402  (quantkit without its __init__)

import torch  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.gemm import _FLUSH_BYTES, _make_operands  # noqa: E402
from quantkit.kernels import gemm_gluon, reference  # noqa: E402

POINTS = [(4096, 28672, 4096), (16384, 6144, 4096), (16384, 4096, 4096)]
EVENTS = ("first_data", "mainloop", "drain", "epilogue")
MAX_TILES = 64  # per consumer and program, as the traced kernel indexes its buffer
# Where the traced kernel stores program p's four stamps (entry, consumer 0 / 1 exit, first copy):
# after the tile stamps of two consumers per program.
PROGRAM_STAMPS = f"trace_ptr + gl.num_programs(0) * {2 * MAX_TILES * 5} + gl.program_id(0) * 4"

# (old, new, count): the lines added to gemm_gluon.py for the traced copy.
SUBSTITUTIONS = [
    ("                            num_experts, CONSUMER: gl.constexpr,",
     "                            num_experts, trace_ptr, CONSUMER: gl.constexpr,", 1),
    ("    @gluon.jit\n    def _halves(x):",
     "    @gluon.jit\n    def _clock(dummy):\n"
     "        return gl.inline_asm_elementwise(\"mov.u64 $0, %clock64;\", \"=l,r\", [dummy], dtype=gl.int64,\n"
     "                                         is_pure=False, pack=1)\n\n"
     "    @gluon.jit\n    def _halves(x):", 1),
    ("            step = local * k_steps\n",
     "            step = local * k_steps\n            t0 = _clock(tile)\n            t1 = t0\n", 1),
    ("                mbarrier.wait(ready_bars.index(slot), phase)\n                if busy:",
     "                mbarrier.wait(ready_bars.index(slot), phase)\n                if ki == 0:\n"
     "                    t1 = _clock(ki)\n                if busy:", 1),
    ("            rows = off_m + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, mma_layout))\n",
     "            t2 = _clock(tile)\n            rows = off_m + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, mma_layout))\n", 1),
    ("            mbarrier.arrive(empty_bars.index((step + STAGES - 1) % STAGES))\n            local += TURNS\n",
     "            mbarrier.arrive(empty_bars.index((step + STAGES - 1) % STAGES))\n            t3 = _clock(tile)\n"
     "            local += TURNS\n", 1),
    ("                acc = x.to(acc_dtype, bitcast=True)\n        tma.store_wait(0)",
     "                acc = x.to(acc_dtype, bitcast=True)\n"
     "            t4 = _clock(tile)\n"
     "            n_tile = (local - TURNS) // TURNS\n"
     f"            base = trace_ptr + ((gl.program_id(0) * CONSUMERS + CONSUMER) * {MAX_TILES} + n_tile) * 5\n"
     f"            if n_tile < {MAX_TILES}:\n"
     "                gl.store(base + 0, t0)\n                gl.store(base + 1, t1)\n"
     "                gl.store(base + 2, t2)\n                gl.store(base + 3, t3)\n"
     "                gl.store(base + 4, t4)\n        tma.store_wait(0)\n"
     f"        gl.store({PROGRAM_STAMPS} + 1 + CONSUMER, _clock(M))", 1),
    # Program events: kernel entry, each consumer's exit (after its last stores have read the
    # staging), the loader's first TMA issue; after the tile events of two consumers per program.
    ("        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)\n",
     f"        gl.store({PROGRAM_STAMPS}, _clock(M))\n"
     "        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)\n", 1),
    ("    def _load_partition(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K,",
     "    def _load_partition(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K, trace_ptr,", 1),
    ("(_load_partition, (a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K,\n",
     "(_load_partition, (a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, empty_bars, M, N, K, trace_ptr,\n",
     4),
    # The first copy: the loader's, or the prologue's (prologue_loads).
    ("                    _load_step(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, slot, off_m, w_row, ki, N, GATED)\n",
     "                    if step == 0:\n"
     f"                        gl.store({PROGRAM_STAMPS} + 3, _clock(M))\n"
     "                    _load_step(a_desc, w_desc, a_bufs, w_bufs, u_bufs, ready_bars, slot, off_m, w_row, ki, N, GATED)\n",
     1),
    ("            for s in gl.static_range(PROLOGUE_LOADS):\n                if s < k_steps:\n",
     f"            gl.store({PROGRAM_STAMPS} + 3, _clock(M))\n"
     "            for s in gl.static_range(PROLOGUE_LOADS):\n                if s < k_steps:\n", 1),
    ("rows_per_expert, stride_se, num_experts,\n                          HAS_BIAS: gl.constexpr,",
     "rows_per_expert, stride_se, num_experts, trace_ptr,\n                          HAS_BIAS: gl.constexpr,", 1),
    ("block_expert_ptr, used_ptr, stride_se, num_experts, 0, CONSUMERS,",
     "block_expert_ptr, used_ptr, stride_se, num_experts, trace_ptr, 0, CONSUMERS,", 4),
    ("block_expert_ptr, used_ptr, stride_se, num_experts, 1, CONSUMERS,",
     "block_expert_ptr, used_ptr, stride_se, num_experts, trace_ptr, 1, CONSUMERS,", 2),
    ('@gluon.jit(do_not_specialize=["M", "N", "K", "rows_per_expert", "stride_se", "num_experts"])',
     '@gluon.jit(do_not_specialize=["M", "N", "K", "rows_per_expert", "stride_se", "num_experts", "trace_ptr"])', 1),
    ("_scaled_mm_kernel.arg_names[14:]", "_scaled_mm_kernel.arg_names[15:]", 1),  # GluonCall's constexpr tail
]


def traced_module(clock: str = "clock64"):
    """The traced copy of gemm_gluon; ``clock``: the register read at each trace point, ``clock64``
    (the SM's cycle counter) or ``globaltimer`` (nanoseconds, one timer for every SM)."""
    source = (ROOT / "quantkit/kernels/gemm_gluon.py").read_text()
    substitutions = [(old, new.replace("%clock64", "%" + clock), count) for old, new, count in SUBSTITUTIONS]
    for old, new, count in substitutions:
        if source.count(old) != count:
            raise SystemExit(f"gemm_gluon.py changed: {old[:60]!r} found {source.count(old)} times, expected {count}")
        source = source.replace(old, new)
    path = Path(tempfile.mkdtemp()) / "gemm_gluon_traced.py"
    path.write_text(source)
    return load_module(path, "gemm_gluon_traced")


def config_of(mod, name):
    """Config ``name`` of ``mod``'s CONFIGS, or ``name+field=value+...``: that config with int
    fields changed (e.g. ``coop2_128x256_g16_lean_t3_pl1+ring_staging=1``)."""
    base, *changes = name.split("+")
    fields = {field: int(value) for field, _, value in (change.partition("=") for change in changes)}
    return dataclasses.replace(mod.CONFIGS[base], **fields)


def launcher(mod, name, M, N, K, traced):
    """A zero-argument launch of config ``name`` of ``mod`` (the traced copy, or gemm_gluon itself
    when not ``traced``) on fresh FP8 operands."""
    config = config_of(mod, name)
    *_, a, a_scale, w8, w_scale = _make_operands(M, N, K, torch.float8_e4m3fn, "cuda")
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    a_scale, w_scale = a_scale.float().contiguous(), w_scale.float().contiguous()
    call = mod.GluonCall(config, M, N, a.device, False, "none")
    grid = call.grid[0]
    trace = torch.zeros(grid * 2 * MAX_TILES * 5 + grid * 4, dtype=torch.int64, device="cuda")
    a_desc = mod._descriptor(a, [config.block_m, config.block_k])
    w_desc = mod._descriptor(w8, [config.block_n, config.block_k])
    out_desc = mod._descriptor(out, [config.stored_rows, call.chunk_n])

    def run():
        # The grouped form's five arguments as the dense GEMM passes them (GluonCall: unused).
        args = (a_desc, w_desc, out_desc, a_scale, w_scale, w_scale, M, N, K, a_scale, a_scale, 0, 0, 0)
        if traced:
            mod._scaled_mm_kernel[call.grid](*args, trace, **call.constexprs)
        else:
            mod._scaled_mm_kernel[call.grid](*args, **call.constexprs)

    reference_out = reference.scaled_mm(a, w8, a_scale, w_scale, None, "none", torch.float32)
    return run, trace, grid, out, reference_out


def event_ms(run, reps=20):
    """Median ms of one eager call between CUDA events: the host's launch is inside, so below ~100 us
    this reads the launch path, not the kernel (session 17: 65.6 against 26.6 us by CUPTI at
    1024x4096x4096)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def balance(programs):
    """How evenly the programs finish (meaningful with --clock globaltimer, one timer for all SMs),
    from each program's (tiles traced, first start, last store): grouped by tile count, the end
    times relative to the earliest start; and the SMs' busy share of the kernel's span."""
    start = min(p[1] for p in programs)
    span = max(p[2] for p in programs) - start
    by_tiles = {}
    for tiles, first, last in programs:
        by_tiles.setdefault(tiles, []).append(last - start)
    groups = {str(t): {"programs": len(v), "end_min": min(v), "end_median": statistics.median(v), "end_max": max(v)}
              for t, v in sorted(by_tiles.items())}
    busy = sum(last - first for _, first, last in programs) / (len(programs) * span)
    return {"span": span, "busy": busy, "start_spread": max(p[1] for p in programs) - start, "by_tiles": groups}


def program_events(trace, grid, consumers, rows_of):
    """From each program's entry, loader's first TMA issue, consumers' exits (after their last
    stores read the staging) and traced tiles: when the first tile starts and the first copy goes
    out after entry, how long the last stores take to read out, and the kernel's span entry to exit."""
    extra = trace[grid * 2 * MAX_TILES * 5:].view(grid, 4).tolist()
    entry = [e[0] for e in extra]
    exits = [max(e[1:1 + consumers]) for e in extra]
    first_t0 = [min(row[0] for c in range(consumers) for row in rows_of[p][c]) for p in range(grid)]
    last_t4 = [[max(row[4] for row in rows_of[p][c]) for c in range(consumers)] for p in range(grid)]
    return {
        "entry_spread": max(entry) - min(entry),
        "entry_to_first_tile": statistics.fmean(t0 - e for t0, e in zip(first_t0, entry)),
        "entry_to_first_copy": statistics.fmean(e[3] - e[0] for e in extra),
        "stored_to_exit": [statistics.fmean(extra[p][1 + c] - last_t4[p][c] for p in range(grid))
                           for c in range(consumers)],
        "span_entry_to_exit": max(exits) - min(entry),
    }


def cupti_us(run, reps=30):
    """Mean duration (us) by CUPTI (torch.profiler) of the one kernel ``run`` launches, a 256 MB L2
    flush (a fill kernel, left out by name) before each call."""
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            run()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if e.device_time > 0
             and not any(word in e.name.lower() for word in ("fill", "memset", "elementwise"))]
    return statistics.fmean(times[-reps:]) if times else float("nan")


def cublas_us(M, N, K):
    """CUPTI duration of ``torch._scaled_mm`` (rowwise scales, fast accumulation, bf16 out) at the point."""
    *_, a, a_scale, w8, w_scale = _make_operands(M, N, K, torch.float8_e4m3fn, "cuda")
    a_col, w_row, w_t = a_scale.float().view(-1, 1), w_scale.float().view(1, -1), w8.t()
    return cupti_us(lambda: torch._scaled_mm(a, w_t, scale_a=a_col, scale_b=w_row, out_dtype=torch.bfloat16,
                                             use_fast_accum=True))


def analyse(trace, grid, consumers, split, tiles_total, ideal):
    t = trace[:grid * consumers * MAX_TILES * 5].view(grid, consumers, MAX_TILES, 5).tolist()
    # rows[p][c]: the (t0, ..., t4) of each tile consumer c of program p stored (t0 = 0: none).
    rows_of = [[[row for row in t[p][c] if row[0] != 0] for c in range(consumers)] for p in range(grid)]
    parts = {name: [] for name in EVENTS + ("gap",)}
    cold, warm = [], []
    counted = 0
    for p in range(grid):
        for c in range(consumers):
            rows = rows_of[p][c]
            counted += len(rows)
            for i, (t0, t1, t2, t3, t4) in enumerate(rows):
                for name, value in zip(EVENTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    parts[name].append(value)
                (cold if i == 0 else warm).append(t1 - t0)
                if i + 1 < len(rows):
                    parts["gap"].append(rows[i + 1][0] - t4)
    summary = {name: {"median": statistics.median(v), "mean": statistics.fmean(v)} for name, v in parts.items() if v}
    per_consumer = [[row for p in range(grid) for row in rows_of[p][c]] for c in range(consumers)]
    summary["per_consumer"] = [{name: statistics.fmean(row[i + 1] - row[i] for row in rows)
                                for i, name in enumerate(EVENTS)} if rows else {} for rows in per_consumer]
    if split and consumers == 2:
        # The same tile's two halves (tail_order staggers them): when consumer 1's MMAs retire
        # after consumer 0's (t3), and when consumer 0's stores are issued against consumer 1's
        # retirement (t4 of 0 - t3 of 1; negative: consumer 0's epilogue ran under 1's MMAs).
        pairs = [(r0, r1) for p in range(grid) for r0, r1 in zip(rows_of[p][0], rows_of[p][1])]
        if pairs:
            summary["stagger"] = {"retire_1_minus_0": statistics.fmean(r1[3] - r0[3] for r0, r1 in pairs),
                                  "stored_0_minus_retire_1": statistics.fmean(r0[4] - r1[3] for r0, r1 in pairs)}
    # Per program: the cycles from its first tile's start to its last tile's stores, and (ping-pong)
    # the hand-over: from one consumer's last MMA issue (t2) to the other's first data of the
    # program's next tile (t1), both read from the same SM's clock.
    programs, handover = [], []  # programs: (tiles, first start, last store)
    for p in range(grid):
        tiles = sorted((row for c in range(consumers) for row in rows_of[p][c]), key=lambda r: r[1])
        if tiles:
            programs.append((len(tiles), min(r[0] for r in tiles), max(r[4] for r in tiles)))
        if consumers == 2 and not split:
            handover += [nxt[1] - cur[2] for cur, nxt in zip(tiles, tiles[1:])]
    summary["program_cycles_mean"] = statistics.fmean(last - first for _, first, last in programs)
    summary["balance"] = balance(programs)
    if handover:
        summary["handover"] = {"median": statistics.median(handover), "mean": statistics.fmean(handover)}
    summary["first_data_cold_mean"] = statistics.fmean(cold) if cold else None
    summary["first_data_warm_mean"] = statistics.fmean(warm) if warm else None
    summary["program"] = program_events(trace, grid, consumers, rows_of)
    summary["ideal_mma_cycles_per_tile"] = ideal
    summary["tiles_traced"] = counted
    summary["tiles_expected"] = tiles_total
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--configs", default="coop2_128x256_g16,pp_128x128")
    parser.add_argument("--clock", choices=("clock64", "globaltimer"), default="clock64",
                        help="globaltimer: nanoseconds on one timer for all SMs (for the balance across programs)")
    parser.add_argument("--points", default=None, help="MxNxK,... (default: the three large-M points)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mod = traced_module(args.clock)
    points = POINTS if not args.points else [tuple(map(int, p.split("x"))) for p in args.points.split(",")]
    results, lines = [], []
    meta = environment_metadata()
    unit = "cycles" if args.clock == "clock64" else "ns"
    lines.append(f"{meta.get('gpu')} torch {meta.get('torch')} triton {meta.get('triton')}  "
                 f"({'SM cycles' if unit == 'cycles' else 'ns, globaltimer'} per tile, mean over all tiles; "
                 "median in brackets; 'us' of a kernel: one eager call between CUDA events, launch included)")
    for M, N, K in points:
        for name in args.configs.split(","):
            config = config_of(mod, name)
            run_t, trace, grid, out, ref = launcher(mod, name, M, N, K, traced=True)
            run_u, *_ = launcher(gemm_gluon, name, M, N, K, traced=False)
            run_t()
            run_u()
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            ms_u, ms_t = event_ms(run_u), event_ms(run_t)
            kernel_us = cupti_us(run_u)
            trace.zero_()
            run_t()
            torch.cuda.synchronize()
            tiles = -(-M // config.block_m) * -(-N // config.block_n)
            # MMA cycles of one consumer's tile at the dense FP8 rate (4096 MACs / SM / cycle): the
            # split tile's two halves share the tensor cores, so a half takes the whole tile's time.
            ideal = config.block_m * config.block_n * K // 4096
            summary = analyse(trace, grid, config.consumers, config.split_m,
                              tiles * (config.consumers if config.split_m else 1), ideal)
            row = {"M": M, "N": N, "K": K, "config": name, "rel_err": err, "ms_untraced": ms_u, "ms_traced": ms_t,
                   "kernel_us_cupti": kernel_us, "scaled_mm_kernel_us_cupti": cublas_us(M, N, K), "grid": grid,
                   **summary}
            results.append(row)
            lines.append(f"\nM={M} N={N} K={K} {name}: {ms_u * 1e3:.1f} us untraced, {ms_t * 1e3:.1f} traced, "
                         f"rel_err {err:.1e}, tiles traced {summary['tiles_traced']}/{summary['tiles_expected']}, "
                         f"ideal MMA {ideal} cycles/tile")
            lines.append("  " + "  ".join(f"{k} {summary[k]['mean']:.0f} [{summary[k]['median']:.0f}]"
                                          for k in EVENTS + ("gap",) if k in summary))
            warm = summary["first_data_warm_mean"]  # None where every program has one tile
            lines.append(f"  first data: program's first tile {summary['first_data_cold_mean']:.0f}, "
                         f"later tiles {'-' if warm is None else f'{warm:.0f}'}; program span "
                         f"{summary['program_cycles_mean']:.0f} {unit} = {summary['program_cycles_mean'] / (ms_t * 1e3):.0f} "
                         f"per us of the traced call"
                         + (f"; hand-over {summary['handover']['mean']:.0f} [{summary['handover']['median']:.0f}]"
                            if "handover" in summary else ""))
            lines.append("  per consumer: " + "; ".join(
                f"{c}: " + " ".join(f"{k} {v:.0f}" for k, v in part.items())
                for c, part in enumerate(summary["per_consumer"]))
                + ("" if "stagger" not in summary else
                   "; consumer 1 retires {retire_1_minus_0:.0f} after consumer 0, whose stores are issued "
                   "{stored_0_minus_retire_1:.0f} after that".format(**summary["stagger"])))
            pe = summary["program"]
            lines.append(f"  program ({unit}): entries spread over {pe['entry_spread']}, entry to first tile "
                         f"{pe['entry_to_first_tile']:.0f}, to first copy {pe['entry_to_first_copy']:.0f}; last stores "
                         "issued to exit " + "/".join(f"{v:.0f}" for v in pe["stored_to_exit"])
                         + f"; span entry to exit {pe['span_entry_to_exit']}. Kernel by CUPTI {kernel_us:.2f} us, "
                         f"_scaled_mm's {row['scaled_mm_kernel_us_cupti']:.2f} us")
            b = summary["balance"]
            lines.append(f"  balance ({unit}): span {b['span']}, SMs busy {b['busy']:.3f} of it, starts spread over "
                         f"{b['start_spread']}; end by tile count: " + "; ".join(
                             f"{t} tiles x{g['programs']}: {g['end_min']}..{g['end_median']:.0f}..{g['end_max']}"
                             for t, g in b["by_tiles"].items()))
            print("\n".join(lines[-6:]), flush=True)
            (args.out / "gemm_trace.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
            (args.out / "gemm_trace.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
