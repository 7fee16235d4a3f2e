"""Perplexity of every W8A8 preset with and without each calibration algorithm (issue 5).

Runs on the bundled Gemma-3-270M and the bundled Wikipedia excerpt (held-out evaluation
articles), CPU reference path in float32, the same tokens and windows for the 16-bit baseline
and every recipe. The recipe is wired here exactly as ``quantkit.quantize`` is meant to wire it:

    smooth_model (SmoothQuant, in place, exact)  ->  rank_layers / most_sensitive (optional)
    ->  static input ranges (observer)  ->  GPTQ or weight clip search  ->  convert_model

Every recipe uses the same architecture-independent defaults (no per-model constants).
One JSON line per recipe is appended to ``benchmarks/results/calibration_sweep.jsonl`` as soon as
it finishes, so an interrupted sweep keeps its results; ``--summary`` prints the table.

    python benchmarks/calibration_sweep.py --eval-tokens 4096 --calib-blocks 8
    python benchmarks/calibration_sweep.py --summary
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import quantkit
from quantkit.calibration.gptq import gptq_quantize_weights
from quantkit.calibration.observers import make_observer
from quantkit.calibration.sensitivity import most_sensitive, rank_layers
from quantkit.calibration.calibrate import forward_backbone
from quantkit.calibration.smoothquant import smooth_model
from quantkit.calibration.weights import search_weight_clip
from quantkit.config import QuantConfig
from quantkit.convert import convert_model, target_linears
from quantkit.kernels.reference import quantize_per_tensor, quantize_per_token
from quantkit.nn import QuantLinear

RESULTS = Path(__file__).parent / "results"

# name -> (preset, overrides). The calibration defaults under test: SmoothQuant alpha 0.5 (the
# SmoothQuant paper's default), MSE clipping for weights and static activations, GPTQ for INT8.
FP8_GPTQ = "gptq_on_fp8"
# Per-group SmoothQuant strength search (smooth_model's alpha_grid): the same grid for every model.
SQ_SEARCH = "smoothquant_search"
# GPTQ with the first position (BOS, the attention sink) counted this many times in the Hessian.
GPTQ_FIRST = "gptq_first_token_weight"
ALPHA_GRID = (0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
RECIPES: dict[str, tuple[str, dict]] = {
    "int8": ("int8", {}),
    "int8+sq": ("int8", {"smoothquant_alpha": 0.5}),
    "int8+gptq": ("int8", {"gptq": True}),
    "int8+sq+gptq": ("int8", {"smoothquant_alpha": 0.5, "gptq": True}),
    "int8+wmse": ("int8", {"weight_observer": "mse"}),
    "fp8": ("fp8", {}),
    "fp8+sq": ("fp8", {"smoothquant_alpha": 0.5}),
    "fp8+wmse": ("fp8", {"weight_observer": "mse"}),
    "int8-static": ("int8-static", {}),
    "int8-static+sq": ("int8-static", {"smoothquant_alpha": 0.5}),
    "int8-static+sq+amse": ("int8-static", {"smoothquant_alpha": 0.5, "activation_observer": "mse"}),
    "fp8-static": ("fp8-static", {}),
    "fp8-static+sq": ("fp8-static", {"smoothquant_alpha": 0.5}),
    "int8+sq+gptq+wmse": ("int8", {"smoothquant_alpha": 0.5, "gptq": True, "weight_observer": "mse"}),
    "int8-static+sq+amse+gptq": ("int8-static", {"smoothquant_alpha": 0.5, "activation_observer": "mse", "gptq": True}),
    "fp8-static+sq+amse": ("fp8-static", {"smoothquant_alpha": 0.5, "activation_observer": "mse"}),
    "int8+sq+gptq+keep4": ("int8", {"smoothquant_alpha": 0.5, "gptq": True, "keep_sensitive": 4}),
    # GPTQ on the FP8 grid: QuantConfig allows gptq for int8 only, so the sweep asks for it itself.
    "fp8+gptq": ("fp8", {FP8_GPTQ: True}),
    "fp8+sq+gptq": ("fp8", {"smoothquant_alpha": 0.5, FP8_GPTQ: True}),
    "fp8-static+sq+gptq": ("fp8-static", {"smoothquant_alpha": 0.5, FP8_GPTQ: True}),
    "int8+sqsearch": ("int8", {"smoothquant_alpha": 0.5, SQ_SEARCH: True}),
    "fp8+sqsearch": ("fp8", {"smoothquant_alpha": 0.5, SQ_SEARCH: True}),
    "int8-static+sqsearch": ("int8-static", {"smoothquant_alpha": 0.5, SQ_SEARCH: True}),
    "int8-static+sqsearch+amse": ("int8-static", {"smoothquant_alpha": 0.5, SQ_SEARCH: True, "activation_observer": "mse"}),
    "fp8-static+sqsearch": ("fp8-static", {"smoothquant_alpha": 0.5, SQ_SEARCH: True}),
    "int8+sqsearch+gptq": ("int8", {"smoothquant_alpha": 0.5, SQ_SEARCH: True, "gptq": True}),
    "int8+sqsearch+keep4": ("int8", {"smoothquant_alpha": 0.5, SQ_SEARCH: True, "keep_sensitive": 4}),
    "int8+sqsearch+gptq+keep4": ("int8", {"smoothquant_alpha": 0.5, SQ_SEARCH: True, "gptq": True, "keep_sensitive": 4}),
    "fp8+sq+gptq+keep4": ("fp8", {"smoothquant_alpha": 0.5, FP8_GPTQ: True, "keep_sensitive": 4}),
    "int8+sq+keep4": ("int8", {"smoothquant_alpha": 0.5, "keep_sensitive": 4}),
    "fp8+keep4": ("fp8", {"keep_sensitive": 4}),
    "fp8+sq+keep4": ("fp8", {"smoothquant_alpha": 0.5, "keep_sensitive": 4}),
    "fp8+sq+keep8": ("fp8", {"smoothquant_alpha": 0.5, "keep_sensitive": 8}),
    "int8+sq+keep8": ("int8", {"smoothquant_alpha": 0.5, "keep_sensitive": 8}),
    "int8+sq+wmse": ("int8", {"smoothquant_alpha": 0.5, "weight_observer": "mse"}),
    "fp8+sq+wmse": ("fp8", {"smoothquant_alpha": 0.5, "weight_observer": "mse"}),
    "int8+sq+gptq-bos64": ("int8", {"smoothquant_alpha": 0.5, "gptq": True, GPTQ_FIRST: 64.0}),
    "int8+sq+gptq-bos512": ("int8", {"smoothquant_alpha": 0.5, "gptq": True, GPTQ_FIRST: 512.0}),
    "fp8+sq+gptq-bos64": ("fp8", {"smoothquant_alpha": 0.5, FP8_GPTQ: True, GPTQ_FIRST: 64.0}),
    "fp8+sq+gptq-bos512": ("fp8", {"smoothquant_alpha": 0.5, FP8_GPTQ: True, GPTQ_FIRST: 512.0}),
    "int8+sq+gptq-bos64+keep4": ("int8", {"smoothquant_alpha": 0.5, "gptq": True, GPTQ_FIRST: 64.0, "keep_sensitive": 4}),
    "fp8+sq+gptq-bos64+keep4": ("fp8", {"smoothquant_alpha": 0.5, FP8_GPTQ: True, GPTQ_FIRST: 64.0, "keep_sensitive": 4}),
}


@torch.no_grad()
def input_ranges(model: nn.Module, layers: dict[str, nn.Linear], blocks: torch.Tensor, config: QuantConfig,
                 batch_size: int) -> dict[str, torch.Tensor]:
    """Static per-tensor clipping of each layer's input; the MSE observer scores the real dtype's grid."""
    observers = {n: make_observer(config.activation_observer, config.percentile, config.torch_dtype) for n in layers}
    handles = [m.register_forward_pre_hook(lambda _m, args, n=n: observers[n].update(args[0])) for n, m in layers.items()]
    try:
        forward_backbone(model, blocks, batch_size, desc="input ranges")
    finally:
        for h in handles:
            h.remove()
    return {n: o.amax() for n, o in observers.items()}


def quantize_with_recipe(model: nn.Module, config: QuantConfig, blocks: torch.Tensor, batch_size: int,
                         gptq: bool | None = None, alpha_search: bool = False, first_token_weight: float = 1.0) -> dict:
    """The calibration recipe of ``config`` applied in place; returns what it did.

    gptq: overrides ``config.gptq`` (to try GPTQ on FP8 weights, which QuantConfig refuses).
    alpha_search: search SmoothQuant's strength per group over ``ALPHA_GRID`` (or none).
    first_token_weight: GPTQ Hessian weight of position 0 (see ``HessianAccumulator.update``).
    """
    gptq = config.gptq if gptq is None else gptq
    info: dict = {}
    if config.smoothquant_alpha is not None:
        sq = smooth_model(model, blocks, alpha=config.smoothquant_alpha, batch_size=batch_size,
                          exclude=config.ignore, alpha_grid=ALPHA_GRID if alpha_search else None,
                          quant_dtype=config.torch_dtype, static_activations=config.is_static)
        info["smoothquant_groups"] = len(sq["groups"])
        info["smoothquant_smoothed"] = sq["n_smoothed"]
        if alpha_search:
            chosen = [g["alpha"] for g in sq["groups"]]
            info["smoothquant_alphas"] = {str(a): chosen.count(a) for a in sorted(set(chosen), key=str)}
        info["smoothquant_skipped"] = len(sq["skipped"])
        info["smoothquant_probe_change"] = sq["probe_relative_change"]
    extra_ignore: tuple[str, ...] = ()
    if config.keep_sensitive:
        # A full forward per layer is the cost: 2 blocks of 128 tokens, 64 scored positions each.
        ranking = rank_layers(model, blocks, config, n_blocks=2, batch_size=2, positions_per_block=64,
                              max_seq_len=128)
        extra_ignore = tuple(most_sensitive(ranking, config.keep_sensitive))
        info["kept_in_16_bits"] = list(extra_ignore)
        info["top_scores"] = ranking[:8]
    targets = target_linears(model, config, extra_ignore)
    input_amax = input_ranges(model, targets, blocks, config, batch_size) if config.is_static else None
    quantized_weights = weight_amax = None
    if gptq:
        quantized_weights = gptq_quantize_weights(model, blocks, list(targets), config.torch_dtype,
                                                  weight_observer=config.weight_observer, batch_size=batch_size,
                                                  first_token_weight=first_token_weight)
    elif config.weight_observer == "mse":
        weight_amax = {n: search_weight_clip(m.weight, config.torch_dtype) for n, m in targets.items()}
    convert_model(model, config, "torch", input_amax=input_amax, weight_amax=weight_amax,
                  quantized_weights=quantized_weights, extra_ignore=extra_ignore)
    return info


class FakeQuantLinear(nn.Module):
    """A QuantLinear's exact quantized math in float32 ops: dequantized weight, quantize->dequantize input.

    Same rounding as QuantLinear (reference.py's functions), only the accumulation differs: float32
    sums instead of exact int32 (relative difference ~1e-7). The CPU reference path multiplies in
    float64 and is ~4x slower; ``--exact-eval`` uses it instead (the sweep checks they agree).
    """

    def __init__(self, module: QuantLinear):
        super().__init__()
        self.quant_dtype = module.quant_dtype
        self.weight = nn.Parameter(module.dequantized_weight().float(), requires_grad=False)
        self.bias = module.bias
        self.input_scale = module.input_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.input_scale is not None:
            deq = quantize_per_tensor(flat, self.input_scale, self.quant_dtype).float() * self.input_scale.float()
        else:
            q, scale = quantize_per_token(flat, self.quant_dtype)
            deq = q.float() * scale[:, None]
        out = torch.nn.functional.linear(deq, self.weight, None if self.bias is None else self.bias.float())
        return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def to_fake_quant(model: nn.Module) -> None:
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantLinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, FakeQuantLinear(module))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summary(path: Path) -> str:
    """Markdown table of the latest row per recipe (and eval path) of the JSON-lines results."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_name: dict[str, dict] = {}
    for r in rows:
        key = r["recipe"]
        # Rows without an eval_path predate the fast path: they ran through QuantLinear's reference.
        if r["recipe"] != "baseline" and "QuantLinear" in r.get("eval_path", "QuantLinear reference"):
            key += " [QuantLinear exact path]"
        by_name[key] = r  # the latest run of each recipe wins
    base = by_name.get("baseline")
    dynamic = {"int8": by_name.get("int8"), "fp8": by_name.get("fp8")}
    lines = [
        "| recipe | PPL | vs 16-bit | gap / gap of plain dynamic preset (same weight type) | calib s |",
        "|---|---|---|---|---|",
    ]
    for name, r in by_name.items():
        delta = 100 * (r["perplexity"] / base["perplexity"] - 1) if base else float("nan")
        ratio = ""
        preset = r.get("preset") or ""
        ref = dynamic.get(preset.split("-")[0]) if preset else None
        if base and ref and ref["perplexity"] != base["perplexity"]:
            ratio = f"{(r['perplexity'] - base['perplexity']) / (ref['perplexity'] - base['perplexity']):.2f}"
        lines.append(f"| {name} | {r['perplexity']:.3f} | {delta:+.2f} % | {ratio} | {r.get('calibration_s', 0):.0f} |")
    first = rows[0] if rows else {}
    lines.append("")
    lines.append(f"{first.get('model')} on {first.get('dataset')} (held-out articles), {first.get('eval_tokens')} tokens, "
                 f"window {first.get('window')}, calibration {first.get('calib_blocks')} x {first.get('calib_seq_len')} "
                 f"tokens, {first.get('device', 'cpu')} float32.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=["baseline", *RECIPES])
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--calib-blocks", type=int, default=8)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS / "calibration_sweep.jsonl")
    parser.add_argument("--eval-all", action="store_true", help="score every held-out token (overrides --eval-tokens)")
    parser.add_argument("--summary", action="store_true", help="print the table of --out and exit")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (float32 either way)")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop starting new recipes after this long")
    parser.add_argument("--exact-eval", action="store_true",
                        help="evaluate through QuantLinear's reference path (exact int32 math, ~4x slower)")
    args = parser.parse_args()
    if args.summary:
        print(summary(args.out))
        return
    unknown = [r for r in args.recipes if r != "baseline" and r not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; choose from baseline, {', '.join(RECIPES)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    source, tokenizer = quantkit.load_model(quantkit.BUNDLED_MODEL, device=args.device, dtype=torch.float32)
    blocks = quantkit.prepare_calibration_data(tokenizer, quantkit.BUNDLED_DATASET, args.calib_blocks, args.calib_seq_len)
    tokens = quantkit.prepare_evaluation_tokens(tokenizer, quantkit.BUNDLED_DATASET,
                                                None if args.eval_all else args.eval_tokens)
    common = {
        "model": quantkit.BUNDLED_MODEL, "dataset": quantkit.BUNDLED_DATASET, "eval_tokens": int(tokens.numel()),
        "window": args.window, "calib_blocks": args.calib_blocks, "calib_seq_len": args.calib_seq_len,
        "commit": os.environ.get("QUANTKIT_COMMIT") or _commit(), "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "date": time.strftime("%Y-%m-%d"),
    }
    if args.device.startswith("cuda"):
        # Full float32 matmuls, as on the CPU (no TF32 rounding in the comparison).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    sweep_start = time.perf_counter()
    for name in args.recipes:
        if args.max_minutes is not None and time.perf_counter() - sweep_start > 60 * args.max_minutes:
            print(f"time limit reached before {name}", flush=True)
            break
        model = copy.deepcopy(source)
        started = time.perf_counter()
        info, preset, config_dict = {}, None, None
        if name != "baseline":
            preset, overrides = RECIPES[name]
            overrides = dict(overrides)
            fp8_gptq = overrides.pop(FP8_GPTQ, False)
            alpha_search = overrides.pop(SQ_SEARCH, False)
            first_token_weight = overrides.pop(GPTQ_FIRST, 1.0)
            config = QuantConfig.preset(preset, backend="torch", **overrides)
            config_dict = {k: v for k, v in config.to_quantization_config()["quantkit"].items()}
            if fp8_gptq:
                config_dict["gptq"] = True
            if alpha_search:
                config_dict["smoothquant_alpha"] = {"searched_per_group": list(ALPHA_GRID)}
            if first_token_weight != 1.0:
                config_dict["gptq_first_token_weight"] = first_token_weight
            info = quantize_with_recipe(model, config, blocks, args.batch_size, gptq=config.gptq or fp8_gptq,
                                        alpha_search=alpha_search, first_token_weight=first_token_weight)
            if not args.exact_eval:
                to_fake_quant(model)
            info["eval_path"] = "QuantLinear reference" if args.exact_eval else "fake-quant float32"
        calibration_s = time.perf_counter() - started
        result = quantkit.evaluate_perplexity(model, tokens, window=args.window, bos_token_id=tokenizer.bos_token_id,
                                              desc=name)
        row = {"recipe": name, "preset": preset, "recipe_config": config_dict, "perplexity": result.perplexity,
               "nll": result.nll, "scored_tokens": result.tokens, "calibration_s": calibration_s,
               "eval_s": time.perf_counter() - started - calibration_s, **info, **common}
        with args.out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(f"{name:28s} ppl {result.perplexity:8.3f}  calib {calibration_s:6.1f}s", flush=True)
        del model
    print(summary(args.out))


if __name__ == "__main__":
    sys.exit(main())
