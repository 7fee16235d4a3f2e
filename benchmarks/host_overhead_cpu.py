"""Host (Python) time per decoder layer of the eager prefill forward, on a CPU, kernels stubbed.

    python benchmarks/host_overhead_cpu.py [--out benchmarks/results/host_overhead_cpu.json]
        [--reps 12] [--block 5] [--tokens 64] [--layers 32] [--variants ...] [--gc-modes on,off,freeze]
        [--profile] [--gemm-breakdown]
    python benchmarks/host_overhead_cpu.py --compare REF [--rounds 3]   # REF's quantkit vs this tree's

Why: on the H100, eager prefill of the Llama-3-8B shape at 1x2048 is host-bound for quantkit
(~300 launches issued from Python against ~32 ms of GPU work; NOTES-e2e, session 5). What the
host spends is Python: our modules and launchers, HF's modules, and the garbage collector. This
measures exactly that, without a GPU: a tiny-width Llama (hidden 64, 4 q / 2 kv heads of 64,
GQA) quantized with ``quantkit.quantize`` (int8 / fp8 presets), ``optimize(exact=False)``, its
modules switched to the Triton backend, and the kernels replaced by stubs at the narrowest points
(``host_stubs.py``: only triton's launch itself is skipped; our validation, allocation, plans,
keys and cached-launch path all run). HF's own model runs the same forward with its real torch ops on
tiny tensors: their cost is HF's own host cost (on the GPU each is a launch of about the same host
time), reported as a reference; in float32, because this CPU's bf16 matmuls are compute-bound.
Variants ``<name>@<level>`` stub more (``host_stubs.set_level``): ``@ops`` leaves the modules'
and HF's Python, ``@gemm`` / ``@gemm-check`` remove the GEMM launchers / their validation, so
differences to the plain variant split the per-layer cost.

Per layer: the forward is timed for ``--layers`` and for 2 layers; (t_L - t_2) / (L - 2) is the
per-layer cost (embedding, masks, rotary tables, final norm and lm_head cancel out). Tokens:
``--tokens`` (64) so that HF's torch ops stay tiny; the GEMM launcher's kernel choice (persistent
from M = 1024) is forced to what 1x2048 takes, so the Python path is that of the GPU run.

Timing: every (variant, gc mode) block of ``--block`` forwards is interleaved with all the others,
``--reps`` times; medians and minimums over all forwards of thread CPU time (wall time as well).
Other jobs on a shared machine slow whole stretches down; the minimum is the cost without them.
``--compare REF`` runs child processes alternately on REF's ``quantkit`` (``git archive``) and
this tree's, with this tree's harness, and reports the saving also against HF's unchanged model
measured in the same child (machine drift between children cancels). gc modes: ``on`` (Python's default),
``off`` (``gc.disable()``), ``freeze`` (``gc.collect(); gc.freeze()`` after warm-up, gc enabled).
In ``on`` mode a gc callback counts collections per generation and the time spent in them.
torch runs single-threaded (``torch.set_num_threads(1)``): on a shared 2-core machine intra-op
threads turned a 4096-element ``sin`` into ~8 ms of lock waiting.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# "<variant>@<level>": the same model with more stubbed (host_stubs.set_level): "@ops" leaves the
# modules' and HF's Python; "@gemm" / "@gemm-check" remove the GEMM launchers / their validation.
VARIANTS = ("hf-fp32", "int8-fast", "fp8-fast", "int8-fast@ops", "fp8-fast@ops", "int8-fast@gemm", "fp8-fast@gemm",
            "int8-fast@gemm-check", "fp8-fast@gemm-check")
GC_MODES = ("on", "off", "freeze")


def _tiny_config(layers: int, vocab: int = 256):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def build_variant(variant: str, layers: int):
    """hf-fp32 (HF eager, sdpa) or <scheme>-fast (bf16, quantize + optimize(exact=False), Triton backend)."""
    import torch

    from quantkit.api import quantize
    from quantkit.bench.e2e import build_model
    from quantkit.config import QuantConfig
    from quantkit.models.fast_attention import register_quantkit_attention
    from quantkit.models.fast_path import optimize

    torch.manual_seed(0)
    if variant == "hf-fp32":
        # float32: the same modules, Python and op count as HF's bf16 model, but this CPU runs bf16
        # matmuls slowly (~350 us for a 64 x 64 x 256 linear), which is compute, not host time.
        return build_model(_tiny_config(layers), "cpu", torch.float32)
    model = build_model(_tiny_config(layers), "cpu")
    scheme, _, mode = variant.partition("-")
    if mode != "fast":
        raise ValueError(f"variant {variant!r}: use hf-fp32 or <int8|fp8>-fast")
    # Built on the torch backend (optimize's norm probes compute real values there), then switched
    # to the Triton backend, whose launchers run up to the stubbed launch.
    quantize(model, QuantConfig.preset(scheme, backend="torch"), progress=False)
    optimize(model, exact=False)
    for module in model.modules():
        if getattr(module, "backend", None) == "torch":
            module.backend = "triton"
    model.set_attn_implementation(register_quantkit_attention(backend="triton", device="cpu"))
    return model


def set_gc_mode(mode: str) -> None:
    gc.unfreeze()
    if mode == "off":
        gc.disable()
        return
    gc.enable()
    if mode == "freeze":
        gc.collect()
        gc.freeze()


class GcMeter:
    """Counts collections per generation and the seconds spent in them (gc.callbacks)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            generation = info["generation"]
            self.counts[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._start


def _forward_fn(model, tokens: int, vocab: int, level: str = "launch"):
    import torch

    import host_stubs

    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def forward():
        # Set on every call (a comparison when unchanged), so blocks of all levels interleave.
        host_stubs.set_level(level)
        return model(ids, use_cache=False, logits_to_keep=1)

    return forward


def _summary(samples: list[float]) -> dict:
    return {"median_ms": statistics.median(samples) * 1e3, "min_ms": min(samples) * 1e3, "n": len(samples)}


def measure(args) -> dict:
    """Interleaved timing of every (variant, depth, gc mode); per-layer slopes; gc statistics."""
    import torch

    torch.set_num_threads(1)
    import host_stubs

    host_stubs.install()
    from quantkit.kernels import gemm

    # The kernel choice of M >= PERSISTENT_MIN_M (1x2048 takes the persistent GEMM) at --tokens rows.
    gemm.PERSISTENT_MIN_M = min(gemm.PERSISTENT_MIN_M, args.tokens)
    depths = (args.layers, 2)
    forwards = {}
    reports = {}
    models = {}
    for variant in args.variants:
        base, _, level = variant.partition("@")
        level = level or "launch"
        if level not in host_stubs.LEVELS:
            raise ValueError(f"variant {variant!r}: the stub level after '@' is one of {host_stubs.LEVELS}")
        for layers in depths:
            if (base, layers) not in models:
                models[(base, layers)] = build_variant(base, layers)
            model = models[(base, layers)]
            reports[base] = str(getattr(model, "quantkit_fast_path", "HF eager (sdpa)"))
            forward = _forward_fn(model, args.tokens, model.config.vocab_size, level)
            for _ in range(3):  # first calls per launch key take the (stubbed) compile/autotune path
                forward()
            forwards[(variant, layers)] = forward
    keys = [(v, d, m) for v in args.variants for d in depths for m in args.gc_modes]
    samples = {key: [] for key in keys}  # thread CPU seconds per forward
    wall = {key: [] for key in keys}  # wall seconds per forward
    meter = GcMeter()
    gc_stats = {(v, d): [[0, 0, 0], [0.0, 0.0, 0.0], 0] for v in args.variants for d in depths}
    for _ in range(args.reps):
        for mode in args.gc_modes:
            for (variant, layers), forward in forwards.items():
                set_gc_mode(mode)
                forward()  # one untimed call after a mode switch (the switch itself may collect)
                if mode == "on":
                    meter.counts, meter.seconds = [0, 0, 0], [0.0, 0.0, 0.0]
                    gc.callbacks.append(meter)
                for _ in range(args.block):
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    forward()
                    cpu = time.thread_time() - start_cpu
                    samples[(variant, layers, mode)].append(cpu)
                    wall[(variant, layers, mode)].append(time.perf_counter() - start)
                if mode == "on":
                    gc.callbacks.remove(meter)
                    stats = gc_stats[(variant, layers)]
                    for g in range(3):
                        stats[0][g] += meter.counts[g]
                        stats[1][g] += meter.seconds[g]
                    stats[2] += args.block
    set_gc_mode("on")
    rows = []
    for variant in args.variants:
        for mode in args.gc_modes:
            deep, shallow = (_summary(samples[(variant, d, mode)]) for d in depths)
            per_layer = {k: (deep[k] - shallow[k]) / (depths[0] - depths[1]) * 1e3 for k in ("median_ms", "min_ms")}
            deep_wall = _summary(wall[(variant, depths[0], mode)])
            rows.append({"variant": variant, "gc": mode, f"forward_{depths[0]}_layers": deep,
                         "forward_2_layers": shallow, "per_layer_us_median": per_layer["median_ms"],
                         "per_layer_us_min": per_layer["min_ms"], f"wall_forward_{depths[0]}_layers": deep_wall})
        if "on" in args.gc_modes:
            counts, seconds, n = gc_stats[(variant, depths[0])]
            rows[-len(args.gc_modes)]["gc_per_forward"] = {
                "collections_gen0_1_2": [c / n for c in counts], "ms_gen0_1_2": [s / n * 1e3 for s in seconds]}
    # What one full collection costs with this heap (torch, transformers, the models): the price
    # of a gen-2 collection should one start during a forward.
    gc.collect()
    start = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - start) * 1e3
    result = {"rows": rows, "reports": reports, "gc_tracked_objects": len(gc.get_objects()),
              "gc_full_collection_ms": full_ms, "gc_thresholds": gc.get_threshold()}
    if args.profile:
        result["profiles"] = {v: _profile(forwards[(v, depths[0])]) for v in args.variants}
    if args.gemm_breakdown:
        host_stubs.set_level("launch")
        result["gemm_call_us"] = gemm_call_breakdown(args.tokens)
    return result


