"""Split-K at decode and medium batch sizes (issue 3): GPU checks of every split config of the
autotuner's pools (the decode set, and since session 38 the medium ones) and of every decode config
in the promoted FP8 mode, and the timing that decides ``gemm_configs.SMALL_M_SPLIT_K``
(``benchmarks/gemm.py --split-k``).

Per point (M = 1, 16, 32 and 64 at the four Llama-3-8B projections and the gated MLP front half,
FP8 and INT8, plain dequant epilogue, bf16 out), in one process and with ratios from the same run:
- bf16 ``F.linear`` (cuBLAS; gated: one GEMM over the stacked weight + act * mul);
- "auto": the autotuner's pick from the pool with the switch off (no split configs), launched as
  an explicit config (the same binary and plan the cached path launches);
- "auto_split_on": the autotuner's pick with the split configs admitted (what the switch gives);
- every split config the pool admits at that M (``split_candidates``: the decode set at M <= 16,
  the medium ones above).
Before timing, every quantkit output at the point is checked against the reference (rel. error),
INT8 split outputs bit for bit against the unsplit pick's (exact int32 sums, same epilogue), and
the arrival counters must be back at zero; a failing op is recorded and not timed.
Two timers, every op in ``rounds`` interleaved rounds with the op order rotated per round
(session 5 found a first-op bias), medians: ``flush`` (``bench_graph_ms``: CUDA-graph replay,
L2 flushed before each call; the standard benchmark's timer) and ``rotate`` (a graph of calls
cycling over copies of the weight that together exceed the L2 twice, nothing else: back-to-back
cold-weight GEMMs as in a decode step, without the flush's timing noise on 6-35 us ops).
"""

from __future__ import annotations

import contextlib
import statistics

import torch
import torch.nn.functional as F

from quantkit.bench.common import environment_metadata
from quantkit.bench.gemm import _rel_err, adaptive_graph_ms, fp8_fast_accum_tolerance, output_bound, write_results
from quantkit.kernels import gemm, gemm_configs, gemm_tma, reference
from quantkit.kernels.launch import INTERPRETED, capture_graph, config_dict, median_replay_ms

# The switch governs the decode split set (M <= 16) and the medium one (17 <= M <= SPLIT_K_MAX_M):
# the round times both, at the top of each range.
SPLIT_K_MS = (1, 16, 32, 64)
# (kind, N, K): the Llama-3-8B projections (qkv, o, gate+up stacked, down) and the gated MLP
# front half (N = 14336 outputs of a 2 x 14336 x 4096 weight).
SPLIT_K_POINTS = [("plain", 6144, 4096), ("plain", 4096, 4096), ("plain", 28672, 4096), ("plain", 4096, 14336),
                  ("gated", 14336, 4096)]
DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# Weight copies of the rotate timer span at least this many bytes (2 x the H100's 50 MB L2).
ROTATE_BYTES = 100 << 20


def split_configs(limit: int | None = None) -> list[dict]:
    return [config_dict(c) for c in gemm.SMALL_M_SPLIT_K_CONFIGS[:limit]]


def pool_split_configs() -> list[dict]:
    """Every split config the autotuner's pools hold: the decode set and the medium ones."""
    return [config_dict(c) for c in gemm.ALL_CONFIGS if c.kwargs.get("SPLIT_K", 1) > 1]


def split_candidates(M: int, gated: bool = False) -> list[dict]:
    """The split configs the autotuner's pool admits at ``M`` while SMALL_M_SPLIT_K is on (the
    decode set at M <= 16, the medium swapped and 64-row ones up to SPLIT_K_MAX_M, the 128-row ones
    above that up to MEDIUM_LARGE_MAX_M when not gated, none above)."""
    return [config_dict(c) for c in gemm_configs.pool_configs(M, gated, split_k=True) if c.kwargs.get("SPLIT_K", 1) > 1]


def config_name(cfg: dict) -> str:
    split = f" S{cfg['SPLIT_K']}" if cfg.get("SPLIT_K", 1) > 1 else ""
    swap = " swap" if cfg.get("SWAP_AB") else ""
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']}s{cfg['num_stages']}{split}{swap}"


def arrivals_zero() -> bool:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return all(not bool(arrivals.any()) for _, arrivals in gemm_tma._SPLIT_WORKSPACE.values())


# ---------------------------------------------------------------------------------------------- checks


