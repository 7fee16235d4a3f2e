"""The public Python API: quantize a model, save it, load it, measure it."""

from __future__ import annotations

import logging
import warnings
from dataclasses import asdict, dataclass

import torch
from torch import nn

from quantkit.calibration.calibrate import check_blocks, collect_input_ranges
from quantkit.calibration.gptq import gptq_quantize_weights
from quantkit.calibration.offload import check_offload, stream_blocks
from quantkit.calibration.report import build_report
from quantkit.calibration.sensitivity import most_sensitive, rank_layers, shared_input_groups
from quantkit.calibration.smoothquant import smooth_model
from quantkit.calibration.weights import weight_amax as observed_weight_amax
from quantkit.calibration.data import calibration_blocks, check_source, load_texts, tokenize_stream
from quantkit.config import QuantConfig
from quantkit.convert import (ConversionReport, convert_model, require_targets, round_to_storage, storage_dtype,
                              target_linears)
from quantkit.eval.perplexity import PerplexityResult, evaluate_perplexity
from quantkit.kernels.ops import resolve_backend
from quantkit.models.experts import expert_linears, input_scale_groups, unstack_experts
from quantkit.nn import QuantLinear

logger = logging.getLogger(__name__)


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def context_length(model: nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def prepare_calibration_data(tokenizer, dataset: str, num_samples: int = 64, seq_len: int = 512,
                             model: nn.Module | None = None) -> torch.Tensor:
    """(num_samples, seq_len) token blocks from the calibration split of ``dataset``."""
    if model is not None:
        limit = context_length(model)
        if limit is not None and seq_len > limit:
            raise ValueError(f"seq_len={seq_len} is larger than the model's context of {limit} tokens; "
                             f"use --seq-len {limit} or less")
    blocks = calibration_blocks(tokenizer, load_texts(dataset, "calibration"), num_samples, seq_len)
    if len(blocks) < num_samples:
        warnings.warn(f"the calibration split of {dataset!r} holds {len(blocks)} blocks of {seq_len} tokens, fewer "
                      f"than num_samples={num_samples}; calibrating on {len(blocks)}", stacklevel=2)
    return blocks


def check_dataset(dataset: str, split: str = "calibration") -> None:
    """Raise DatasetError unless ``dataset`` can be read and holds documents for ``split``: a check
    to run before a model loads (minutes for a large one) rather than after. The split itself is
    made when the text is used."""
    check_source(dataset, split)


def prepare_evaluation_tokens(tokenizer, dataset: str, max_tokens: int | None = None) -> torch.Tensor:
    """The held-out evaluation split of ``dataset`` as one token stream (optionally truncated)."""
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens={max_tokens} must be at least 2 (a token and the one it predicts)")
    return tokenize_stream(tokenizer, load_texts(dataset, "evaluation"), max_tokens)


@torch.no_grad()
def quantize(
    model: nn.Module,
    config: QuantConfig | str,
    calibration_data: torch.Tensor | None = None,
    progress: bool = True,
    offload_device: str | torch.device | None = None,
) -> nn.Module:
    """Quantize ``model`` in place to W8A8 as ``config`` (or the scheme it names) says and return it.

    calibration_data: (n, seq_len) token ids; needed for static activations (and for the
    calibration recipes), unused for plain dynamic schemes.
    offload_device: calibrate a model kept in host memory on this device, one decoder block at a
    time (``calibration.offload`` states the memory bound); the quantized model stays in host
    memory (save it, or move it with ``.to``), with the backend chosen for the host.

    A float32 model loaded by ``load_model`` from a 16-bit checkpoint (the CPU default) keeps its
    unquantized tensors to that dtype's values (SmoothQuant's norm gains included), and ``save``
    stores them in it: the checkpoint holds exactly the model quantized (``storage_dtype``).
    """
    if isinstance(config, str):
        config = QuantConfig.preset(config)
    elif not isinstance(config, QuantConfig):
        raise TypeError(f"config={config!r} is not a QuantConfig; pass one (QuantConfig.preset('fp8')) or a scheme name")
    if any(isinstance(m, QuantLinear) for m in model.modules()) or getattr(getattr(model, "config", None), "quantization_config", None):
        raise ValueError("the model is already quantized; quantize its 16-bit original")
    if config.needs_calibration and calibration_data is None:
        raise ValueError(f"scheme {config.name!r} needs calibration data; pass token blocks "
                         "(quantkit.prepare_calibration_data)")
    if calibration_data is not None:
        check_blocks(calibration_data, model)
    check_offload(model)
    # A mixture of experts' stacked matrices become one Linear per expert and projection (their
    # checkpoint layout), unless the config keeps every one of them in 16 bits.
    unstack_experts(model, keep=config.is_ignored)
    backend = resolve_backend(config.backend, _model_device(model))
    if offload_device is None:
        return _quantize(model, config, calibration_data, progress, backend, per_block=False)
    with stream_blocks(model, offload_device):
        return _quantize(model, config, calibration_data, progress, backend, per_block=True)


def _quantize(model: nn.Module, config: QuantConfig, calibration_data: torch.Tensor | None, progress: bool,
              backend: str, per_block: bool) -> nn.Module:
    # Statistics in eval mode whatever mode the caller left the model in (dropout doubled some
    # static input scales); the caller's mode is restored.
    was_training = model.training
    model.eval()
    try:
        return _quantize_eval(model, config, calibration_data, progress, backend, per_block)
    finally:
        model.train(was_training)


def _quantize_eval(model: nn.Module, config: QuantConfig, calibration_data: torch.Tensor | None, progress: bool,
                   backend: str, per_block: bool) -> nn.Module:
    require_targets(model, config)  # before any calibration work
    dtype = config.torch_dtype
    storage = storage_dtype(model)
    quantizable = target_linears(model, config)
    candidates = len(quantizable)
    if config.keep_sensitive >= candidates:  # before SmoothQuant's statistics, not after
        raise ValueError(f"keep_sensitive={config.keep_sensitive} would keep all {candidates} quantizable "
                         f"Linear layers in 16 bits; use a value below {candidates}")
    smoothquant_report = None
    if config.smoothquant_alpha is not None:
        # Folded into the preceding norms / Linears: the float model is unchanged, its activations
        # lose their outlier channels, and the weights absorb them.
        smoothquant_report = smooth_model(
            model, calibration_data, alpha=config.smoothquant_alpha, exclude=config.ignore, progress=progress,
            quant_dtype=dtype, static_activations=config.is_static, storage_dtype=storage,
        )
    ranking, kept = None, ()
    if config.keep_sensitive:
        # One forward per layer: short blocks keep a 100-layer model in minutes on a CPU.
        # Experts are not ranked: one forward per expert would cost hundreds per layer, and an
        # engine runs a layer's experts as one fused GEMM of one scheme, so one could not stay alone.
        experts = expert_linears(model)
        ranking = rank_layers(model, calibration_data, config, progress=progress, max_seq_len=128,
                              layer_names=[name for name in quantizable if name not in experts])
        # Whole groups of layers that read one input (q/k/v, gate/up): engines fuse each into one
        # GEMM of one scheme, so a group is kept whole or not at all.
        groups = shared_input_groups(model, calibration_data, quantizable)
        kept = tuple(most_sensitive(ranking, config.keep_sensitive, groups))
        if len(kept) >= candidates:
            raise ValueError(f"keep_sensitive={config.keep_sensitive} keeps, with the layers that share their "
                             f"inputs, all {candidates} quantizable Linear layers in 16 bits; use a smaller value")
    targets = target_linears(model, config, kept)
    input_amax = None
    if config.is_static:
        input_amax = collect_input_ranges(
            model, targets, calibration_data, config.activation_observer, config.percentile, dtype=dtype,
            progress=progress,
        )
        # One scale per experts layer's gate/up inputs and one per its down inputs, the largest
        # seen: vLLM's, and an expert no calibration token reached gets it too.
        for group in input_scale_groups(model):
            measured = [input_amax[name] for name in group if name in input_amax]
            if measured:
                shared = torch.stack([amax.reshape(()) for amax in measured]).amax()
                input_amax.update({name: shared.clone() for name in group if name in targets})
    quantized_weights, weight_amax = None, None
    if config.gptq:
        quantized_weights = gptq_quantize_weights(
            model, calibration_data, list(targets), dtype, weight_observer=config.weight_observer, progress=progress,
            per_block=per_block, percentile=config.percentile, sequential=config.gptq_sequential,
            input_amax=input_amax,
        )
    elif config.weight_observer != "absmax":
        weight_amax = {name: observed_weight_amax(linear.weight, dtype, config.weight_observer, config.percentile)
                       for name, linear in targets.items()}
    report: ConversionReport = convert_model(
        model, config, backend, input_amax=input_amax, weight_amax=weight_amax,
        quantized_weights=quantized_weights, extra_ignore=kept,
    )
    logger.info("%s (backend=%s)", report, backend)
    round_to_storage(model, storage)
    model.quantkit_storage_dtype = storage
    model.quantkit_config = config
    model.quantkit_report = report
    model.quantkit_kept = kept
    model.quantkit_calibration_report = build_report(
        config.to_quantization_config()["quantkit"],
        smoothquant=smoothquant_report,
        weight_scales={name: model.get_submodule(name).weight_scale.view(-1) for name in report.converted},
        input_scales={name: model.get_submodule(name).input_scale for name in report.converted} if config.is_static else None,
        sensitivity=ranking,
        kept_in_16_bits=list(kept),
    )
    return model


@dataclass(frozen=True)
class Comparison:
    baseline: PerplexityResult
    quantized: PerplexityResult

    @property
    def delta_percent(self) -> float:
        return 100.0 * (self.quantized.perplexity / self.baseline.perplexity - 1.0)

    def to_dict(self) -> dict:
        return {"baseline": asdict(self.baseline), "quantized": asdict(self.quantized), "delta_percent": self.delta_percent}


def compare_perplexity(baseline: nn.Module, quantized: nn.Module, tokens: torch.Tensor, window: int = 1024,
                       stride: int | None = None, bos_token_id: int | None = None,
                       progress: bool = True, cuda_graph: bool = False) -> Comparison:
    """Perplexity of both models on the same tokens with the same windows (``cuda_graph``: see
    ``evaluate_perplexity``). ``quantized`` must have been made from ``baseline``."""
    check_same_model(baseline, quantized)
    return Comparison(
        baseline=evaluate_perplexity(baseline, tokens, window, stride, bos_token_id, progress, "baseline perplexity",
                                     cuda_graph),
        quantized=evaluate_perplexity(quantized, tokens, window, stride, bos_token_id, progress,
                                      "quantized perplexity", cuda_graph),
    )


# What a quantized model shares with its 16-bit original whatever the recipe.
_ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")
# quantkit keeps the input embeddings in 16 bits and no recipe changes them: a checkpoint's differ
# from its original's by bf16 rounding (2**-9 relative) at most.
_EMBEDDING_TOLERANCE = 1e-2


@torch.no_grad()
def check_same_model(baseline: nn.Module, quantized: nn.Module) -> None:
    """Raise ValueError unless ``quantized`` was made from ``baseline``: the same architecture and the
    same input embeddings."""
    def text_config(model):  # multimodal configs keep the language model's sizes in text_config
        config = getattr(model, "config", None)
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    ours_config, theirs_config = text_config(baseline), text_config(quantized)
    if ours_config is None or theirs_config is None:
        return  # not Hugging Face models: nothing to compare by
    for key in _ARCHITECTURE:
        ours, theirs = getattr(ours_config, key, None), getattr(theirs_config, key, None)
        if ours != theirs:
            raise ValueError(f"the quantized model has {key}={theirs!r} but the baseline has {key}={ours!r}; "
                             "compare a checkpoint with the 16-bit model it was made from")
    if not (hasattr(baseline, "get_input_embeddings") and hasattr(quantized, "get_input_embeddings")):
        return
    base, quant = baseline.get_input_embeddings().weight, quantized.get_input_embeddings().weight
    if base.is_meta or quant.is_meta:
        return  # offloaded: the values are not here to compare
    if base.shape != quant.shape:
        raise ValueError(f"the quantized model's input embeddings are {tuple(quant.shape)}, the baseline's "
                         f"{tuple(base.shape)}; compare a checkpoint with the 16-bit model it was made from")
    diff = norm = 0.0
    for start in range(0, base.shape[0], 8192):  # in slices: a large vocabulary's fp32 copy is gigabytes
        rows = base[start:start + 8192].float()
        diff += (rows - quant[start:start + 8192].to(rows.device, torch.float32)).square().sum().item()
        norm += rows.square().sum().item()
    relative = (diff / max(norm, 1e-30)) ** 0.5
    if relative > _EMBEDDING_TOLERANCE:
        raise ValueError(f"the quantized model's input embeddings differ from the baseline's by {relative:.2g} "
                         "(relative); compare a checkpoint with the 16-bit model it was made from")