def gemm_call_breakdown(tokens: int) -> dict:
    """Python us per call of one persistent GEMM (tight loop, minimum of 9 repeats) and of its parts:
    the share of gemm.py / gemm_tma.py in the per-call cost (written up, not changed here)."""
    import timeit

    import torch

    from quantkit.kernels import gemm, gemm_tma, quant

    def us(fn, n: int = 4000) -> float:
        for _ in range(200):
            fn()
        return min(timeit.repeat(fn, number=n, repeat=9)) / n * 1e6

    result = {}
    for dtype in (torch.int8, torch.float8_e4m3fn):
        q, a_scale = quant.quantize_per_token(torch.randn(tokens, 64, dtype=torch.bfloat16), dtype)
        w, w_scale = quant.quantize_per_token(torch.randn(256, 64, dtype=torch.bfloat16), dtype)
        out = torch.empty(tokens, 256, dtype=torch.bfloat16)
        flags = (dtype == torch.int8, True, True, False, 0, False)
        gemm.scaled_mm(q, w, a_scale, w_scale)  # plans and the launch key exist from here on
        result[str(dtype)] = {
            "scaled_mm": us(lambda: gemm.scaled_mm(q, w, a_scale, w_scale)),
            "check_scaled_mm_args": us(lambda: gemm.check_scaled_mm_args(q, w, a_scale, w_scale, None, "none",
                                                                        torch.bfloat16)),
            "_output (torch.empty)": us(lambda: gemm._output(None, tokens, 256, torch.bfloat16, q.device)),
            "_launch": us(lambda: gemm._launch(q, w, a_scale, w_scale, None, out, "none", False, False)),
            "_pick_kernel (descriptors_ok)": us(lambda: gemm._pick_kernel("auto", q, w, out, False, None, flags,
                                                                                 dtype != torch.int8)),
            "launch_persistent": us(lambda: gemm_tma.launch_persistent(q, w, out, a_scale, w_scale, None, flags,
                                                                       gemm.m_bucket(tokens), dtype != torch.int8,
                                                                       False)),
            "_workspace_args": us(lambda: gemm_tma._workspace_args(q, 0, 128 * 128)),
            "weight_descriptor": us(lambda: gemm_tma.weight_descriptor(w, 128, 128)),
        }
    return result