def run_split_k_checks(record, device="cuda", small=False, share=(0, 1), configs=None) -> None:
    """Every split config of the pools (or ``configs``), INT8 and FP8, plain and gated, on a shape
    with a masked K tail and an N tail: INT8 accumulator exact at M = 1, 13, 16, 29, 61 (one binary:
    M is not specialized; 29 and 61 are several row tiles of the smaller tiles; 128-row tiles also
    at 129 and 250, two row tiles), outputs at M = 1, 13, 29, 61 (and 129, 250) within tolerance of
    the reference, a second launch bit-equal to the first, counters at zero.
    ``record(name, ok, **info)`` raises on a failure (bench.gemm.run_gpu_checks's). ``share`` (i, n):
    only configs[i::n] (and the CUDA-graph check in share 0), so n processes split the compiles."""
    # K = 4160: 17 steps of 256 / 9 of 512 with a 64-wide masked tail, so 8 slices get 2-3 / 1-2
    # steps each; N = 200: a partial last N tile for BLOCK_N 32, 64 and 128.
    N, K = (40, 1040) if small else (200, 4160)
    gen = torch.Generator(device=device).manual_seed(6)
    for cfg in (configs or (split_configs(2) if small else pool_split_configs()))[share[0]::share[1]]:
        tall = (129, 250) if cfg["BLOCK_M"] >= 128 else ()
        for dtype_name, dtype in DTYPES.items():
            a, sa = reference.quantize_per_token(torch.randn(256, K, device=device, generator=gen), dtype)
            w, sw = reference.quantize_per_channel(torch.randn(2 * N, K, device=device, generator=gen), dtype)
            bias = torch.randn(N, device=device, generator=gen).to(torch.bfloat16)
            info = {"config": config_name(cfg), "N": N, "K": K,
                    "splits": gemm_configs.split_k_plan(K, cfg["BLOCK_K"], cfg["SPLIT_K"])}
            if dtype == torch.int8:
                for M in (1, 13, 16, 29, 61) + tall:
                    out = torch.full((M, N), -7, dtype=torch.int32, device=device)
                    acc = gemm.int8_matmul_accumulator(a[:M], w[:N], config=cfg, out=out)
                    record("split_k_int8_acc_exact", torch.equal(acc, reference.int8_matmul_exact(a[:M], w[:N]))
                           and arrivals_zero(), M=M, **info)
            bound = 1e-5 if dtype == torch.int8 else fp8_fast_accum_tolerance(K)
            for gated in (False, True):
                for M in (1, 13, 29, 61) + tall:
                    if gated:
                        def run():
                            return gemm.gated_scaled_mm(a[:M], w, sa[:M], sw, "silu", torch.float32, config=cfg,
                                                        out=torch.full((M, N), float("nan"), device=device))
                        ref = reference.gated_scaled_mm(a[:M], w, sa[:M], sw, "silu", torch.float32)
                    else:
                        def run():
                            return gemm.scaled_mm(a[:M], w[:N], sa[:M], sw[:N], bias, "gelu_tanh", torch.float32,
                                                  config=cfg, out=torch.full((M, N), float("nan"), device=device))
                        ref = reference.scaled_mm(a[:M], w[:N], sa[:M], sw[:N], bias, "gelu_tanh", torch.float32)
                    first, second = run(), run()
                    err = _rel_err(first, ref)
                    record(f"split_k_{dtype_name}_gated={gated}", not first.isnan().any() and err < bound
                           and torch.equal(first, second) and arrivals_zero(), M=M, rel_err=err, bound=bound, **info)
    if device == "cuda" and share[0] == 0:
        _check_graph_capture(record, N, K, gen)


# Promoted FP8 (fp8_fast_accum=False) adds the MMA's partial sums into fp32 every FP8_PROMOTE_K
# products. Relative error of an fp32 output against float64 (the norm ratio of common.rel_err) at
# the checks' K = 4160, H200 (session 38, results/gemm_promoted_s38a_h200.json): mma.sync tiles
# (16-token, unswapped) 0.7-5.2e-7, exact fp32 in both modes; swapped (wgmma) tiles 1.2-1.9e-4
# promoted against 5.3e-4-1.9e-3 fast, whose accumulator keeps fewer mantissa bits within a chunk.
PROMOTED_FP32_BOUND = 3e-4


