"""Module rewriting: every target nn.Linear of a model becomes a QuantLinear.

Knows models and modules, not kernels: the numerics live in QuantLinear and below.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.config import QuantConfig
from quantkit.models.experts import expert_modules
from quantkit.nn import QuantLinear
from quantkit.nn.linear import QuantizedBuffers, layer_backend

logger = logging.getLogger(__name__)


# Mixture-of-experts routing gates stay in 16 bits, as the output head does: a few outputs that
# pick experts (or scale the shared expert) from the whole hidden state, where an 8-bit error
# changes which weights run. Matched by their last name part and a small output count.
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")
ROUTER_MAX_OUTPUTS = 512

# Sibling projections that read one input and that serving engines (vLLM) run as one fused GEMM
# (qkv_proj, gate_up_proj): all must share one scheme, or the engine refuses the checkpoint.
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class ConversionReport:
    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    # Weights (2-D and up) of modules other than nn.Linear and embeddings, by module type: they
    # stay in 16 bits (e.g. the stacked expert tensors of transformers' MoE blocks).
    other_weights: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        text = f"converted {len(self.converted)} Linear layers, kept {len(self.skipped)} in 16 bits"
        if self.other_weights:
            listed = ", ".join(f"{kind} {count:,}" for kind, count in self.other_weights.items())
            text += f"; weights of other modules left in 16 bits: {listed}"
        return text


def is_routing_gate(name: str, module: nn.Linear) -> bool:
    return name.rsplit(".", 1)[-1] in ROUTER_NAMES and module.out_features <= ROUTER_MAX_OUTPUTS


def target_linears(model: nn.Module, config: QuantConfig, extra_ignore: tuple[str, ...] = (),
                   keep_routers: bool = True) -> dict[str, nn.Linear]:
    """Name -> module for every nn.Linear that ``config`` quantizes; routing gates only with
    ``keep_routers=False`` (loading: a checkpoint's ignore list says what it quantized)."""
    return {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not config.is_ignored(name) and name not in extra_ignore
        and not (keep_routers and is_routing_gate(name, module))
    }


def weights_outside_linears(model: nn.Module) -> dict[str, int]:
    """Module type -> parameter count of the 2-D+ weights that no nn.Linear, QuantLinear or
    embedding holds: what a conversion of Linears cannot reach."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (nn.Linear, QuantLinear, nn.Embedding)):
            continue
        n = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
        if n:
            kind = type(module).__name__
            counts[kind] = counts.get(kind, 0) + n
    return counts


def require_targets(model: nn.Module, config: QuantConfig) -> None:
    """Raise ValueError, naming what the model holds instead, when no Linear would be quantized."""
    if target_linears(model, config):
        return
    others = weights_outside_linears(model)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head else None
    linears = [name for name, module in model.named_modules()
               if type(module) is nn.Linear and module is not head and not is_routing_gate(name, module)]
    if others and not linears:
        kinds = ", ".join(sorted(others))
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to quantize: its weights are in {kinds}, "
                         "which quantkit does not quantize (it rewrites nn.Linear layers only)")
    raise ValueError(f"no nn.Linear layer matched; check the ignore patterns of the QuantConfig ({list(config.ignore)})")


def format_tensor_names(model: nn.Module) -> set[str]:
    """State-dict names of the tensors whose dtype is the quantized format (weight, weight_scale,
    input_scale of each quantized module): never cast, whatever dtype the rest is stored in."""
    return {f"{name}.{buffer}" if name else buffer
            for name, module in model.named_modules() if isinstance(module, QuantizedBuffers)
            for buffer in QuantizedBuffers._FORMAT_BUFFERS if module._buffers.get(buffer) is not None}


def storage_dtype(model: nn.Module) -> torch.dtype | None:
    """The 16-bit dtype a float32 model's unquantized tensors are kept to and saved in: the one its
    source checkpoint stored them in (``load_model`` and ``quantkit.load`` record it as
    ``quantkit_source_dtype``; a CPU computes in float32), so a checkpoint made on a CPU is the size
    of one made on a GPU. None: they are saved as they are."""
    source = getattr(model, "quantkit_source_dtype", None)
    compute = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    return source if compute == torch.float32 and source in (torch.float16, torch.bfloat16) else None


def storage_tensors(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The float32 parameters and persistent buffers stored in ``dtype``, by state-dict name:
    all but the quantized formats and what transformers keeps in float32 at that dtype (a router's
    weight, a correction bias: ``_keep_in_fp32_modules(_strict)``). Empty for None."""
    if dtype is None:
        return {}
    formats = format_tensor_names(model)
    dtype_plan = getattr(model, "_get_dtype_plan", None)
    float32 = [re.compile(re.escape(p).replace(r"\*", ".*")) for p in (dtype_plan(dtype) if dtype_plan else ())]
    return {name: tensor for name, tensor in model.state_dict(keep_vars=True).items()
            if tensor.dtype == torch.float32 and name not in formats and not any(p.search(name) for p in float32)}


@torch.no_grad()
def round_to_storage(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Round the tensors ``storage_tensors`` names to ``dtype``'s values, in place (they stay
    float32): the model then computes with exactly the values its checkpoint will hold."""
    for tensor in storage_tensors(model, dtype).values():
        tensor.data.copy_(tensor.data.to(dtype))


def untie_quantized_head(model: nn.Module) -> bool:
    """If the output head is a QuantLinear, mark the config untied and return True.

    A tied config makes ``tie_weights`` (transformers calls it when loading, and so does
    ``quantkit.load``) put the float input embedding back in place of the head's quantized weight;
    a checkpoint has to store the head on its own.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    if not isinstance(get_head() if get_head else None, QuantLinear):
        return False
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in (config, text_config):
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
    return True


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


@torch.no_grad()
def convert_model(
    model: nn.Module,
    config: QuantConfig,
    backend: str,
    input_amax: dict[str, torch.Tensor] | None = None,
    weight_amax: dict[str, torch.Tensor] | None = None,
    quantized_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    extra_ignore: tuple[str, ...] = (),
) -> ConversionReport:
    """Swap target Linears for QuantLinears in place.

    input_amax: calibrated input clipping per layer name; required when ``config.is_static``.
    weight_amax / quantized_weights: optional per-layer results of a clipping search or GPTQ.
    backend: a concrete backend ("triton" or "torch"), already resolved for the model's device.
    """
    require_targets(model, config)
    report = ConversionReport()
    targets = target_linears(model, config, extra_ignore)
    if config.is_static:
        missing = [name for name in targets if input_amax is None or name not in input_amax]
        if missing:
            raise ValueError(
                f"static activations need calibrated input ranges, missing for {len(missing)} layers "
                f"(first: {missing[0]}); run calibration first"
            )
    for name, module in model.named_modules():
        if type(module) is nn.Linear and name not in targets:
            report.skipped.append(name)
    for name, linear in targets.items():
        if config.is_static and not bool(torch.isfinite(input_amax[name]).all()):
            raise ValueError(f"{name}: calibration measured the input range {input_amax[name].item()}; the model "
                             "produced inf/NaN activations on the calibration data (check its dtype and weights)")
        if config.is_static and not bool((input_amax[name] > 0).all()):
            # Its static scale is the smallest there is: any input it sees later rounds to ~0.
            logger.warning("%s: its input was zero on every calibration token, so its static input scale clips "
                           "everything; calibrate on more text or keep it in 16 bits (ignore=[%r])", name, name)
        quantized = QuantLinear.from_linear(
            linear,
            config.torch_dtype,
            input_amax=input_amax[name] if config.is_static else None,
            weight_amax=(weight_amax or {}).get(name),
            quantized_weight=(quantized_weights or {}).get(name),
            backend=layer_backend(backend, linear.in_features),
        )
        _set_submodule(model, name, quantized)
        report.converted.append(name)
    if not report.converted:
        raise ValueError("every nn.Linear layer is kept in 16 bits; nothing to quantize")
    untie_quantized_head(model)
    for kept, quantized_siblings in split_fused_groups(model):
        logger.warning("%s stay in 16 bits but %s are quantized: they read one input, and vLLM runs them as one "
                       "fused GEMM and refuses such a checkpoint; ignore all of them or none", ", ".join(kept),
                       ", ".join(quantized_siblings))
    for name, experts in expert_modules(model).items():
        layers = [m for m in experts.modules() if isinstance(m, (nn.Linear, QuantLinear))]
        kept = sum(type(m) is nn.Linear for m in layers)
        if 0 < kept < len(layers):
            logger.warning("%s: %d of its %d expert layers stay in 16 bits and the rest are quantized; vLLM runs a "
                           "layer's experts as one fused GEMM of one scheme and refuses such a checkpoint; ignore all "
                           "of them (%s.*) or none", name, kept, len(layers), name)
    report.other_weights = weights_outside_linears(model)
    other = sum(report.other_weights.values())
    quantized = sum(model.get_submodule(name).weight.numel() for name in report.converted)
    if other > quantized:
        logger.warning("only %.0f%% of the model's matrix weights were quantized: %s stay in 16 bits "
                       "(quantkit quantizes nn.Linear layers only)", 100 * quantized / (quantized + other),
                       ", ".join(sorted(report.other_weights)))
    logger.info("%s", report)
    return report


def split_fused_groups(model: nn.Module) -> list[tuple[list[str], list[str]]]:
    """(kept, quantized) layer names of each FUSED_SIBLINGS group that is part quantized, part not."""
    split = []
    for parent_name, parent in model.named_modules():
        for siblings in FUSED_SIBLINGS:
            members = {name: getattr(parent, name, None) for name in siblings}
            if not all(isinstance(m, (nn.Linear, QuantLinear)) for m in members.values()):
                continue
            prefix = f"{parent_name}." if parent_name else ""
            kept = [prefix + n for n, m in members.items() if not isinstance(m, QuantLinear)]
            if kept and len(kept) < len(siblings):
                split.append((kept, [prefix + n for n, m in members.items() if isinstance(m, QuantLinear)]))
    return split


def build_empty_quantized(model: nn.Module, config: QuantConfig, backend: str, dtype: torch.dtype) -> list[str]:
    """Swap target Linears for uninitialised QuantLinears (the loader fills them from a checkpoint)."""
    names = []
    # A checkpoint lists by name every Linear it kept in 16 bits (routing gates included since
    # they stay so), so the ignore list alone decides here; older checkpoints quantized some gates.
    for name, linear in target_linears(model, config, keep_routers=False).items():
        module = QuantLinear(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            config.torch_dtype,
            static_input=config.is_static,
            dtype=dtype,
            backend=layer_backend(backend, linear.in_features),
            device=linear.weight.device,
        )
        _set_submodule(model, name, module)
        names.append(name)
    return names
