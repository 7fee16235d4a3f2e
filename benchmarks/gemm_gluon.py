"""The Gluon warp-specialized GEMM (quantkit/kernels/gemm_gluon.py) on a Hopper GPU: checks, then timings.

    PYTHONUNBUFFERED=1 QUANTKIT_COMMIT=<sha> python benchmarks/gemm_gluon.py --out $OUT/gluon --deadline 500

1. Checks, FP8 and INT8, every config in gemm_gluon.CONFIGS, odd shapes (M in 1, 13, 257, 1024;
   N x K in 384x4096, 389x272 (an output row that needs padding), 4096x272) against a float64
   reference ``act((a @ w.T) * a_scale[:, None] * w_scale[None, :] + bias)``, each config with a bf16
   bias, with none, with silu / no bias / fp16 output and with gelu_tanh / an fp32 bias / fp16 output. Tolerances: per element
   |out - ref| <= 2^-7 |ref| (one output ulp) + 1e-5 max|ref| for INT8 (exact int32 sums) or
   1e-2 max|ref| for FP8 (wgmma's fast accumulation), and relative Frobenius error <= 2.5e-3 INT8
   / 5e-3 FP8 (bf16 rounding alone gives ~1.7e-3; earlier sessions measured 2.0e-3 FP8 at K=4096). A second call
   must be bit-equal to the first. A dtype with a failed check is not timed (its configs neither).
2. Timings at N x K in {6144x4096, 4096x4096, 28672x4096, 4096x14336} x M in {1024, 4096, 16384}:
   bf16 F.linear; ``torch._scaled_mm`` rowwise, fast accumulation, + bias add (the FP8 baseline);
   ``torch._int_mm`` + the dequant/bias epilogue as separate ops (the INT8 baseline); the Triton
   kernel ``gemm.scaled_mm`` would run without Gluon (kernel "persistent" from PERSISTENT_MIN_M,
   "tiled" below; autotuned, warmed first); every Gluon config and the launcher's own
   pick ("auto"). Each op is timed from CUDA-graph replay (calls x (L2 flush, op) minus the flushes
   alone), in ROUNDS rounds whose op order rotates every round (the first op after cuBLAS was
   timed 5-10 % slow at >= 0.6 ms in earlier sessions: clock / power state); medians reported.
3. Results: gemm_gluon.json (meta, checks, rows) and gemm_gluon.txt (tables: us, TFLOP/s, ratios),
   rewritten after every point; no new point starts past --deadline seconds.

Gated mode (``--gated``; gemm_gluon's GATED configs, ``act(gate) * up`` over a stacked (2N, K) weight):

    PYTHONUNBUFFERED=1 python benchmarks/gemm_gluon.py --gated --out $OUT/gated --deadline 200

1. Checks, INT8 and FP8, every gated config, M in {1, 13, 257, 1024, 2048} x N (outputs) in
   {96, 384, 4096} x K in {272, 4096}, plus N=389 (a padded output row), silu; the first config
   also with gelu_tanh and an fp16 output; INT8 also through ``gemm.gated_scaled_mm`` (kernel
   "auto": Gluon from GLUON_GATED_MIN_M). Reference: float64 ``act(g) * u``, g and u the scaled GEMMs
   over the gate and up rows. Tolerances as above, the absolute term relative to max|act(g)| x
   max|u| (FP8: the accumulation error of g and u scaled by the other factor).
2. Timings at gate_up 2 x 14336 x 4096 (N = 14336 outputs, K = 4096), M in {1024, 4096, 16384}:
   bf16 (one F.linear over the stacked weight + silu * mul), the Triton gated kernel
   (``gemm.gated_scaled_mm``, kernel ``triton_kind``: INT8 "persistent", "tiled" below PERSISTENT_MIN_M;
   FP8 "tiled"), two Gluon GEMMs (``gemm.scaled_mm(kernel="gluon")``,
   tuned) + ``F.silu(g) * u``, every gated config and ``gemm.gated_scaled_mm`` (auto: tuned gated
   Gluon). Same graph timing, rotation and medians. Results: gemm_gluon_gated.json / .txt.

Imports the kernels without quantkit/__init__.py (whose data-set dependencies the GPU image lacks).
"""