def promoted_configs() -> list[dict]:
    """The configs the promoted checks cover: the decode pool (split and swapped ones included) and
    the medium swapped and split ones, the 128-row split ones included."""
    pools = (gemm.SMALL_M_CONFIGS + gemm.SMALL_M_SPLIT_K_CONFIGS + gemm.MEDIUM_M_SWAP_CONFIGS
             + gemm.MEDIUM_M_SPLIT_K_CONFIGS + gemm.WIDE_M_SPLIT_K_CONFIGS)
    return [config_dict(c) for c in pools]


def run_promoted_checks(record, device="cuda", small=False, compare_fast=False, share=(0, 1)) -> None:
    """Every decode config (the small-M pool, split and swapped ones included, and the medium
    swapped and split ones) in the promoted FP8 mode, plain (bias + gelu_tanh) and gated, fp32
    output, M = 1, 13, 29 and 61, on the split checks' masked-K shape: within PROMOTED_FP32_BOUND
    of float64, which lies below every fast-mode reading of a wgmma tile in run s38a, so promotion
    that silently did not happen there fails (mma.sync tiles accumulate fp32 in both modes).
    ``compare_fast`` also runs the fast mode on the same inputs and records its error
    (``fast_rel_err``; twice the compiles, so the standard run's checks leave it out).
    ``share`` (i, n): only configs[i::n], so n processes split the compiles."""
    N, K = (40, 1040) if small else (200, 4160)
    gen = torch.Generator(device=device).manual_seed(7)
    dtype = torch.float8_e4m3fn
    a, sa = reference.quantize_per_token(torch.randn(64, K, device=device, generator=gen), dtype)
    w, sw = reference.quantize_per_channel(torch.randn(2 * N, K, device=device, generator=gen), dtype)
    bias = torch.randn(N, device=device, generator=gen).to(torch.bfloat16)
    configs = promoted_configs()[share[0]::share[1]]
    for cfg in configs[-2:] if small else configs:
        for gated in (False, True):
            for M in (1, 13, 29, 61):
                def run(fast):
                    out = torch.full((M, N), float("nan"), device=device)
                    if gated:
                        return gemm.gated_scaled_mm(a[:M], w, sa[:M], sw, "silu", torch.float32, config=cfg, out=out,
                                                    fp8_fast_accum=fast)
                    return gemm.scaled_mm(a[:M], w[:N], sa[:M], sw[:N], bias, "gelu_tanh", torch.float32, config=cfg,
                                          out=out, fp8_fast_accum=fast)

                if gated:
                    gate, up = w[:N], w[N:]
                    exact = (reference.fp64_scaled_mm(a[:M], gate, sa[:M], sw[:N], None, "silu")
                             * reference.fp64_scaled_mm(a[:M], up, sa[:M], sw[N:], None, "none"))
                else:
                    exact = reference.fp64_scaled_mm(a[:M], w[:N], sa[:M], sw[:N], bias, "gelu_tanh")
                promoted = run(False)
                err = _rel_err(promoted, exact)
                fast = {"fast_rel_err": _rel_err(run(True), exact)} if compare_fast else {}
                record(f"promoted_fp8_gated={gated}", not promoted.isnan().any() and err < PROMOTED_FP32_BOUND,
                       config=config_name(cfg), M=M, N=N, K=K, rel_err=err, bound=PROMOTED_FP32_BOUND, **fast)


def _check_graph_capture(record, N, K, gen) -> None:
    """A split launch captured in a CUDA graph (the workspace exists after the eager warm-up):
    replayed on new inputs it equals an eager launch and leaves the counters at zero."""
    cfg = max(split_configs(), key=lambda c: c["SPLIT_K"])
    for dtype_name, dtype in DTYPES.items():
        w, sw = reference.quantize_per_channel(torch.randn(N, K, device="cuda", generator=gen), dtype)
        a, sa = reference.quantize_per_token(torch.randn(16, K, device="cuda", generator=gen), dtype)
        out = torch.empty(16, N, dtype=torch.bfloat16, device="cuda")

        def call():
            gemm.scaled_mm(a, w, sa, sw, None, "silu", torch.bfloat16, config=cfg, out=out)

        graph = capture_graph(call)
        a2, sa2 = reference.quantize_per_token(torch.randn(16, K, device="cuda", generator=gen), dtype)
        a.copy_(a2)
        sa.copy_(sa2)
        graph.replay()
        eager = gemm.scaled_mm(a2, w, sa2, sw, None, "silu", torch.bfloat16, config=cfg)
        record(f"split_k_cuda_graph_{dtype_name}", torch.equal(out, eager) and arrivals_zero(),
               config=config_name(cfg), N=N, K=K)