def _profile(forward, calls: int = 20, top: int = 40) -> str:
    set_gc_mode("off")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        forward()
    profiler.disable()
    set_gc_mode("on")
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.strip_dirs().sort_stats(os.environ.get("QUANTKIT_PROFILE_SORT", "tottime")).print_stats(top)
    return buffer.getvalue()


def environment() -> dict:
    import torch
    import transformers
    import triton

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE,
                            check=False).stdout.strip()
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average": os.getloadavg()}


def print_table(result: dict, title: str = "") -> None:
    if title:
        print(title)
    print(f"{'variant':>14s} {'gc':>6s} {'fwd ms (median)':>16s} {'fwd ms (min)':>13s} "
          f"{'us/layer (med)':>15s} {'us/layer (min)':>15s} {'wall fwd ms':>12s}  gc per forward (gen0/1/2, ms)")
    for row in result["rows"]:
        deep = next(v for k, v in row.items() if k.startswith("forward_") and k != "forward_2_layers")
        deep_wall = next(v for k, v in row.items() if k.startswith("wall_forward_"))
        gc_note = ""
        if "gc_per_forward" in row:
            g = row["gc_per_forward"]
            gc_note = ("  " + "/".join(f"{c:.1f}" for c in g["collections_gen0_1_2"]) + ", "
                       + "/".join(f"{s:.2f}" for s in g["ms_gen0_1_2"]))
        print(f"{row['variant']:>14s} {row['gc']:>6s} {deep['median_ms']:16.2f} {deep['min_ms']:13.2f} "
              f"{row['per_layer_us_median']:15.1f} {row['per_layer_us_min']:15.1f} {deep_wall['median_ms']:12.2f}"
              f"{gc_note}")


