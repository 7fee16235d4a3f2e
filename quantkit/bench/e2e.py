"""End-to-end benchmark: HF transformers bf16 (sdpa) vs quantkit fp8 / int8 on a Llama-3-8B shape.

Random weights (speed does not depend on values), built directly on the device in bf16.
Workloads, each timed after warm-up, median of a few runs (CUDA events):
- prefill: ``model(ids, use_cache=False, logits_to_keep=1)`` at 1x2048 and 4x2048 -> tokens/s;
- decode: 512-token prompt, 128 new tokens, batch 1 and 8 -> ms/token of the decode phase,
  the median of DECODE_RUNS runs on both sides.
  HF: ``model.generate`` (DynamicCache, eager), (t(128 new) - t(1 new)) / 127.
  quantkit: ``quantkit.generate.generate`` (static cache, CUDA-graph decode), decode time / 127.
  So the decode ratio compares the two generate paths as a user runs them (HF's eager loop
  against quantkit's graph-captured one), not kernels alone: most of HF's time per token is
  Python and launches.
- prefill through ``quantkit.graphed`` (every variant, the baseline too): the same forward
  captured as a CUDA graph on its first call, later calls timed from the host (input copy,
  replay, output clone), bit-equality with the eager logits recorded; what a caller repeating a
  shape gets without the ~10 launches x 25-40 us of Python per layer of an eager forward;
- garbage collector: after each variant's warm-up and before its timed runs, ``gc.collect();
  gc.freeze()`` (every variant alike, HF bf16 included; undone with ``gc.unfreeze()`` after the
  variant). Everything alive then (the model, torch's and transformers' module state) moves to
  the permanent generation, so a collection that happens to start during a timed forward walks
  only what that forward allocated, not the whole heap. Recorded as ``gc_frozen_objects`` per
  row. A steady-state prefill forward triggered no collection at all in the CPU measurement
  (benchmarks/NOTES-e2e.md, session 6): this only keeps a collection left over from building
  the model out of the timed runs;
- memory: each variant runs in its own process (``isolate=True``), so nothing an earlier variant
  left in the caching allocator, cuBLAS workspaces or Triton's autotuner counts against a later
  one. ``model_bytes`` = memory allocated once the model is built (and quantized/optimized),
  before any forward: the weights alone. ``peak_bytes`` = ``torch.cuda.max_memory_allocated``
  over the eager inference workloads after a warm-up pass (compiles and autotuning excluded),
  ``workload_peak_bytes`` the same per workload; the graphed prefill runs afterwards (its own
  peak, graph pool included, is ``graph_peak_bytes``).

Variants: "hf-bf16" (the baseline), per scheme "plain" (QuantLinears only, HF sdpa attention),
"fast-exact" (``optimize(exact=True)``: greedy-identical to plain), "fast" (``exact=False``:
fused gated kernel, Triton norms, norms fused with the next layer's quantization) and, on
request, "fast-no-norm-quant" (``exact=False, norm_quant=False``: the norm writes its 16-bit
output and the consumers quantize it, for comparison) and "fast-no-residual" (``exact=False,
residual_add=False``: residual adds as separate kernels). Ratios are against hf-bf16 of the same run.
When torchao is installed, "torchao-fp8" / "torchao-int8" follow: the HF bf16 model after torchao's
``quantize_`` with its dynamic per-row FP8 / INT8 weight-and-activation configs, run the way HF
runs (eager forward, ``model.generate``), like the baseline; its graphed prefill column
is the same wrapper around its forward.

``run_fast_path_checks`` first checks, on small random Llama and Gemma-3 models on the same
device, each mode that is timed (``_fast_path_passed``): exact mode's logits and greedy tokens
equal the plain path's, exact=False's logits are as close to the unquantized model's as the
plain path's, and CUDA-graph decode equals eager decode. A failure stops the run before any
timing (CheckFailed; the check rows go to ``{prefix}_checks_failed.json``).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from quantkit.api import quantize
from quantkit.bench.common import CheckFailed, rel_err, require_matplotlib, write_rows
from quantkit.config import QuantConfig
from quantkit.generate import generate
from quantkit.models.fast_attention import register_quantkit_attention
from quantkit.models.fast_path import optimize
from quantkit.models.graphed import GraphedForward

PREFILL_SHAPES = ((1, 2048), (4, 2048))
DECODE_BATCHES = (1, 8)
PROMPT_LEN, NEW_TOKENS = 512, 128
DECODE_RUNS = 3  # timed generate() runs per decode point, both sides; the median is reported
SCHEMES = ("fp8", "int8")
MODES = ("plain", "fast-exact", "fast")
# Not in the default list: the fast path with the norm + quantization fusion off (comparison).
EXTRA_MODES = ("fast-no-norm-quant", "fast-no-residual")
TARGETS = {"prefill_fp8": 1.7, "prefill_int8": 1.4, "decode_b1_ms": 6.0, "memory_ratio": 0.6}


def llama3_8b_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
        bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def build_model(config, device: str, dtype=torch.bfloat16) -> torch.nn.Module:
    """The model of any causal-LM config (Llama, Gemma-3, a Qwen3-MoE, ...), built directly on
    ``device`` in ``dtype`` (no float32 copy, no host round trip)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, warmup: int = 1, reps: int = 5) -> float:
    """Median wall milliseconds of ``fn`` (device-synchronized around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _reset_peak(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes(device) -> int:
    return torch.cuda.max_memory_allocated() if torch.device(device).type == "cuda" else 0


def _allocated(device) -> int:
    return torch.cuda.memory_allocated() if torch.device(device).type == "cuda" else 0


@torch.no_grad()
def bench_prefill(model, vocab: int, device, shapes=PREFILL_SHAPES, reps: int = 5) -> list[dict]:
    rows = []
    for batch, seq in shapes:
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        ms = time_ms(lambda: model(ids, use_cache=False, logits_to_keep=1), device, reps=reps)
        rows.append({"workload": f"prefill_{batch}x{seq}", "ms": ms, "tokens_per_s": batch * seq / ms * 1e3})
    return rows


@torch.no_grad()
def bench_prefill_graph(model, vocab: int, shapes=PREFILL_SHAPES, reps: int = 10) -> dict[str, dict]:
    """Prefill through ``quantkit.graphed``: captured on the first call of a shape, then replayed.

    Timed per call from the host, like the eager rows: copying the ids into the graph's input
    buffer, the replay and the clone of the output all count; the capture (first call) is
    reported separately as ``graph_capture_ms``. ``graphed_logits_equal``: the replayed logits
    against an eager forward on the same ids, bit for bit. ``graph_peak_bytes``: peak allocated
    memory over the capture and the replays (the graph's memory pool included).
    """
    results = {}
    # Inputs drawn on the host: a capture that failed half-way (torchao-int8 on the H100, session 5)
    # can leave the CUDA generator in its capture state, and a device draw then raises
    # ("Offset increment outside graph capture") instead of the variant's numbers being kept.
    inputs = {shape: torch.randint(0, vocab, shape).to("cuda") for shape in shapes}
    for batch, seq in shapes:
        ids = inputs[(batch, seq)]
        eager = model(ids, use_cache=False, logits_to_keep=1).logits
        _reset_peak_only("cuda")
        forward = GraphedForward(model, max_graphs=1)
        try:
            start = time.perf_counter()
            first = forward(ids, logits_to_keep=1).logits
            torch.cuda.synchronize()
            capture_ms = (time.perf_counter() - start) * 1e3
        except ValueError as exc:  # a model whose forward syncs with the host cannot be captured
            results[f"prefill_{batch}x{seq}"] = {"graph_error": str(exc)[:300]}
            continue
        ms = time_ms(lambda: forward(ids, logits_to_keep=1), "cuda", warmup=2, reps=reps)
        results[f"prefill_{batch}x{seq}"] = {
            "graph_ms": ms, "graph_tokens_per_s": batch * seq / ms * 1e3, "graph_capture_ms": capture_ms,
            "graphed_logits_equal": bool(torch.equal(first, eager)), "graph_peak_bytes": _peak_bytes("cuda")}
        del forward, first, eager
    return results


@torch.no_grad()
def bench_decode_hf(model, vocab: int, device, batches=DECODE_BATCHES, prompt_len=PROMPT_LEN,
                    new_tokens=NEW_TOKENS, warmup_only: bool = False) -> list[dict]:
    rows = []
    for batch in batches:
        ids = torch.randint(0, vocab, (batch, prompt_len), device=device)
        mask = torch.ones_like(ids)

        def run(n):
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0)

        if warmup_only:
            run(2)
            continue
        one = time_ms(lambda: run(1), device, warmup=1, reps=DECODE_RUNS)
        full = time_ms(lambda: run(new_tokens), device, warmup=0, reps=DECODE_RUNS)
        rows.append({"workload": f"decode_b{batch}", "ms_per_token": (full - one) / (new_tokens - 1),
                     "prefill_ms": one, "runs": DECODE_RUNS})
    return rows


@torch.no_grad()
def bench_decode_quantkit(model, vocab: int, device, batches=DECODE_BATCHES, prompt_len=PROMPT_LEN,
                          new_tokens=NEW_TOKENS, warmup_only: bool = False, runs: int = DECODE_RUNS) -> list[dict]:
    rows = []
    for batch in batches:
        ids = torch.randint(0, vocab, (batch, prompt_len), device=device)
        if warmup_only:
            generate(model, ids, new_tokens, eos_token_id=None)
            continue
        samples = []
        for _ in range(runs):  # the median run, as for HF's generate
            stats: dict = {}
            generate(model, ids, new_tokens, eos_token_id=None, stats=stats)
            samples.append({"workload": f"decode_b{batch}",
                            "ms_per_token": stats["decode_s"] / max(stats["decode_steps"], 1) * 1e3,
                            "prefill_ms": stats["prefill_s"] * 1e3, "capture_ms": stats["capture_s"] * 1e3,
                            "runs": runs})
        rows.append(sorted(samples, key=lambda r: r["ms_per_token"])[len(samples) // 2])
    return rows


def _measure(variant: str, model, vocab: int, device, decode_fn, prefill_shapes, decode_batches,
             prompt_len, new_tokens, model_bytes: int | None = None) -> list[dict]:
    # Warm-up first (compiles, autotunes: the autotuner's timing buffers must not count as the
    # model's memory), then the peak is reset and the timed runs measure steady-state inference.
    bench_prefill(model, vocab, device, prefill_shapes, reps=1)
    decode_fn(model, vocab, device, decode_batches, prompt_len, new_tokens, warmup_only=True)
    _reset_peak(device)
    after_warmup = _allocated(device)
    # Frozen heap for the timed runs, every variant alike (module docstring).
    gc.collect()
    gc.freeze()
    try:
        return _measure_timed(variant, model, vocab, device, decode_fn, prefill_shapes, decode_batches, prompt_len,
                              new_tokens, model_bytes, after_warmup)
    finally:
        gc.unfreeze()


def _measure_timed(variant: str, model, vocab: int, device, decode_fn, prefill_shapes, decode_batches, prompt_len,
                   new_tokens, model_bytes: int | None, after_warmup: int) -> list[dict]:
    frozen = gc.get_freeze_count()
    rows = []
    for shape in prefill_shapes:
        _reset_peak_only(device)
        rows += bench_prefill(model, vocab, device, (shape,))
        rows[-1]["workload_peak_bytes"] = _peak_bytes(device)
    for batch in decode_batches:
        _reset_peak_only(device)
        rows += decode_fn(model, vocab, device, (batch,), prompt_len, new_tokens)
        rows[-1]["workload_peak_bytes"] = _peak_bytes(device)
    peak = max(row["workload_peak_bytes"] for row in rows)
    graphs = bench_prefill_graph(model, vocab, prefill_shapes) if torch.device(device).type == "cuda" else {}
    for row in rows:
        row.update(variant=variant, peak_bytes=peak, weight_bytes=after_warmup, gc_frozen_objects=frozen,
                   **graphs.get(row["workload"], {}))
        if model_bytes is not None:
            row["model_bytes"] = model_bytes
        print(f"{variant:>16s} {row['workload']:>14s}: "
              + (f"{row['tokens_per_s']:9.0f} tok/s" if "tokens_per_s" in row else f"{row['ms_per_token']:7.2f} ms/token")
              + (f" (graph {row['graph_tokens_per_s']:9.0f} tok/s)" if "graph_tokens_per_s" in row else "")
              + f"  peak {row['workload_peak_bytes'] / 2**30:6.2f} GiB", flush=True)
    _reset_peak(device)
    return rows


def _reset_peak_only(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def variant_names(schemes=SCHEMES, fast_inexact: bool = True, compare_norm_quant: bool = False) -> list[str]:
    """hf-bf16 first, then per scheme plain, fast-exact and (optionally) fast, and with
    ``compare_norm_quant`` fast-no-norm-quant right after fast; torchao's last, if installed."""
    modes = list(MODES if fast_inexact else MODES[:2])
    if compare_norm_quant and fast_inexact:
        modes.append("fast-no-norm-quant")
    names = ["hf-bf16"] + [f"{scheme}-{mode}" for scheme in schemes for mode in modes]
    if importlib.util.find_spec("torchao") is not None:
        names += [f"torchao-{scheme}" for scheme in schemes]
    return names


def torchao_quantize(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """torchao's W8A8 counterpart of ``scheme``: dynamic per-token activations, per-channel weights."""
    if scheme not in SCHEMES:
        raise ValueError(f"variant torchao-{scheme}: the scheme must be one of {SCHEMES}")
    try:
        from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig,
                                          Int8DynamicActivationInt8WeightConfig, PerRow, quantize_)
    except ImportError as exc:
        raise ValueError(f"variant torchao-{scheme} needs torchao: pip install torchao ({exc})") from None
    if scheme == "fp8":
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    else:
        quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return model


def prepare_variant(variant: str, config, device) -> torch.nn.Module:
    """The model of one variant, built on ``device``: bf16 HF, or quantized (+ optimized)."""
    model = build_model(config, device)
    if variant == "hf-bf16":
        return model
    scheme, _, mode = variant.partition("-")
    if scheme == "torchao":
        return torchao_quantize(model, mode)
    if scheme not in SCHEMES or mode not in MODES + EXTRA_MODES:
        raise ValueError(f"variant {variant!r} is not hf-bf16, torchao-<{'|'.join(SCHEMES)}> or "
                         f"<{'|'.join(SCHEMES)}>-<{'|'.join(MODES + EXTRA_MODES)}>")
    quantize(model, QuantConfig.preset(scheme), progress=False)
    if mode == "fast-no-norm-quant":
        optimize(model, exact=False, norm_quant=False)
    elif mode == "fast-no-residual":
        optimize(model, exact=False, residual_add=False)
    elif mode != "plain":
        optimize(model, exact=mode == "fast-exact")
    return model


def measure_variant(variant: str, config, device, prefill_shapes=PREFILL_SHAPES, decode_batches=DECODE_BATCHES,
                    prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS) -> list[dict]:
    """Build one variant and measure it; ``model_bytes`` is its memory before any forward."""
    _reset_peak(device)
    model = prepare_variant(variant, config, device)
    _reset_peak(device)
    model_bytes = _allocated(device)
    hf_way = variant == "hf-bf16" or variant.startswith("torchao-")
    decode_fn = bench_decode_hf if hf_way else bench_decode_quantkit
    rows = _measure(variant, model, config.vocab_size, device, decode_fn, prefill_shapes, decode_batches,
                    prompt_len, new_tokens, model_bytes=model_bytes)
    del model
    _reset_peak(device)
    return rows


def _variant_process_main(args_json: str, out_path: str) -> None:
    """Entry point of the per-variant child process (see ``measure_variant_isolated``)."""
    args = json.loads(args_json)
    config = (LlamaConfig if args["config_class"] == "LlamaConfig" else Gemma3TextConfig).from_dict(args["config"])
    rows = measure_variant(args["variant"], config, args["device"], [tuple(s) for s in args["prefill_shapes"]],
                           tuple(args["decode_batches"]), args["prompt_len"], args["new_tokens"])
    Path(out_path).write_text(json.dumps(rows, default=str))


def measure_variant_isolated(variant: str, config, device, prefill_shapes=PREFILL_SHAPES,
                             decode_batches=DECODE_BATCHES, prompt_len: int = PROMPT_LEN,
                             new_tokens: int = NEW_TOKENS, timeout_s: float | None = None) -> list[dict]:
    """``measure_variant`` in a fresh Python process: its memory numbers are its own.

    A failure (an OOM, a timeout) gives one row with ``error`` instead of stopping the run.
    """
    args = dict(variant=variant, config=config.to_dict(), config_class=type(config).__name__, device=str(device),
                prefill_shapes=[list(s) for s in prefill_shapes], decode_batches=list(decode_batches),
                prompt_len=prompt_len, new_tokens=new_tokens)
    repo_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)}
    code = "import sys; from quantkit.bench.e2e import _variant_process_main; _variant_process_main(*sys.argv[1:])"
    with tempfile.TemporaryDirectory() as tmp:
        out_path = Path(tmp) / "rows.json"
        try:
            done = subprocess.run([sys.executable, "-c", code, json.dumps(args), str(out_path)], env=env,
                                  timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return [{"variant": variant, "workload": "all", "error": f"timed out after {timeout_s} s"}]
        if done.returncode != 0 or not out_path.exists():
            return [{"variant": variant, "workload": "all", "error": f"child process exited with {done.returncode}"}]
        return json.loads(out_path.read_text())


def _add_ratios(rows: list[dict]) -> None:
    base = {r["workload"]: r for r in rows if r["variant"] == "hf-bf16" and "error" not in r}
    for row in rows:
        ref = base.get(row["workload"])
        if ref is None or "error" in row:
            continue
        if "tokens_per_s" in row:
            row["speedup_vs_bf16"] = row["tokens_per_s"] / ref["tokens_per_s"]
            if "graph_tokens_per_s" in row and "graph_tokens_per_s" in ref:
                row["graph_speedup_vs_bf16_graph"] = row["graph_tokens_per_s"] / ref["graph_tokens_per_s"]
                row["graph_speedup_vs_bf16_eager"] = row["graph_tokens_per_s"] / ref["tokens_per_s"]
        else:
            row["speedup_vs_bf16"] = ref["ms_per_token"] / row["ms_per_token"]
        if ref["peak_bytes"]:
            row["memory_ratio_vs_bf16"] = row["peak_bytes"] / ref["peak_bytes"]
        if ref.get("model_bytes"):
            row["model_bytes_ratio_vs_bf16"] = row["model_bytes"] / ref["model_bytes"]
    # The norm + quantization fusion and the residual-add fusion: each fast row against its twin
    # without that fusion (fast-no-norm-quant, fast-no-residual), when the run has one.
    by_key = {(r["variant"], r["workload"]): r for r in rows if "error" not in r}
    for suffix, label in (("-no-norm-quant", "norm_quant"), ("-no-residual", "residual")):
        for row in rows:
            off = by_key.get((row["variant"] + suffix, row["workload"]))
            if off is None or "error" in row:
                continue
            if "tokens_per_s" in row:
                row[f"{label}_speedup"] = row["tokens_per_s"] / off["tokens_per_s"]
                if "graph_tokens_per_s" in row and "graph_tokens_per_s" in off:
                    row[f"{label}_graph_speedup"] = row["graph_tokens_per_s"] / off["graph_tokens_per_s"]
            else:
                row[f"{label}_speedup"] = off["ms_per_token"] / row["ms_per_token"]
            if off.get("workload_peak_bytes"):
                row[f"{label}_peak_ratio"] = row["workload_peak_bytes"] / off["workload_peak_bytes"]


def summarize_targets(rows: list[dict]) -> list[dict]:
    """One line per issue-4 target and fast-path variant: value, target, met/missed."""
    out = []
    for scheme in SCHEMES:
        for variant in (f"{scheme}-fast-exact", f"{scheme}-fast"):
            mine = [r for r in rows if r["variant"] == variant]
            for row in mine:
                if row["workload"].startswith("prefill") and "speedup_vs_bf16" in row:
                    target = TARGETS[f"prefill_{scheme}"]
                    out.append({"target": f"{row['workload']} {variant} >= {target}x hf-bf16 (both eager)",
                                "value": row["speedup_vs_bf16"], "met": row["speedup_vs_bf16"] >= target})
                    for key, how in (("graph_speedup_vs_bf16_eager", "quantkit.graphed forward vs hf eager"),
                                     ("graph_speedup_vs_bf16_graph", "both through quantkit.graphed")):
                        if key in row:
                            out.append({"target": f"{row['workload']} {variant} >= {target}x hf-bf16 ({how})",
                                        "value": row[key], "met": row[key] >= target})
                if row["workload"] == "decode_b1":
                    target = TARGETS["decode_b1_ms"]
                    out.append({"target": f"decode_b1 {variant} <= {target} ms/token",
                                "value": row["ms_per_token"], "met": row["ms_per_token"] <= target})
    for scheme in SCHEMES:
        for variant in (f"{scheme}-plain", f"{scheme}-fast-exact", f"{scheme}-fast"):
            mine = [r for r in rows if r["variant"] == variant]
            if mine and "memory_ratio_vs_bf16" in mine[0]:
                target = TARGETS["memory_ratio"]
                out.append({"target": f"peak memory {variant} <= {target}x hf-bf16",
                            "value": mine[0]["memory_ratio_vs_bf16"], "met": mine[0]["memory_ratio_vs_bf16"] <= target})
    return out


# ------------------------------------------------------------------------------ correctness on device


def _small_configs() -> dict:
    common = dict(vocab_size=32000, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=1024)
    return {
        "llama": LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=128, **common),
        "gemma3": Gemma3TextConfig(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=32,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                   query_pre_attn_scalar=256, **common),
    }