# ---------------------------------------------------------------------------------------------- timers


def flush_timer(make, weights):
    """ms per call of ``make(weights[0])()``: the standard benchmark's timer (bench.gemm)."""
    return adaptive_graph_ms(make(weights[0]))


def rotate_timer(make, weights, replays: int = 9) -> float:
    """ms per call of ``make(w)()`` from a CUDA graph cycling over ``weights`` (cold in L2 each call)."""
    fns = [make(w) for w in weights]
    calls = max(len(fns), 20 // len(fns) * len(fns))
    for fn in fns:
        fn()  # compile / tune outside the capture
    torch.cuda.synchronize()

    def cycle():
        for i in range(calls):
            fns[i % len(fns)]()

    graph = capture_graph(cycle)
    ms = median_replay_ms(graph, replays) / calls
    del graph
    return ms


# Each timer: (make, weights) -> ms per call of make(w)(), w one of the weight copies.
TIMERS = {"rotate": rotate_timer, "flush": flush_timer}


# ---------------------------------------------------------------------------------------------- the autotuner's picks


@contextlib.contextmanager
def split_k_switch(on: bool):
    """``gemm_configs.SMALL_M_SPLIT_K = on`` with empty tuning caches, so a decode key retunes
    over that pool; the switch and every cache are restored on exit."""
    tuner = gemm._scaled_mm_autotuned
    saved = (gemm_configs.SMALL_M_SPLIT_K, dict(gemm._TUNED_TILED), dict(gemm._TILED_PLANS), dict(tuner.cache))
    gemm_configs.SMALL_M_SPLIT_K = on
    for cache in (gemm._TUNED_TILED, gemm._TILED_PLANS, tuner.cache):
        cache.clear()
    try:
        yield
    finally:
        gemm_configs.SMALL_M_SPLIT_K = saved[0]
        for cache, old in zip((gemm._TUNED_TILED, gemm._TILED_PLANS, tuner.cache), saved[1:]):
            cache.clear()
            cache.update(old)


def tuned_pick(call, on: bool) -> dict:
    """The config the autotuner picks for ``call()`` (a quantkit GEMM with config=None) with the
    split configs admitted (``on``) or not."""
    if INTERPRETED:  # one fixed config, no autotuning
        return {**gemm.INTERPRETER_CONFIG, "num_warps": 4, "num_stages": 2}
    with split_k_switch(on):
        call()
        (pick,) = gemm._TUNED_TILED.values()
    return dict(pick)


# ---------------------------------------------------------------------------------------------- benchmark


def _operands(kind, M, N, K, dtype, device, copies):
    gen = torch.Generator(device=device).manual_seed(M + N + K)
    rows = 2 * N if kind == "gated" else N
    x = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16)
    w_bf16 = (torch.randn(rows, K, device=device, generator=gen) * K**-0.5).to(torch.bfloat16)
    a, sa = reference.quantize_per_token(x, dtype)
    w, sw = reference.quantize_per_channel(w_bf16, dtype)
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    bf16_weights = [w_bf16] + [w_bf16.clone() for _ in range(max(1, copies // 2) - 1)]
    return x, bf16_weights, a, sa, weights, sw


def time_point(kind, M, N, K, dtype_name, timers: dict, rounds, device="cuda", config_limit=None,
               configs: list[dict] | None = None) -> list[dict]:
    """Check, then time every op of one (kind, M, N, K, dtype) point with each of ``timers``
    (name -> timer, as TIMERS); one row per op. ``configs``: the explicit configs timed beside the
    picks (default: the split configs the pool admits at M, ``split_candidates``; ``config_limit``
    the first so many)."""
    dtype = DTYPES[dtype_name]
    rows_w = 2 * N if kind == "gated" else N
    copies = max(2, -(-ROTATE_BYTES // (rows_w * K))) if "rotate" in timers else 1
    x, bf16_weights, a, sa, weights, sw = _operands(kind, M, N, K, dtype, device, copies)
    out = torch.empty(M, N, dtype=torch.bfloat16, device=device)

    def quantkit_op(config):
        def make(w):
            # The tiled kernel throughout: at M = 1 "auto" would take the GEMV, which tunes nothing.
            if kind == "gated":
                return lambda: gemm.gated_scaled_mm(a, w, sa, sw, "silu", torch.bfloat16, config=config, out=out,
                                                    kernel="tiled")
            return lambda: gemm.scaled_mm(a, w, sa, sw, None, "none", torch.bfloat16, config=config, out=out,
                                          kernel="tiled")
        return make

    def bf16_make(w):
        if kind == "gated":
            return lambda: (lambda g, u: F.silu(g) * u)(*F.linear(x, w).chunk(2, dim=-1))
        return lambda: F.linear(x, w)

    picks = {"auto": tuned_pick(quantkit_op(None)(weights[0]), on=False),
             "auto_split_on": tuned_pick(quantkit_op(None)(weights[0]), on=True)}
    ops = {"bf16_F.linear": (bf16_make, None)}
    ops.update({name: (quantkit_op(cfg), cfg) for name, cfg in picks.items()})
    candidates = (split_candidates(M, kind == "gated") if configs is None else configs)[:config_limit]
    ops.update({f"split {config_name(cfg)}": (quantkit_op(cfg), cfg) for cfg in candidates})
    base = {"kind": kind, "M": M, "N": N, "K": K, "dtype": dtype_name, "weight_bytes": rows_w * K}
    rows = {op: {**base, "op": op, "config": config_name(cfg) if cfg else "cuBLAS",
                 "splits": gemm_configs.split_k_plan(K, cfg["BLOCK_K"], cfg.get("SPLIT_K", 1)) if cfg else None}
            for op, (_, cfg) in ops.items()}

    # Checks at the real shape first.
    ref = (reference.gated_scaled_mm(a, weights[0], sa, sw, "silu", torch.float32) if kind == "gated"
           else reference.scaled_mm(a, weights[0], sa, sw, None, "none", torch.float32))
    unsplit = quantkit_op(picks["auto"])(weights[0])().clone()
    bound = output_bound(dtype, K)
    for op, (make, cfg) in ops.items():
        if cfg is None:
            continue
        outs = []
        for _ in range(2):
            # Poisoned before each call: an element an op fails to write cannot keep an earlier op's value.
            out.fill_(float("nan"))
            outs.append(make(weights[0])().clone())
        first, second = outs
        err = _rel_err(first, ref)
        problems = [p for p, bad in (("rel_err", not err < bound), ("nan", bool(first.isnan().any())),
                                     ("repeat", not torch.equal(first, second)),
                                     ("counters", not arrivals_zero()),
                                     ("int8_vs_unsplit", dtype == torch.int8 and not torch.equal(first, unsplit)))
                    if bad]
        rows[op].update(rel_err=err, bound=bound, check="ok" if not problems else "FAILED: " + ", ".join(problems))
    timed = [op for op in ops if rows[op].get("check", "ok") == "ok"]
    for timer_name in timers:
        for r in range(rounds):
            # Rotated op order: each op leads one round (session 5: the first op after the
            # cuBLAS baselines timed 5-10 % slow).
            for op in timed[r % len(timed):] + timed[:r % len(timed)]:
                make = ops[op][0]
                weights_for = bf16_weights if ops[op][1] is None else weights
                rows[op].setdefault(f"ms_{timer_name}_rounds", []).append(timers[timer_name](make, weights_for))
    for op in timed:
        for timer_name in timers:
            rows[op][f"ms_{timer_name}"] = statistics.median(rows[op][f"ms_{timer_name}_rounds"])
    for op in timed:
        for timer_name in timers:
            ms = rows[op][f"ms_{timer_name}"]
            rows[op][f"x_bf16_{timer_name}"] = rows["bf16_F.linear"][f"ms_{timer_name}"] / ms
            if "auto" in timed:
                rows[op][f"x_auto_{timer_name}"] = rows["auto"][f"ms_{timer_name}"] / ms
            if ops[op][1] is not None:  # GB/s of the weight bytes it must read
                rows[op][f"weight_GBps_{timer_name}"] = rows_w * K / (ms * 1e-3) / 1e9
    rows["auto"]["pick"] = config_name(picks["auto"])
    rows["auto_split_on"]["pick"] = config_name(picks["auto_split_on"])
    return list(rows.values())


def summarize(rows: list[dict], timers) -> dict:
    """Per point: bf16, auto, auto_split_on and the best split config; the verdict for the switch:
    on when the split-on pick is nowhere more than 2 % slower than the pick without the split configs
    (either timer) and at least 5 % faster somewhere. A point where both picks are the same config
    measures only the timers' noise (session 39: one config read 0.979x itself), so it does not
    count either way."""
    points, verdict_ok, gains = [], True, []
    keys = sorted({(r["kind"], r["N"], r["K"], r["M"], r["dtype"]) for r in rows})
    for kind, N, K, M, dtype in keys:
        at = {r["op"]: r for r in rows if (r["kind"], r["N"], r["K"], r["M"], r["dtype"]) == (kind, N, K, M, dtype)}
        point = {"kind": kind, "N": N, "K": K, "M": M, "dtype": dtype, "auto_pick": at["auto"].get("pick"),
                 "auto_split_on_pick": at["auto_split_on"].get("pick")}
        for t in timers:
            ms = {op: r.get(f"ms_{t}") for op, r in at.items() if r.get(f"ms_{t}") is not None}
            splits = {op: v for op, v in ms.items() if op.startswith("split ")}
            best = min(splits, key=splits.get) if splits else None
            point[t] = {"bf16": ms.get("bf16_F.linear"), "auto": ms.get("auto"), "auto_split_on": ms.get("auto_split_on"),
                        "best_split": best, "best_split_ms": splits.get(best)}
            if ms.get("auto") and ms.get("auto_split_on"):
                ratio = ms["auto"] / ms["auto_split_on"]
                point[t]["on_vs_off"] = ratio
                if point["auto_pick"] != point["auto_split_on_pick"]:
                    verdict_ok &= ratio >= 0.98
                    gains.append(ratio)
        points.append(point)
    turn_on = bool(gains) and verdict_ok and max(gains) >= 1.05
    return {"points": points, "turn_on": turn_on,
            "rule": "on if auto_split_on >= 0.98x auto at every point where the picks differ (both timers) "
                    "and >= 1.05x somewhere"}


def print_point(rows, timers):
    for r in rows:
        cells = []
        for t in timers:
            if r.get(f"ms_{t}") is not None:
                cells.append(f"{t} {r[f'ms_{t}'] * 1e3:7.1f}us x{r[f'x_bf16_{t}']:.2f} bf16"
                             + (f" x{r[f'x_auto_{t}']:.2f} auto" if f"x_auto_{t}" in r else ""))
        print(f"{r['kind']:5s} M={r['M']:2d} {r['N']:5d}x{r['K']:5d} {r['dtype']:4s} {r['op']:28s} "
              f"{r.get('pick', ''):22s} {' | '.join(cells)} {r.get('check', '')}", flush=True)


def run_split_k_benchmark(out_dir, device="cuda", points=None, ms=SPLIT_K_MS, timers=None, rounds=3,
                          config_limit=None, deadline_left=None, configs=None, name="gemm_splitk") -> dict:
    """Time every point; writes {name}.json/.csv (rows, summary with the verdict) under out_dir
    after each point. ``timers``: name -> timer (default TIMERS); ``deadline_left()`` (seconds
    left, optional): points that no longer fit are skipped; ``configs``: the explicit configs to
    time (``time_point``). Returns the summary."""
    timers = timers or TIMERS
    meta = environment_metadata()
    meta.update(timers=list(timers), rounds=rounds, skipped_for_deadline=[])
    rows = []
    for kind, N, K in points or SPLIT_K_POINTS:
        for M in ms:
            for dtype_name in DTYPES:
                if deadline_left is not None and deadline_left() < 30:
                    meta["skipped_for_deadline"].append(f"{kind} M={M} {N}x{K} {dtype_name}")
                    continue
                point_rows = time_point(kind, M, N, K, dtype_name, timers, rounds, device, config_limit, configs)
                print_point(point_rows, timers)
                rows.extend(point_rows)
                meta["summary"] = summarize(rows, timers)
                write_results(rows, out_dir, name, meta)
    meta["summary"] = summary = summarize(rows, timers)
    write_results(rows, out_dir, name, meta)
    print(f"split-K verdict: turn SMALL_M_SPLIT_K {'ON' if summary['turn_on'] else 'off'} ({summary['rule']})",
          flush=True)
    return summary