# ---------------------------------------------------------------------------------------------- A/B


def _export_tree(ref: str, into: Path) -> Path:
    """``git archive`` of ``ref``'s quantkit package into ``into`` (the harness stays this tree's)."""
    archive = subprocess.run(["git", "archive", ref, "quantkit"], cwd=HERE.parent, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _run_child(tree: Path, args, out: Path) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--out", str(out), "--reps", str(args.reps),
            "--block", str(args.block), "--tokens", str(args.tokens), "--layers", str(args.layers),
            "--variants", ",".join(args.variants), "--gc-modes", ",".join(args.gc_modes)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE)])}
    env.pop("TRITON_INTERPRET", None)
    subprocess.run(argv, env=env, check=True)
    return json.loads(out.read_text())


def compare(args) -> dict:
    """Alternate child processes on REF's quantkit and this tree's, ``--rounds`` times each."""
    runs = {"ref": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"ref": _export_tree(args.compare, Path(tmp)), "new": HERE.parent}
        for round_ in range(args.rounds):
            for name in ("ref", "new") if round_ % 2 == 0 else ("new", "ref"):
                runs[name].append(_run_child(trees[name], args, Path(tmp) / f"{name}{round_}.json"))
    table = compare_table(runs)
    return {"ref": args.compare, "rounds": args.rounds, "table": table, "runs": runs}


