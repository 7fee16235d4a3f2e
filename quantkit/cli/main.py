"""The `quantkit` command line: quantize, eval, demo, bench.

Talks only to the public API (``quantkit`` and ``quantkit.bench``). Every failure a user can cause
becomes one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    help="W8A8 (INT8 / FP8) quantization of Hugging Face causal LMs on Triton kernels.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
bench_app = typer.Typer(help="Kernel and end-to-end benchmarks (need a CUDA GPU).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")

DEFAULT_DATASET = "wikipedia-excerpt"
# Calibration blocks as long as a typical served context: static ranges and SmoothQuant statistics
# measured on 512-token blocks under-cover later positions (benchmarks/results/calibration_sweep.md).
DEFAULT_CALIBRATION_SEQ_LEN = 2048


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=1)


def user_errors(func):
    """Turn the library's input errors into a one-line message and exit code 1."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        import quantkit

        try:
            return func(*args, **kwargs)
        except (ValueError, FileNotFoundError, quantkit.CheckpointError) as exc:
            fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        except OSError as exc:  # permissions, a file where a directory should be, a full disk ...
            if exc.filename and exc.strerror:
                fail(f"{exc.strerror}: {str(exc.filename)!r}; check the path and its permissions")
            fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        except KeyboardInterrupt:
            fail("interrupted")

    return wrapper


def _device(device: Optional[str]) -> str:
    import quantkit

    return str(quantkit.resolve_device(device, option="--device "))