import argparse
import dataclasses
import json
import time
import traceback
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.gemm import adaptive_graph_ms, rotated_medians  # noqa: E402
from quantkit.kernels import gemm, gemm_gluon, reference  # noqa: E402

FP8 = torch.float8_e4m3fn
T0 = time.time()
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
POINTS = [(M, N, K) for M in (1024, 4096, 16384) for N, K in SHAPES]
CHECK_SHAPES = [(384, 4096), (389, 272), (4096, 272)]
CHECK_MS = [1, 13, 257, 1024]
# Several tiles per program and many K steps (an odd tile count per program in the second): the
# ping-pong consumers' ring positions run far ahead of a small ring only here.
# (2048, 6144, 4000): 5-6 ping-pong tiles per program (both order barriers through several
# phases), a K tail, step counts that are no multiple of the ring depth; K=272: K shorter than the ring.
# (8192, 4096, 144): ~8 cooperative tiles per program of 2 K steps (one a tail), so one warpgroup can
# run a whole tile ahead of the other (staging_turns' free barriers, session 15).
# (3000, 6144, 4000): tail_halves after 4 whole rounds (576 tiles: 48 as 96 half tiles), ragged rows, a K tail.
LONG_CHECKS = [(1024, 4096, 4096), (1000, 6144, 4096), (2048, 6144, 4000), (2048, 6144, 272), (8192, 4096, 144),
               (3000, 6144, 4000)]
SELECTED: list[str] = []  # --configs; empty = every config
OPTIONS = {"bias": True}  # --no-bias: the plain epilogue (no bias anywhere; the strictest baseline)
ROUNDS = 3
DTYPE_NAMES = {FP8: "fp8", torch.int8: "int8"}
DTYPES = [FP8, torch.int8]  # --dtypes