def compare_table(runs: dict) -> list[dict]:
    """Per (variant, gc mode): per-layer us of REF and of this tree (median over child runs, of the
    per-run minimum- and median-based slopes), the saving, and, with hf-fp32 among the variants,
    the saving measured against HF's unchanged model in the same child (machine drift cancels)."""
    table = []
    for row_index, row in enumerate(runs["new"][0]["rows"]):
        entry = {"variant": row["variant"], "gc": row["gc"]}
        control = next((i for i, r in enumerate(row_ for row_ in runs["new"][0]["rows"])
                        if r["variant"] == "hf-fp32" and r["gc"] == row["gc"]), None)
        for name in ("ref", "new"):
            rows = [run["rows"][row_index] for run in runs[name]]
            deep = [next(v for k, v in r.items() if k.startswith("forward_") and k != "forward_2_layers") for r in rows]
            for stat in ("min", "median"):
                per_layer = [r[f"per_layer_us_{stat}"] for r in rows]
                entry[f"{name}_per_layer_us_{stat}"] = statistics.median(per_layer)
                entry[f"{name}_per_layer_us_{stat}_runs"] = per_layer
                entry[f"{name}_forward_ms_{stat}"] = statistics.median(d[f"{stat}_ms"] for d in deep)
            if control is not None:
                entry[f"{name}_vs_hf_min"] = statistics.median(
                    run["rows"][row_index]["per_layer_us_min"] / run["rows"][control]["per_layer_us_min"]
                    for run in runs[name])
        for stat in ("min", "median"):
            entry[f"saved_per_layer_us_{stat}"] = entry[f"ref_per_layer_us_{stat}"] - entry[f"new_per_layer_us_{stat}"]
        if control is not None:
            hf_ref = statistics.median(run["rows"][control]["per_layer_us_min"] for run in runs["ref"])
            entry["saved_per_layer_us_min_vs_hf"] = (entry["ref_vs_hf_min"] - entry["new_vs_hf_min"]) * hf_ref
        table.append(entry)
    # Minimums first: other jobs on a shared machine slow whole stretches of forwards down, and
    # the minimum over interleaved forwards is the cost without that interference.
    print(f"{'variant':>14s} {'gc':>6s} {'ref us/layer min':>17s} {'new':>8s} {'saved':>7s} {'vs HF':>7s} | "
          f"{'ref median':>11s} {'new':>8s} {'saved':>7s}")
    for e in table:
        print(f"{e['variant']:>14s} {e['gc']:>6s} {e['ref_per_layer_us_min']:17.1f} {e['new_per_layer_us_min']:8.1f} "
              f"{e['saved_per_layer_us_min']:7.1f} {e.get('saved_per_layer_us_min_vs_hf', float('nan')):7.1f} | "
              f"{e['ref_per_layer_us_median']:11.1f} {e['new_per_layer_us_median']:8.1f} "
              f"{e['saved_per_layer_us_median']:7.1f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    parser.add_argument("--reps", type=int, default=12, help="interleaved rounds over all (variant, gc mode) blocks")
    parser.add_argument("--block", type=int, default=5, help="forwards per block")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--gc-modes", default=",".join(GC_MODES))
    parser.add_argument("--profile", action="store_true",
                        help="add a cProfile (gc off) of each variant (sorted by QUANTKIT_PROFILE_SORT, default tottime)")
    parser.add_argument("--gemm-breakdown", action="store_true", help="add Python us per GEMM call and its parts")
    parser.add_argument("--compare", default=None, metavar="REF", help="A/B: REF's quantkit against this tree's")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per side with --compare")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    args.gc_modes = args.gc_modes.split(",")
    unknown = set(args.gc_modes) - set(GC_MODES)
    if unknown:
        raise SystemExit(f"--gc-modes {sorted(unknown)}: choose from {GC_MODES}")
    if args.layers <= 2:
        raise SystemExit(f"--layers={args.layers}: the per-layer slope needs more than 2 layers")
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    if not args.child:
        sys.path.insert(0, str(HERE.parent))
    if args.compare:
        result = {"environment": environment(), "compare": compare(args)}
    else:
        result = {"environment": environment(), "settings": {k: v for k, v in vars(args).items() if k != "child"},
                  **measure(args)}
        if not args.child:
            print_table(result)
            print(f"gc: {result['gc_tracked_objects']} tracked objects, a full collection "
                  f"{result['gc_full_collection_ms']:.1f} ms")
            for dtype, parts in result.get("gemm_call_us", {}).items():
                print(f"GEMM call {dtype}: " + ", ".join(f"{name} {value:.1f}" for name, value in parts.items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