def _check_writable(path: Path, option: str, directory: bool) -> None:
    """Fail before any work if ``path`` (an output directory or file) could not be written."""
    if path.exists() and path.is_dir() != directory:
        fail(f"{option} {str(path)!r} is {'a file' if directory else 'a directory'}; "
             f"give a {'directory' if directory else 'file'} path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        fail(f"{option} {str(path)!r} is under {str(parent)!r}, which is a file; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        fail(f"{option} {str(path)!r}: {str(parent)!r} is not writable; choose another path")


def _write_json(path: Path, payload: dict) -> None:
    """Write a report atomically, with the permissions the umask gives (``quantkit.write_json``)."""
    import quantkit

    quantkit.write_json(path, payload)


def _refuse_inside(path: Path, option: str, directories: dict[str, Optional[str]]) -> None:
    """Fail if the file ``path`` would land inside a model or checkpoint directory (or be one of its
    files): a report must not replace config.json or a shard."""
    for role, directory in directories.items():
        if directory and Path(directory).expanduser().is_dir() and \
                path.expanduser().resolve().is_relative_to(Path(directory).expanduser().resolve()):
            fail(f"{option} {str(path)!r} is inside the {role} directory {directory!r}; write the report elsewhere")


def _print_table(rows: list[dict]) -> None:
    header = f"{'scheme':<14}{'baseline PPL':>14}{'quantized PPL':>15}{'delta':>9}{'tokens':>9}{'layers':>8}"
    typer.echo(header)
    typer.echo("-" * len(header))
    for row in rows:
        typer.echo(
            f"{row['scheme']:<14}{row['baseline_ppl']:>14.3f}{row['quantized_ppl']:>15.3f}"
            f"{row['delta_percent']:>+8.2f}%{row['tokens']:>9}{row.get('layers', ''):>8}"
        )


@app.command()
@user_errors
def quantize(
    model: str = typer.Argument(..., help="HF model directory, hub id, .gguf file, or 'gemma3-270m' (bundled)."),
    output: Path = typer.Option(..., "--output", "-o", help="Directory to write the quantized checkpoint to."),
    scheme: str = typer.Option("fp8", help="int8 | int8-static | fp8 | fp8-static"),
    recipe: str = typer.Option("plain", help="plain | accurate (the measured best calibration recipe of the scheme; "
                                             "the flags below override its parts)."),
    dataset: Optional[str] = typer.Option(None, help="Calibration text: HF dataset name[:config], .txt file/folder, or "
                                                     "'wikipedia-excerpt' (the default)."),
    num_samples: int = typer.Option(16, min=1, help="Calibration blocks (fewer if the text runs out; the count used is printed)."),
    seq_len: Optional[int] = typer.Option(None, min=2, help="Tokens per calibration block (default: 2048, or the model's "
                                                             "context if shorter; calibrate on contexts as long as you will run)."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when available)."),
    backend: str = typer.Option("auto", help="auto | triton | torch"),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    smoothquant: Optional[float] = typer.Option(None, help="SmoothQuant migration strength alpha in [0, 1] (0.5 is the default recipe)."),
    gptq: Optional[bool] = typer.Option(None, "--gptq/--no-gptq", help="Error-compensated (GPTQ) weight rounding "
                                                                      "(default: off, or the recipe's choice)."),
    gptq_sequential: Optional[bool] = typer.Option(
        None, "--gptq-sequential/--no-gptq-sequential", help="With --gptq: each decoder block's statistics from the "
        "blocks before it as quantized (default: off, or the recipe's choice)."),
    weight_observer: Optional[str] = typer.Option(None, help="absmax | percentile | mse (per-channel clipping search; "
                                                             "default: absmax, or the recipe's choice)."),
    activation_observer: Optional[str] = typer.Option(None, help="absmax | percentile | mse (static schemes only; "
                                                                 "default: absmax, or the recipe's choice)."),
    percentile: Optional[float] = typer.Option(None, help="Percentile of |x| or |w| the percentile observers clip at "
                                                          "(default: 99.99)."),
    keep_sensitive: Optional[int] = typer.Option(None, min=0, help="Keep the N most sensitive layers in 16 bits "
                                                                   "(default: 0, or the recipe's choice)."),
    report: Optional[Path] = typer.Option(None, help="Write the JSON calibration report here."),
    offload: bool = typer.Option(False, "--offload", help="Keep the model in host memory and calibrate on --device one decoder block at a time (models larger than the GPU)."),
) -> None:
    """Calibrate, quantize and save MODEL as a compressed-tensors checkpoint."""
    import quantkit

    # Only the flags given override the recipe's choices (a flag set to its default value included).
    flags = {"smoothquant_alpha": smoothquant, "gptq": gptq, "keep_sensitive": keep_sensitive,
             "weight_observer": weight_observer, "activation_observer": activation_observer, "percentile": percentile}
    config = quantkit.QuantConfig.preset(
        scheme, recipe=recipe, backend=backend, **{k: v for k, v in flags.items() if v is not None})
    if gptq_sequential and not config.gptq:
        fail("--gptq-sequential says how GPTQ gathers its statistics; add --gptq (or drop the flag)")
    if gptq_sequential is not None and config.gptq:
        config = config.replace(gptq_sequential=gptq_sequential)
    if activation_observer is not None and not config.is_static:
        fail(f"--activation-observer {activation_observer} sets static activation scales, which --scheme {scheme} "
             "does not have (it scales per token at run time); use int8-static or fp8-static, or drop the flag")
    quantkit.check_output_dir(output, overwrite, source=model)
    _check_writable(output, "--output", directory=True)
    if report:
        _check_writable(report, "--report", directory=False)
        if output.resolve().is_relative_to(report.resolve()):
            fail(f"--report {str(report)!r} is the --output directory or one above it; give the report a file "
                 "path of its own")
        if report.expanduser().resolve().is_relative_to(output.expanduser().resolve()):
            fail(f"--report {str(report)!r} is inside the --output directory; write the report elsewhere")
        _refuse_inside(report, "--report", {"source model": model})
    if dataset is not None and not config.needs_calibration:
        typer.echo(f"note: --dataset is not used: --scheme {scheme} scales activations per token at run time "
                   "and runs no calibration", err=True)
    dataset = dataset or DEFAULT_DATASET
    device = _device(device)
    if config.needs_calibration:
        quantkit.check_dataset(dataset, "calibration")  # before the model loads, not after
    start = time.perf_counter()
    if offload:
        import torch

        # Streaming keeps the weights in host memory, in the dtype the device computes in.
        source, tokenizer = quantkit.load_model(
            model, device="cpu", dtype=torch.bfloat16 if device.startswith("cuda") else None)
    else:
        source, tokenizer = quantkit.load_model(model, device=device)
    blocks = None
    if config.needs_calibration:
        if seq_len is None:
            seq_len = min(DEFAULT_CALIBRATION_SEQ_LEN, getattr(source.config, "max_position_embeddings", None)
                          or DEFAULT_CALIBRATION_SEQ_LEN)
        with warnings.catch_warnings():  # the note below says it on the command line
            warnings.simplefilter("ignore")
            blocks = quantkit.prepare_calibration_data(tokenizer, dataset, num_samples, seq_len, model=source)
        if len(blocks) < num_samples:
            typer.echo(f"note: the calibration text holds {len(blocks)} blocks of {seq_len} tokens, fewer than "
                       f"--num-samples {num_samples}; calibrating on {len(blocks)}", err=True)
    qmodel = quantkit.quantize(source, config, blocks, offload_device=device if offload else None)
    quantkit.save(qmodel, output, tokenizer=tokenizer, overwrite=overwrite)
    if report:
        _write_json(report, qmodel.quantkit_calibration_report)
    typer.echo(f"{qmodel.quantkit_report}; wrote {output} ({scheme}) in {time.perf_counter() - start:.0f} s")


@app.command("eval")
@user_errors
def evaluate(
    checkpoint: Path = typer.Argument(..., help="A quantized checkpoint directory written by `quantkit quantize`."),
    baseline: str = typer.Option(..., help="The 16-bit model to compare against (same forms as `quantize`)."),
    dataset: str = typer.Option(DEFAULT_DATASET, help="Evaluation text (its held-out split is used)."),
    window: int = typer.Option(1024, min=2, help="Tokens per window (BOS included)."),
    stride: Optional[int] = typer.Option(None, min=1, help="New tokens per window (default: window)."),
    max_tokens: Optional[int] = typer.Option(None, min=2, help="Evaluate at most this many tokens."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON here."),
) -> None:
    """Perplexity of CHECKPOINT against its 16-bit BASELINE on the same held-out tokens."""
    import quantkit

    checkpoint = checkpoint.expanduser()
    scheme = quantkit.read_quant_config(checkpoint).name
    if stride is not None and stride > window:
        fail(f"--stride {stride} is larger than --window {window}; use a stride of at most the window")
    if json_path:
        _check_writable(json_path, "--json", directory=False)
        _refuse_inside(json_path, "--json", {"checkpoint": str(checkpoint), "baseline": baseline})
    device = _device(device)
    quantkit.check_dataset(dataset, "evaluation")  # before the models load, not after
    base_model, tokenizer = quantkit.load_model(baseline, device=device)
    tokens = quantkit.prepare_evaluation_tokens(tokenizer, dataset, max_tokens)
    qmodel = quantkit.load(checkpoint, device=device)
    result = quantkit.compare_perplexity(base_model, qmodel, tokens, window, stride, tokenizer.bos_token_id)
    row = _row(scheme, result)
    _print_table([row])
    if json_path:
        _write_json(json_path, {"model": baseline, "checkpoint": str(checkpoint), "dataset": dataset,
                                "window": window, "stride": stride or window, "max_tokens": max_tokens,
                                "device": device, "results": [row]})


def _row(scheme: str, result, layers: int | None = None, seconds: float | None = None) -> dict:
    row = {
        "scheme": scheme,
        "baseline_ppl": result.baseline.perplexity,
        "quantized_ppl": result.quantized.perplexity,
        "delta_percent": result.delta_percent,
        "tokens": result.quantized.tokens,
        "window": result.quantized.window,
    }
    if layers is not None:
        row["layers"] = layers
    if seconds is not None:
        row["seconds"] = round(seconds, 1)
    return row


@app.command()
@user_errors
def demo(
    schemes: str = typer.Option("fp8,int8", help="Comma-separated schemes to compare."),
    max_tokens: Optional[int] = typer.Option(None, min=2, help="Evaluation tokens (default: 4096 on CPU, all held-out text on GPU)."),
    window: Optional[int] = typer.Option(None, min=2, help="Tokens per window (default: 1024 on CPU, 2048 on GPU)."),
    num_samples: int = typer.Option(16, min=1, help="Calibration blocks (static schemes)."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per calibration block."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cuda when available)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON here."),
) -> None:
    """Quantize the bundled Gemma-3-270M and compare its perplexity with the 16-bit model."""
    import torch

    import quantkit

    configs = [quantkit.QuantConfig.preset(s.strip()) for s in schemes.split(",") if s.strip()]
    if not configs:
        fail(f"--schemes {schemes!r} names no scheme; give one or more of int8, int8-static, fp8, fp8-static")
    if json_path:
        _check_writable(json_path, "--json", directory=False)
    device = _device(device)
    on_gpu = device.startswith("cuda")
    max_tokens = max_tokens if max_tokens is not None else (None if on_gpu else 4096)
    window = window or (2048 if on_gpu else 1024)
    typer.echo(f"loading the bundled model {quantkit.BUNDLED_MODEL} on {device} ...")
    base_model, tokenizer = quantkit.load_model(quantkit.BUNDLED_MODEL, device=device)
    tokens = quantkit.prepare_evaluation_tokens(tokenizer, quantkit.BUNDLED_DATASET, max_tokens)
    blocks = None
    if any(c.needs_calibration for c in configs):
        blocks = quantkit.prepare_calibration_data(tokenizer, quantkit.BUNDLED_DATASET, num_samples, seq_len,
                                                   model=base_model)
    typer.echo(f"{tokens.numel()} held-out tokens, window {window}, dtype {base_model.dtype}")
    baseline = quantkit.evaluate_perplexity(base_model, tokens, window, bos_token_id=tokenizer.bos_token_id,
                                            desc="baseline perplexity")
    rows = []
    for config in configs:
        start = time.perf_counter()
        qmodel = quantkit.quantize(copy.deepcopy(base_model), config, blocks)
        quantized = quantkit.evaluate_perplexity(qmodel, tokens, window, bos_token_id=tokenizer.bos_token_id,
                                                 desc=f"{config.name} perplexity")
        result = quantkit.Comparison(baseline=baseline, quantized=quantized)
        rows.append(_row(config.name, result, len(qmodel.quantkit_report.converted), time.perf_counter() - start))
        del qmodel
    typer.echo("")
    _print_table(rows)
    if json_path:
        _write_json(json_path, {
            "model": quantkit.BUNDLED_MODEL,
            "dataset": quantkit.BUNDLED_DATASET,
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "dtype": str(base_model.dtype),
            "torch": torch.__version__,
            "quantkit": quantkit.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "results": rows,
        })


@app.command()
@user_errors
def generate(
    model: str = typer.Argument(..., help="A quantized checkpoint directory, or a 16-bit model (same forms as `quantize`)."),
    prompt: str = typer.Option(..., help="Text to continue."),
    max_new_tokens: int = typer.Option(32, min=1, help="Tokens to generate."),
    scheme: Optional[str] = typer.Option(None, help="Quantize a 16-bit MODEL on the fly with this dynamic scheme."),
    fast: bool = typer.Option(True, "--fast/--plain", help="Fused fast path (identical outputs) or plain modules."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda."),
    temperature: float = typer.Option(0.0, help="0: greedy decoding; > 0: sample at this temperature."),
    top_k: Optional[int] = typer.Option(None, help="Sample among the K most likely tokens (needs --temperature > 0)."),
    top_p: Optional[float] = typer.Option(None, help="Sample among the most likely tokens that hold probability P "
                                          "(needs --temperature > 0)."),
    seed: Optional[int] = typer.Option(None, help="Seed of the sampling (default: a fresh one, printed)."),
    repetition_penalty: Optional[float] = typer.Option(
        None, help="Divide the scores of tokens already in the text by R (> 1 discourages repeats, 1 is off; "
                   "default: the model's generation config)."),
    min_new_tokens: Optional[int] = typer.Option(
        None, min=0, help="No end-of-sequence token before this many new tokens (default: the model's generation "
                          "config)."),
) -> None:
    """Greedy or sampled generation with a static KV cache (CUDA-graph decode on a GPU)."""
    import torch

    import quantkit

    config = quantkit.QuantConfig.preset(scheme) if scheme else None
    if config is not None and config.needs_calibration:
        fail(f"--scheme {scheme} needs calibration data; generate quantizes on the fly with int8 or fp8 "
             "(or run `quantkit quantize` first and pass its checkpoint)")
    sampling = _sampling_options(temperature, top_k, top_p, seed)
    if repetition_penalty is not None and not (math.isfinite(repetition_penalty) and repetition_penalty > 0):
        fail(f"--repetition-penalty {repetition_penalty} must be a finite number > 0 (1 is off; above 1 discourages "
             "repeats)")
    device = _device(device)
    path = Path(model).expanduser()
    if (path / "config.json").is_file() and quantkit.is_quantized_checkpoint(path):
        if config is not None:
            fail(f"{model!r} is already a quantized checkpoint ({quantkit.read_quant_config(path).name}); "
                 "drop --scheme")
        lm, tokenizer = quantkit.load(path, device=device), quantkit.load_tokenizer(path)
    else:
        lm, tokenizer = quantkit.load_model(model, device=device)
        if config is not None:
            lm = quantkit.quantize(lm, config)
    if fast and any(True for _ in quantkit.quantized_modules(lm)):
        quantkit.optimize(lm)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
    stats: dict = {}
    seed = sampling.pop("seed", None)
    if seed is not None:
        sampling["generator"] = torch.Generator(device).manual_seed(seed)
    out = quantkit.generate_tokens(lm, ids, max_new_tokens, stats=stats, repetition_penalty=repetition_penalty,
                                   min_new_tokens=min_new_tokens, **sampling)
    typer.echo(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    steps = stats.get("decode_steps") or 0
    notes = [f"{steps} decode steps, {1000 * stats['decode_s'] / steps:.1f} ms/token, "
             f"prefill {1000 * stats['prefill_s']:.0f} ms"] if steps else []
    if seed is not None:
        notes.append(f"seed {seed}")
    if notes:
        typer.echo(f"[{', '.join(notes)}]", err=True)


def _sampling_options(temperature: float, top_k: Optional[int], top_p: Optional[float], seed: Optional[int]) -> dict:
    """generate_tokens' sampling arguments from the CLI's options ({} for greedy decoding)."""
    if not math.isfinite(temperature) or temperature < 0:
        fail(f"--temperature {temperature} must be >= 0 (0 decodes greedily)")
    if temperature == 0:
        given = [f"--{name} {value}" for name, value in (("top-k", top_k), ("top-p", top_p), ("seed", seed))
                 if value is not None]
        if given:
            fail(f"{', '.join(given)} only applies when sampling; pass --temperature > 0 as well")
        return {}
    if top_k is not None and top_k < 1:
        fail(f"--top-k {top_k} must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        fail(f"--top-p {top_p} must lie in (0, 1]")
    if seed is not None and not 0 <= seed < 2**63:
        fail(f"--seed {seed} must lie in [0, 2**63)")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    return dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


# Not benchmarks/results: run from a checkout, the default would overwrite the committed reference runs.
BENCH_OUT = Path("out/bench")
_BENCH_OUT_OPTION = typer.Option(BENCH_OUT, help="Where CSV/JSON/PNG go (the committed reference runs live in "
                                                 "benchmarks/results).")


def _benchmark(run, out_dir: Path) -> None:
    """Run a benchmark on the GPU; a kernel failing its output check ends it in one line."""
    import torch

    from quantkit.bench import CheckFailed

    if not torch.cuda.is_available():
        fail("benchmarks need a CUDA GPU; none is available here")
    try:
        run(out_dir=out_dir)
    except CheckFailed as exc:
        fail(str(exc).splitlines()[0])


@bench_app.command("gemm")
@user_errors
def bench_gemm(out_dir: Path = _BENCH_OUT_OPTION) -> None:
    """GPU checks, then the quantization kernels and the INT8/FP8 GEMMs vs cuBLAS bf16, _scaled_mm and _int_mm
    (Llama-3-8B shapes)."""
    from quantkit.bench import run_gemm_benchmark

    _benchmark(run_gemm_benchmark, out_dir)


@bench_app.command("attention")
@user_errors
def bench_attention(out_dir: Path = _BENCH_OUT_OPTION) -> None:
    """GPU checks, then flash prefill and split-KV decode attention vs SDPA."""
    from quantkit.bench import run_attention_benchmark

    _benchmark(run_attention_benchmark, out_dir)


@bench_app.command("model")
@user_errors
def bench_model(out_dir: Path = _BENCH_OUT_OPTION) -> None:
    """Fast-path checks, then end to end on a Llama-3-8B-shaped model: HF bf16 vs quantkit fp8/int8 prefill,
    decode, memory."""
    from quantkit.bench import run_e2e_benchmark

    _benchmark(run_e2e_benchmark, out_dir)


def main() -> None:
    # No root handler: logging's last resort prints quantkit's warnings as bare lines, and a root
    # handler would print a second copy of every message from libraries with their own (huggingface_hub).
    import transformers

    # transformers' load-time chatter (unused weights, generation defaults) hides quantkit's output.
    transformers.logging.set_verbosity_error()
    app()


if __name__ == "__main__":
    sys.exit(main())