def check_model(config, device: str, dtype, prompt_len: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """A small random model of ``config`` for the fast-path checks (seeded; its 1-d parameters moved
    off their init values so norms and biases take part) and a seeded (2, prompt_len) prompt."""
    torch.manual_seed(0)
    base = build_model(config, device, dtype)
    with torch.no_grad():
        for param in base.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    ids = torch.randint(3, config.vocab_size, (2, prompt_len), generator=torch.Generator().manual_seed(1)).to(device)
    return base, ids


@torch.no_grad()
def run_fast_path_checks(device: str = "cuda", dtype=torch.bfloat16, schemes=SCHEMES, prompt_len: int = 40,
                         new_tokens: int = 24, configs: dict | None = None, inexact: bool = True,
                         norm_quant: bool = False) -> list[dict]:
    """Fast path vs plain QuantLinear path on small random models: logits and greedy tokens.

    exact mode must give equal logits and equal tokens; exact=False is reported, not required.
    Also checks CUDA-graph decode against eager decode, and quantkit.generate against HF's
    model.generate on the plain quantized model (same tokens expected where attention rounding
    does not flip an argmax; reported).
    ``norm_quant``: also compare exact=False with and without the norm + quantization fusion
    (logit differences next to the quantization error itself, greedy tokens, and CUDA-graph
    decode against eager decode with the fusion on, which must be equal).
    """
    rows = []
    for arch, config in (configs or _small_configs()).items():
        base, ids = check_model(config, device, dtype, prompt_len)
        with torch.no_grad():
            base_logits = base(ids).logits
        for scheme in schemes:
            plain = quantize(copy.deepcopy(base), QuantConfig.preset(scheme), progress=False)
            hf_tokens = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
            plain.set_attn_implementation(register_quantkit_attention(device=device))
            plain_logits = plain(ids).logits
            plain_tokens = generate(plain, ids, new_tokens, eos_token_id=None)
            row = {"arch": arch, "scheme": scheme, "device": str(device), "dtype": str(dtype),
                   "generate_equals_hf_generate": bool(torch.equal(plain_tokens, hf_tokens)),
                   # The scale the fast path's own rounding is read against.
                   "quantization_rel_err": rel_err(plain_logits, base_logits)}
            for exact in (True, False) if inexact else (True,):
                fast = optimize(copy.deepcopy(plain), exact=exact)
                fast_logits = fast(ids).logits
                fast_tokens = generate(fast, ids, new_tokens, eos_token_id=None)
                tag = "exact" if exact else "fast"
                row[f"{tag}_logits_equal"] = bool(torch.equal(fast_logits, plain_logits))
                row[f"{tag}_logits_max_abs_diff"] = (fast_logits.float() - plain_logits.float()).abs().max().item()
                row[f"{tag}_logits_rel_diff"] = rel_err(fast_logits, plain_logits)
                row[f"{tag}_quantization_rel_err"] = rel_err(fast_logits, base_logits)
                row[f"{tag}_tokens_equal"] = bool(torch.equal(fast_tokens, plain_tokens))
                row[f"{tag}_report"] = str(fast.quantkit_fast_path)
                if torch.device(device).type == "cuda":
                    eager_tokens = generate(fast, ids, new_tokens, eos_token_id=None, cuda_graph=False)
                    row[f"{tag}_graph_equals_eager"] = bool(torch.equal(eager_tokens, fast_tokens))
                del fast
            if norm_quant:
                row.update(_norm_quant_check(base, plain, ids, new_tokens, device))
            row["passed"] = _fast_path_passed(row)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del plain
        del base
        _reset_peak(device)
    return rows


FAST_ERROR_MARGIN = 1.1  # exact=False's logits error against the plain path's (CPU bf16: 0.99-1.03)


def _fast_path_passed(row: dict) -> bool:
    """exact=True: logits and tokens equal to the plain path's. exact=False (what the benchmark
    times): its logits as close to the unquantized model's as the plain path's, within 10 %. (It
    rounds differently before quantizing, so its logits differ from the plain path's by about the
    quantization error itself in bf16, and greedy tokens may part at near-ties; a wrong fused
    kernel adds error of its own.) Both: CUDA-graph decode equal to eager decode, and the norm +
    quantization checks where they ran."""
    fast_ok = row.get("fast_quantization_rel_err", 0.0) <= FAST_ERROR_MARGIN * row["quantization_rel_err"]
    return bool(row["exact_logits_equal"] and row["exact_tokens_equal"] and fast_ok
                and row.get("exact_graph_equals_eager", True) and row.get("fast_graph_equals_eager", True)
                and row.get("norm_quant_graph_equals_eager", True)
                and row.get("norm_quant_fused_launches", 1) > 0
                and row.get("residual_logits_equal", True))


def _norm_quant_check(base, plain, ids, new_tokens: int, device) -> dict:
    from quantkit.models.fast_path import FastRMSNorm

    off = optimize(copy.deepcopy(plain), exact=False, norm_quant=False)
    on = optimize(copy.deepcopy(plain), exact=False)
    no_residual = optimize(copy.deepcopy(plain), exact=False, residual_add=False)
    want = base(ids).logits.float()
    off_logits, on_logits = off(ids).logits.float(), on(ids).logits.float()
    # The residual-add fusion must not change a bit (second calls: the first learns the consumers).
    no_residual(ids)
    residual_equal = bool(torch.equal(on(ids).logits.float(), no_residual(ids).logits.float()))
    del no_residual
    off_tokens = generate(off, ids, new_tokens, eos_token_id=None)
    on_tokens = generate(on, ids, new_tokens, eos_token_id=None)
    out = {
        "norm_quant_logits_equal": bool(torch.equal(on_logits, off_logits)),
        "norm_quant_logits_max_abs_diff": (on_logits - off_logits).abs().max().item(),
        "norm_quant_logits_rel_diff": ((on_logits - off_logits).norm() / off_logits.norm()).item(),
        # The scale to read it against: the quantization error of the fast path itself.
        "fast_vs_unquantized_rel_diff": ((off_logits - want).norm() / want.norm()).item(),
        "norm_quant_tokens_equal": bool(torch.equal(on_tokens, off_tokens)),
        "norm_quant_report": str(on.quantkit_fast_path),
        "norm_quant_fused_launches": sum(m.fused_calls for m in on.modules() if isinstance(m, FastRMSNorm)),
        "residual_logits_equal": residual_equal,
    }
    if torch.device(device).type == "cuda":
        eager = generate(on, ids, new_tokens, eos_token_id=None, cuda_graph=False)
        out["norm_quant_graph_equals_eager"] = bool(torch.equal(eager, on_tokens))
    return out


# ------------------------------------------------------------------------------ the benchmark


def run_e2e_benchmark(
    out_dir: str | os.PathLike = "benchmarks/results",
    plot: bool = True,
    device: str = "cuda",
    config: LlamaConfig | None = None,
    schemes=SCHEMES,
    prefill_shapes=PREFILL_SHAPES,
    decode_batches=DECODE_BATCHES,
    prompt_len: int = PROMPT_LEN,
    new_tokens: int = NEW_TOKENS,
    fast_inexact: bool = True,
    checks: bool = True,
    prefix: str = "e2e",
    deadline_s: float | None = None,
    isolate: bool = True,
    variants: list[str] | None = None,
    compare_norm_quant: bool = False,
) -> list[dict]:
    """Run the end-to-end benchmark (and, with ``checks``, the fast-path correctness checks first).

    Writes ``{prefix}.json`` (meta + rows + targets + checks), ``{prefix}.csv`` and
    ``{prefix}.png`` under ``out_dir``; returns the rows. ``config``/``device`` override the
    Llama-3-8B shape and the GPU (small configs on CPU exercise the code path in tests).
    ``isolate``: each variant in its own process (memory numbers are then the variant's own).
    ``deadline_s``: past this many seconds, the variants not yet started are skipped (and named).
    ``variants``: which variants, in this order (default ``variant_names(schemes, fast_inexact,
    compare_norm_quant)``). ``compare_norm_quant``: also the fast path with the norm +
    quantization fusion off (and, with ``checks``, its correctness checks).
    Results are rewritten after every variant, so a run cut short keeps what it measured.
    """
    from quantkit.bench.common import environment_metadata

    import transformers

    if plot:
        require_matplotlib()

    meta = {**environment_metadata(), "transformers": transformers.__version__}
    config = config or llama3_8b_config()
    meta["model"] = (f"Llama shape: hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
                     f"{config.num_hidden_layers} layers, {config.num_attention_heads}/{config.num_key_value_heads} "
                     f"heads, vocab {config.vocab_size}, random weights, bf16")
    meta["decode_note"] = (f"median of {DECODE_RUNS} runs on both sides; HF model.generate runs eager (DynamicCache), "
                           "quantkit.generate captures its decode step in a CUDA graph: the decode ratio is of the two "
                           "generate paths, not of kernels")
    meta["memory_note"] = ("each variant in its own process" if isolate else "all variants in one process") + (
        "; model_bytes = allocated after build/quantize/optimize, before any forward; peak_bytes = "
        "max_memory_allocated over the eager inference workloads after a warm-up pass")
    meta["gc_note"] = ("gc.collect(); gc.freeze() after each variant's warm-up, before its timed runs, every variant "
                       "alike (gc_frozen_objects per row); gc.unfreeze() after the variant")
    started = time.perf_counter()
    out_dir = Path(out_dir)
    check_rows = run_fast_path_checks(device, inexact=fast_inexact, norm_quant=compare_norm_quant) if checks else []
    failed = [f"{r['arch']} {r['scheme']}" for r in check_rows if not r["passed"]]
    if failed:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{prefix}_checks_failed.json").write_text(json.dumps(check_rows, indent=1, default=str))
        raise CheckFailed(f"fast-path checks failed for {', '.join(failed)} ({prefix}_checks_failed.json); "
                          "nothing is timed")
    shape = dict(prefill_shapes=prefill_shapes, decode_batches=decode_batches, prompt_len=prompt_len,
                 new_tokens=new_tokens)
    rows: list[dict] = []
    skipped: list[str] = []

    def save(final: bool = False) -> list[dict]:
        _add_ratios(rows)
        targets = summarize_targets(rows)
        _write(rows, targets, check_rows, {**meta, "skipped_variants": skipped}, out_dir, prefix, plot and final)
        return targets

    for variant in variants or variant_names(schemes, fast_inexact, compare_norm_quant):
        if deadline_s is not None and time.perf_counter() - started > deadline_s:
            skipped.append(variant)
            continue
        measure = measure_variant_isolated if isolate else measure_variant
        rows += measure(variant, config, device, **shape)
        save()
    targets = save(final=True)
    for t in targets:
        print(f"{'MET   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.3f}", flush=True)
    for label, name in (("norm_quant", "norm+quant fusion"), ("residual", "residual-add fusion")):
        for row in rows:
            if f"{label}_speedup" in row:
                graph = row.get(f"{label}_graph_speedup")
                print(f"{name} {row['variant']:>10s} {row['workload']:>14s}: x{row[f'{label}_speedup']:.3f} "
                      + (f"(graph x{graph:.3f}) " if graph else "")
                      + f"peak x{row.get(f'{label}_peak_ratio', float('nan')):.3f} vs fusion off", flush=True)
    if skipped:
        print(f"skipped (deadline): {', '.join(skipped)}", flush=True)
    return rows


def _write(rows, targets, check_rows, meta, out_dir: Path, prefix: str, plot: bool) -> None:
    write_rows(out_dir, prefix, rows, meta, extra={"targets": targets, "checks": check_rows}, lead=("variant", "workload"))
    if not plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    prefill = [w for w in workloads if w.startswith("prefill")]
    decode = [w for w in workloads if w.startswith("decode")]
    width = 0.8 / max(len(variants), 1)
    for ax, group, key, label in ((axes[0], prefill, "tokens_per_s", "prefill tokens/s"),
                                  (axes[1], decode, "ms_per_token", "decode ms/token (lower is better)")):
        for i, variant in enumerate(variants):
            values = [next((r[key] for r in rows if r["variant"] == variant and r["workload"] == w), 0) for w in group]
            ax.bar([j + i * width for j in range(len(group))], values, width, label=variant, color=f"C{i}")
            if key == "tokens_per_s":
                # Graph-replayed prefill (GPU time) as an outline over the eager bar.
                graph = [next((r.get("graph_tokens_per_s", 0) for r in rows
                               if r["variant"] == variant and r["workload"] == w), 0) for w in group]
                ax.bar([j + i * width for j in range(len(group))], graph, width, fill=False,
                       edgecolor=f"C{i}", ls="--", lw=1.2)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(group))], group)
        ax.set_ylabel(label)
    axes[0].set_title("prefill: filled = eager, dashed outline = quantkit.graphed (CUDA-graph replay)", fontsize=9)
    axes[1].axhline(TARGETS["decode_b1_ms"], color="k", ls=":", lw=1)
    peaks = [next((r.get("peak_bytes", 0) for r in rows if r["variant"] == v), 0) / 2**30 for v in variants]
    weights = [next((r.get("model_bytes", 0) for r in rows if r["variant"] == v), 0) / 2**30 for v in variants]
    axes[2].bar(range(len(variants)), peaks, color=[f"C{i}" for i in range(len(variants))])
    axes[2].bar(range(len(variants)), weights, fill=False, edgecolor="k", hatch="//", lw=0.8)
    axes[2].set_xticks(range(len(variants)), variants, rotation=30, ha="right")
    axes[2].set_ylabel("GiB: peak (bar), model alone (hatched)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{meta['model'][:60]}...  {meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  "
                 f"transformers {meta['transformers']}  {meta['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / f"{prefix}.png", dpi=110)
    plt.close(fig)