def elapsed() -> float:
    return time.time() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def metadata() -> dict:
    """The benchmarks' common stamp (versions, commit, source digest, date) plus the SM count and the configs."""
    return {**environment_metadata(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "gluon_available": gemm_gluon.available(),
            "configs": {name: vars(cfg) for name, cfg in gemm_gluon.CONFIGS.items()}}


# ----------------------------------------------------------------------------------------------
# Operands and the float64 reference
# ----------------------------------------------------------------------------------------------

def operands(M, N, K, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_bf16 = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5).to(torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.1
    a, a_scale = reference.quantize_per_token(x, dtype)
    w, w_scale = reference.quantize_per_channel(w_bf16, dtype)
    return x, w_bf16, bias, a, a_scale, w, w_scale


def reference64(a, w, a_scale, w_scale, bias, activation):
    out = (a.double() @ w.double().T) * a_scale.double()[:, None] * w_scale.double()[None, :]
    if bias is not None:
        out = out + bias.double()
    return reference.apply_activation(out, activation)


def compare(out, ref, dtype, scale=None) -> dict:
    """Per-element and Frobenius error of a 16-bit output against the float64 reference
    (``scale``: the magnitude the absolute term is relative to; default max|ref|)."""
    diff = (out.double() - ref).abs()
    scale = scale or ref.abs().max().item() or 1.0
    # The output rounding: half a bf16 ulp, a whole one where the fp32 epilogue's own rounding
    # tips a value across a rounding midpoint (2^-7 relative covers both). FP8's wgmma adds in a
    # reduced-precision accumulator (fast accumulation): an absolute term relative to the output's
    # magnitude, far looser than INT8's (exact int32 sums; only fp32 epilogue rounding).
    rel = 2.0**-7
    abs_tol = (1e-5 if dtype == torch.int8 else 1e-2) * scale
    bad = diff > rel * ref.abs() + abs_tol
    fro = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    fro_tol = 2.5e-3 if dtype == torch.int8 else 5e-3
    return {"max_abs_err": diff.max().item(), "ref_absmax": scale, "bad_elements": int(bad.sum().item()),
            "rel_fro": fro, "ok": bool(bad.sum().item() == 0 and fro <= fro_tol)}


def add_variants(specs: list[str], gated: bool) -> None:
    """``--variant FIELD=VALUE[,FIELD=VALUE...]``: for each selected config, a copy with those fields
    changed, named ``name[spec]``, registered in gemm_gluon's config tables (this process only) and
    selected. A config that refuses the change (its own checks) is left out, with a log line."""
    table = gemm_gluon.GATED_CONFIGS if gated else gemm_gluon.CONFIGS
    base = [name for name in table if not SELECTED or name in SELECTED]
    for spec in specs:
        changes = {}
        for part in spec.split(","):
            field, _, text = part.partition("=")
            kind = type(getattr(gemm_gluon.GluonConfig(), field, None))
            if kind not in (bool, int) or not text:
                raise SystemExit(f"--variant {spec!r}: expected FIELD=VALUE with an int or bool GluonConfig field")
            changes[field] = text.lower() in ("1", "true") if kind is bool else int(text)
        for name in base:
            variant = f"{name}[{spec}]"
            try:
                table[variant] = dataclasses.replace(table[name], **changes)
            except ValueError as error:  # a change this config cannot take (its __post_init__ refused it)
                log(f"--variant {spec}: not for {name}: {error}")
                continue
            if SELECTED:
                SELECTED.append(variant)


def configs() -> list[str]:
    return [name for name in gemm_gluon.CONFIGS if not SELECTED or name in SELECTED]


def run_checks(results: dict) -> dict:
    """Every config x dtype at the odd shapes; returns {dtype name: passed}."""
    passed = {}
    for dtype in DTYPES:
        name = DTYPE_NAMES[dtype]
        ok_all = True
        for N, K, Ms in [(N, K, CHECK_MS) for N, K in CHECK_SHAPES] + [(N, K, [M]) for M, N, K in LONG_CHECKS]:
            for M in Ms:
                _, _, bias, a, a_scale, w, w_scale = operands(M, N, K, dtype, seed=M + N + K)
                for cfg_name in configs():
                    # With and without a bias (a deferred_epilogue config defers only bias-free calls).
                    variants = [("none", bias, torch.bfloat16), ("none", None, torch.bfloat16),
                                ("silu", None, torch.float16), ("gelu_tanh", bias.float(), torch.float16)]
                    for activation, b, out_dtype in variants:
                        row = {"dtype": name, "M": M, "N": N, "K": K, "config": cfg_name, "activation": activation,
                               "bias": None if b is None else str(b.dtype), "out_dtype": str(out_dtype)}
                        try:
                            out = gemm_gluon.gluon_scaled_mm(a, w, a_scale, w_scale, b, activation, out_dtype,
                                                             config=cfg_name)
                            again = gemm_gluon.gluon_scaled_mm(a, w, a_scale, w_scale, b, activation, out_dtype,
                                                               config=cfg_name)
                            torch.cuda.synchronize()
                            row.update(compare(out, reference64(a, w, a_scale, w_scale, b, activation), dtype))
                            row["repeat_bit_equal"] = bool(torch.equal(out, again))
                            row["ok"] = row["ok"] and row["repeat_bit_equal"] and tuple(out.shape) == (M, N)
                        except Exception as error:  # a compile or launch failure is a failed check, recorded
                            row.update(ok=False, error=f"{type(error).__name__}: {error}"[:2000])
                            traceback.print_exc()
                        ok_all &= row["ok"]
                        results["checks"].append(row)
                        if not row["ok"]:
                            log(f"CHECK FAILED {row}")
            log(f"checks {name} N={N} K={K}: {'ok' if ok_all else 'FAILED'}")
        passed[name] = ok_all
    return passed


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def graph_ms(fn, target_ms=5.0, replays=7) -> float:
    """GPU ms per call of ``fn`` with a cold L2: the standard GEMM benchmark's timer (a CUDA graph
    of n x (L2 flush, fn) minus one of the flushes alone, n scaled to ~target_ms of work)."""
    return adaptive_graph_ms(fn, target_ms=target_ms, replays=replays)


def triton_kind(a: torch.Tensor, gated: bool = False) -> str:
    """The Triton kernel gemm's kernel="auto" takes where the Gluon kernel does not run, by gemm's
    own rule (persistent from PERSISTENT_MIN_M, the gated one for INT8 only; tiled otherwise): the
    Triton baseline of these benchmarks, named explicitly because "auto" itself is Gluon here."""
    return "persistent" if gemm._persistent_sized(a, gated) else "tiled"


def point_ops(M, N, K, passed):
    """name -> zero-argument callable, for one (M, N, K)."""
    ops = {}
    x, w_bf16, bias, a8, as8, w8, ws8 = operands(M, N, K, FP8)
    ops["bf16"] = lambda: F.linear(x, w_bf16)
    scale_a, scale_b = as8[:, None].contiguous(), ws8[None, :].contiguous()
    w8_t = w8.t()

    use_bias = OPTIONS["bias"]
    bias_arg = bias if use_bias else None
    if use_bias:
        ops["bf16"] = lambda: F.linear(x, w_bf16, bias)

    def scaled_mm_bias():
        out = torch._scaled_mm(a8, w8_t, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                               use_fast_accum=True)
        return out.add_(bias) if use_bias else out

    ops["scaled_mm+bias"] = scaled_mm_bias
    _, _, _, ai, asi, wi, wsi = operands(M, N, K, torch.int8)
    wi_t = wi.t()

    def int_mm_epilogue():
        acc = torch._int_mm(ai, wi_t)
        out = acc.float() * asi[:, None] * wsi[None, :]
        return (out + bias.float() if use_bias else out).to(torch.bfloat16)

    if torch.int8 in DTYPES:
        ops["int_mm+epilogue"] = int_mm_epilogue
    ops["triton_fp8"] = lambda: gemm.scaled_mm(a8, w8, as8, ws8, bias_arg, kernel=triton_kind(a8))
    if torch.int8 in DTYPES:
        ops["triton_int8"] = lambda: gemm.scaled_mm(ai, wi, asi, wsi, bias_arg, kernel=triton_kind(ai))
    for dtype, (a, a_scale, w, w_scale) in ((FP8, (a8, as8, w8, ws8)), (torch.int8, (ai, asi, wi, wsi))):
        name = DTYPE_NAMES[dtype]
        if not passed.get(name):
            continue
        auto = gemm_gluon.pick_config(N, K, M, dtype).name
        for cfg_name in configs() + (["auto"] if auto in configs() else []):
            config = None if cfg_name == "auto" else cfg_name
            ops[f"gluon_{name}_{cfg_name}"] = (
                lambda a=a, w=w, s=a_scale, t=w_scale, c=config: gemm_gluon.gluon_scaled_mm(a, w, s, t, bias_arg, config=c))
        # What kernel="gluon" runs: the tuner's pick among gemm_gluon.candidates.
        ops[f"gluon_{name}_tuned"] = (
            lambda a=a, w=w, s=a_scale, t=w_scale: gemm.scaled_mm(a, w, s, t, bias_arg, kernel="gluon"))
    return ops


def timed_rounds(ops: dict, rounds: int) -> tuple[dict, dict, dict]:
    """Median us per op over ``rounds`` rounds, the op order rotated each round (the first op after
    the cuBLAS ones otherwise reads slow at >= 0.6 ms, NOTES-gemm session 5); ops that fail their
    warm-up call are left out and reported."""
    errors = {}
    for name, fn in list(ops.items()):  # compile / autotune outside the timings
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as error:
            errors[name] = f"{type(error).__name__}: {error}"[:1000]
            log(f"  {name} failed to run: {errors[name]}")
            del ops[name]
    us, samples = rotated_medians(ops, lambda fn: graph_ms(fn) * 1e3, rounds)
    return us, samples, errors


def time_point(M, N, K, passed, rounds) -> dict:
    ops = point_ops(M, N, K, passed)
    us, samples, errors = timed_rounds(ops, rounds)
    flops = 2.0 * M * N * K
    row = {"M": M, "N": N, "K": K, "us": us, "rounds_us": samples, "errors": errors,
           "tflops": {name: flops / (t * 1e-6) / 1e12 for name, t in us.items()},
           "auto_config": gemm_gluon.pick_config(N, K, M, FP8).name}
    for dtype in ("fp8", "int8"):
        mine = {n: t for n, t in us.items() if n.startswith(f"gluon_{dtype}_")}
        if mine:
            best = min(mine, key=mine.get)
            row[f"best_gluon_{dtype}"] = best
    return row


# ----------------------------------------------------------------------------------------------
# Gated mode
# ----------------------------------------------------------------------------------------------

GATED_CHECK_MS = [1, 13, 257, 1024, 2048]
GATED_CHECK_SHAPES = [(N, K) for N in (96, 384, 4096) for K in (272, 4096)] + [(389, 272)]
GATED_POINTS = [(M, 14336, 4096) for M in (1024, 4096, 16384)]


def gated_configs() -> list[str]:
    return [name for name in gemm_gluon.GATED_CONFIGS if not SELECTED or name in SELECTED]


def gated_operands(M, N, K, dtype, seed=0):
    """x (M, K) bf16, the stacked bf16 weight (2N, K), and their quantized forms (w_scale: 2N)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_bf16 = (torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16, generator=gen) * K**-0.5).to(torch.bfloat16)
    a, a_scale = reference.quantize_per_token(x, dtype)
    w, w_scale = reference.quantize_per_channel(w_bf16, dtype)
    return x, w_bf16, a, a_scale, w.contiguous(), w_scale.reshape(-1).contiguous()


def gated_reference64(a, w, a_scale, w_scale, activation):
    """float64 (act(g) * u, max|act(g)| x max|u|)."""
    full = (a.double() @ w.double().T) * a_scale.double()[:, None] * w_scale.double()[None, :]
    g, u = full.chunk(2, dim=-1)
    act = reference.apply_activation(g, activation)
    return act * u, (act.abs().max() * u.abs().max()).item()


def run_gated_checks(results: dict) -> dict:
    passed = {}
    extra = gated_configs()[0]
    for dtype in (torch.int8, FP8):
        name = DTYPE_NAMES[dtype]
        ok_all = True
        for N, K in GATED_CHECK_SHAPES:
            for M in GATED_CHECK_MS:
                _, _, a, a_scale, w, w_scale = gated_operands(M, N, K, dtype, seed=M + N + K)
                refs = {}
                runs = []
                for cfg_name in gated_configs():
                    runs.append((cfg_name, "silu", torch.bfloat16))
                    if cfg_name == extra:
                        runs.append((cfg_name, "gelu_tanh", torch.float16))
                if dtype == torch.int8 and M >= gemm.GLUON_GATED_MIN_M:
                    runs += [("gemm.gated_scaled_mm", "silu", torch.bfloat16)]
                for cfg_name, activation, out_dtype in runs:
                    row = {"gated": True, "dtype": name, "M": M, "N": N, "K": K, "config": cfg_name,
                           "activation": activation, "out_dtype": str(out_dtype)}
                    try:
                        if cfg_name == "gemm.gated_scaled_mm":
                            fn = lambda: gemm.gated_scaled_mm(a, w, a_scale, w_scale, activation, out_dtype)  # noqa: E731
                            row["picked"] = gemm._pick_kernel("auto", a, w, torch.empty(M, N, dtype=out_dtype,
                                                                                          device="cuda"),
                                                              True, None, (True, True, True, False, 2, False), True)
                        else:
                            fn = lambda: gemm_gluon.gluon_gated_scaled_mm(a, w, a_scale, w_scale, activation,  # noqa: E731
                                                                          out_dtype, config=cfg_name)
                        out = fn()
                        again = fn()
                        torch.cuda.synchronize()
                        if activation not in refs:
                            refs[activation] = gated_reference64(a, w, a_scale, w_scale, activation)
                        ref, scale = refs[activation]
                        row.update(compare(out, ref, dtype, scale=scale))
                        row["repeat_bit_equal"] = bool(torch.equal(out, again))
                        row["ok"] = row["ok"] and row["repeat_bit_equal"] and tuple(out.shape) == (M, N)
                    except Exception as error:
                        row.update(ok=False, error=f"{type(error).__name__}: {error}"[:2000])
                        traceback.print_exc()
                    ok_all &= row["ok"]
                    results["checks"].append(row)
                    if not row["ok"]:
                        log(f"CHECK FAILED {row}")
            log(f"gated checks {name} N={N} K={K}: {'ok' if ok_all else 'FAILED'}")
        passed[name] = ok_all
    return passed


def gated_point_ops(M, N, K, passed, dtypes):
    ops = {}
    x, w_bf16, _, _, _, _ = gated_operands(M, N, K, torch.int8)

    def bf16():
        g, u = F.linear(x, w_bf16).chunk(2, dim=-1)
        return F.silu(g) * u

    ops["bf16"] = bf16
    for dtype in dtypes:
        name = DTYPE_NAMES[dtype]
        _, _, a, a_scale, w, w_scale = gated_operands(M, N, K, dtype)
        # Pinned for FP8 too: with kernel "auto", gated FP8 has run on the gated Gluon kernel since
        # session 11, and this op then timed that kernel, not the Triton baseline.
        ops[f"triton_gated_{name}"] = (lambda a=a, w=w, s=a_scale, t=w_scale, kind=triton_kind(a, gated=True):
                                       gemm.gated_scaled_mm(a, w, s, t, "silu", kernel=kind))
        if not passed.get(name):
            continue
        w_gate, w_up, s_gate, s_up = w[:N], w[N:], w_scale[:N], w_scale[N:]

        def two_gemms(a=a, s=a_scale, wg=w_gate, wu=w_up, sg=s_gate, su=s_up):
            g = gemm.scaled_mm(a, wg, s, sg, kernel="gluon")
            u = gemm.scaled_mm(a, wu, s, su, kernel="gluon")
            return F.silu(g) * u

        ops[f"gluon_2gemm_{name}"] = two_gemms
        for cfg_name in gated_configs():
            ops[f"gluon_{name}_{cfg_name}"] = (
                lambda a=a, w=w, s=a_scale, t=w_scale, c=cfg_name: gemm_gluon.gluon_gated_scaled_mm(a, w, s, t, "silu",
                                                                                                     config=c))
        # The tuner's pick among the gated candidates (what kernel="gluon" runs), INT8 and FP8.
        ops[f"gluon_{name}_gated_auto"] = (
            lambda a=a, w=w, s=a_scale, t=w_scale: gemm.gated_scaled_mm(a, w, s, t, "silu", kernel="gluon"))
    return ops


def time_gated_point(M, N, K, passed, rounds, dtypes) -> dict:
    ops = gated_point_ops(M, N, K, passed, dtypes)
    us, samples, errors = timed_rounds(ops, rounds)
    flops = 2.0 * M * 2 * N * K
    tuned = {f"{key[0]}x{key[1]} m{key[2]} {DTYPE_NAMES.get(key[3], key[3])}{' gated' if key[-1] else ''}": cfg.name
             for key, cfg in gemm_gluon._TUNED.items() if key[1] == K and key[0] == N}
    row = {"M": M, "N": N, "K": K, "us": us, "rounds_us": samples, "errors": errors, "tuned": tuned,
           "tflops": {name: flops / (t * 1e-6) / 1e12 for name, t in us.items()}}
    for dtype in dtypes:
        name = DTYPE_NAMES[dtype]
        mine = {n: t for n, t in us.items() if n.startswith(f"gluon_{name}_gated_")}
        if mine:
            row[f"best_gluon_gated_{name}"] = min(mine, key=mine.get)
    return row


def gated_text_report(results: dict) -> str:
    meta = results["meta"]
    lines = [f"Gluon gated GEMM, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
             f"{meta['commit']}, {meta['date']}", ""]
    n_ok = sum(r["ok"] for r in results["checks"])
    lines.append(f"checks: {n_ok}/{len(results['checks'])} passed; per dtype {results.get('checks_passed', {})}")
    lines += ["", "| M | N x K | bf16 (+silu*mul) | triton gated int8 | 2 gluon GEMMs + silu*mul | gluon gated best "
              "(config) | gated auto | best vs 2 GEMMs | best vs triton gated | best vs bf16 |", "|" + "---|" * 10]
    fmt = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
    for row in results["rows"]:
        us = row["us"]
        best = row.get("best_gluon_gated_int8")
        gb = us.get(best) if best else None
        two, tri, bf = us.get("gluon_2gemm_int8"), us.get("triton_gated_int8"), us.get("bf16")
        lines.append(f"| {row['M']} | {row['N']}x{row['K']} | {fmt(bf)} | {fmt(tri)} | {fmt(two)} | {fmt(gb)} "
                     f"({(best or '-').replace('gluon_int8_', '')}) | {fmt(us.get('gluon_int8_gated_auto'))} | "
                     f"{ratio(two, gb):.3f} | {ratio(tri, gb):.3f} | {ratio(bf, gb):.3f} |")
    lines += ["", "Every op (us median / TFLOP/s over the 2 x M x 2N x K of both halves):", ""]
    for row in results["rows"]:
        lines.append(f"M={row['M']} N={row['N']} K={row['K']} tuned {row['tuned']}")
        for name in sorted(row["us"]):
            spread = ", ".join(f"{v:.1f}" for v in row["rounds_us"][name])
            lines.append(f"  {name:40s} {row['us'][name]:9.1f} us {row['tflops'][name]:7.1f} TFLOP/s   [{spread}]")
        lines += [f"  {name}: FAILED {err}" for name, err in row["errors"].items()]
    return _finish_report(lines, results)


def _finish_report(lines: list[str], results: dict) -> str:
    if results.get("skipped_points"):
        lines += ["", f"skipped (deadline): {results['skipped_points']}"]
    return "\n".join(lines) + "\n"


def write_gated(results: dict, out: Path) -> None:
    write(results, out, "gemm_gluon_gated", gated_text_report)


def main_gated(args) -> None:
    results = {"meta": {**metadata(), "gated": True,
                        "gated_configs": {n: vars(c) for n, c in gemm_gluon.GATED_CONFIGS.items()}},
               "checks": [], "rows": [], "skipped_points": []}
    log(f"gated mode; {results['meta']['gpu']} gluon available: {results['meta']['gluon_available']}")
    if not results["meta"]["gluon_available"]:
        write_gated(results, args.out)
        raise SystemExit("gemm_gluon.available() is False here: needs an sm_90 GPU and triton 3.6's Gluon")
    passed = {"fp8": True, "int8": True} if args.skip_checks else run_gated_checks(results)
    results["checks_passed"] = passed
    write_gated(results, args.out)
    log(f"gated checks done: {passed}")
    if args.checks_only:
        return
    dtypes = [torch.int8] + ([FP8] if args.gated_fp8 else [])
    points = GATED_POINTS
    if args.points:
        points = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",")]
    for M, N, K in points:
        if elapsed() > args.deadline:
            results["skipped_points"].append([M, N, K])
            continue
        log(f"gated point M={M} N={N} K={K}")
        try:
            row = time_gated_point(M, N, K, passed, args.rounds, dtypes)
        except torch.cuda.OutOfMemoryError as error:
            results["skipped_points"].append([M, N, K, f"OOM: {error}"[:300]])
            torch.cuda.empty_cache()
            continue
        results["rows"].append(row)
        log("  " + "  ".join(f"{n}={t:.1f}" for n, t in row["us"].items()))
        write_gated(results, args.out)
        torch.cuda.empty_cache()
    write_gated(results, args.out)
    log(f"done; results in {args.out}")


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

def ratio(num, den):
    return num / den if num and den else float("nan")


def text_report(results: dict) -> str:
    meta = results["meta"]
    lines = [f"Gluon GEMM, {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit {meta['commit']}, "
             f"{meta['date']}", ""]
    passed = results.get("checks_passed", {})
    n_ok = sum(r["ok"] for r in results["checks"])
    lines.append(f"checks: {n_ok}/{len(results['checks'])} passed; per dtype {passed}")
    lines.append("")
    head = ("| M | N x K | bf16 | _scaled_mm+bias | _int_mm+epi | triton fp8 | gluon fp8 best (config) | "
            "fp8 gluon/_scaled_mm | fp8 triton/_scaled_mm | triton int8 | gluon int8 best (config) | "
            "int8 gluon vs bf16 | int8 triton vs bf16 |")
    lines += [head, "|" + "---|" * 13]
    for row in results["rows"]:
        us = row["us"]
        bf, sm, im = us.get("bf16"), us.get("scaled_mm+bias"), us.get("int_mm+epilogue")
        tf, ti = us.get("triton_fp8"), us.get("triton_int8")
        bf8 = row.get("best_gluon_fp8")
        bi8 = row.get("best_gluon_int8")
        gf = us.get(bf8) if bf8 else None
        gi = us.get(bi8) if bi8 else None
        fmt = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
        lines.append(
            f"| {row['M']} | {row['N']}x{row['K']} | {fmt(bf)} | {fmt(sm)} | {fmt(im)} | {fmt(tf)} | "
            f"{fmt(gf)} ({(bf8 or '-').replace('gluon_fp8_', '')}) | {ratio(sm, gf):.3f} | {ratio(sm, tf):.3f} | "
            f"{fmt(ti)} | {fmt(gi)} ({(bi8 or '-').replace('gluon_int8_', '')}) | {ratio(bf, gi):.3f} | "
            f"{ratio(bf, ti):.3f} |")
    lines += ["", "Every op (us median / TFLOP/s; ratio = baseline us / op us; fp8 vs _scaled_mm+bias, "
              "int8 vs bf16 and vs _int_mm+epi):", ""]
    for row in results["rows"]:
        us, tf = row["us"], row["tflops"]
        lines.append(f"M={row['M']} N={row['N']} K={row['K']} (auto pick {row['auto_config']})")
        for name in sorted(us):
            extra = ""
            if "fp8" in name:
                extra = f"  x{ratio(us.get('scaled_mm+bias'), us[name]):.3f} _scaled_mm"
            elif "int8" in name:
                extra = (f"  x{ratio(us.get('bf16'), us[name]):.3f} bf16  "
                         f"x{ratio(us.get('int_mm+epilogue'), us[name]):.3f} _int_mm+epi")
            spread = ", ".join(f"{v:.1f}" for v in row["rounds_us"][name])
            lines.append(f"  {name:32s} {us[name]:9.1f} us {tf[name]:7.1f} TFLOP/s{extra}   [{spread}]")
        lines += [f"  {name}: FAILED {err}" for name, err in row["errors"].items()]
    return _finish_report(lines, results)


def write(results: dict, out: Path, stem: str = "gemm_gluon", report=None) -> None:
    """results as ``stem``.json and its text report as ``stem``.txt under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.txt").write_text((report or text_report)(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=500.0, help="no new timing point past this many seconds")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--points", default="", help="comma-separated M:N:K subset (default: all 12)")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--configs", default="", help="comma-separated config names (default: all)")
    parser.add_argument("--no-bias", action="store_true", help="plain epilogue: no bias in any op")
    parser.add_argument("--gated", action="store_true", help="the gated mode: gated checks, gate_up timings")
    parser.add_argument("--gated-fp8", action="store_true", help="gated timings: FP8 ops too")
    parser.add_argument("--checks-only", action="store_true", help="gated mode: no timings")
    parser.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE",
                        help="also run each selected config with this GluonConfig field changed (repeatable)")
    parser.add_argument("--dtypes", default="fp8,int8", help="which of fp8,int8 to check and time")
    args = parser.parse_args()
    OPTIONS["bias"] = not args.no_bias
    SELECTED[:] = [name for name in args.configs.split(",") if name]
    DTYPES[:] = [dtype for dtype, name in DTYPE_NAMES.items() if name in args.dtypes.split(",")]
    add_variants(args.variant, gated=args.gated)
    if args.gated:
        main_gated(args)
        return

    results = {"meta": {**metadata(), "bias": OPTIONS["bias"]}, "checks": [], "rows": [], "skipped_points": []}
    log(f"{results['meta']['gpu']} torch {torch.__version__} triton {triton.__version__}; "
        f"gluon available: {results['meta']['gluon_available']}")
    if not results["meta"]["gluon_available"]:
        write(results, args.out)
        raise SystemExit("gemm_gluon.available() is False here: needs an sm_90 GPU and triton 3.6's Gluon")
    if args.skip_checks:
        passed = {DTYPE_NAMES[dtype]: True for dtype in DTYPES}
    else:
        passed = run_checks(results)
    results["checks_passed"] = passed
    write(results, args.out)
    log(f"checks done: {passed}")

    points = POINTS
    if args.points:
        points = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",")]
    for M, N, K in points:
        if elapsed() > args.deadline:
            results["skipped_points"].append([M, N, K])
            continue
        log(f"point M={M} N={N} K={K}")
        try:
            row = time_point(M, N, K, passed, args.rounds)
        except torch.cuda.OutOfMemoryError as error:
            results["skipped_points"].append([M, N, K, f"OOM: {error}"[:300]])
            torch.cuda.empty_cache()
            continue
        results["rows"].append(row)
        us = row["us"]
        log("  " + "  ".join(f"{n}={t:.1f}" for n, t in us.items()))
        write(results, args.out)
        torch.cuda.empty_cache()
    write(results, args.out)
    log(f"done; results in {args.out}")


if __name__ == "__main__":
    main()
