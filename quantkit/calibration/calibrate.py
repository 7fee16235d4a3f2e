"""Run calibration blocks through a model and record what enters each target Linear."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from quantkit.calibration.observers import Observer, make_observer
from quantkit.models.experts import expert_linears


def backbone(model: nn.Module) -> nn.Module:
    """The transformer without its LM head (``model.model`` for HF causal LMs), else the model.

    Calibration statistics never need the logits; skipping a 262k-vocabulary head saves most
    of the compute on small models.
    """
    prefix = getattr(model, "base_model_prefix", None)
    inner = getattr(model, prefix, None) if prefix else None
    return inner if isinstance(inner, nn.Module) else model


def input_device(model: nn.Module) -> torch.device:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None:
        return embeddings.weight.device
    return next(model.parameters()).device


def check_blocks(blocks: torch.Tensor, model: nn.Module | None = None) -> None:
    """Shape and dtype of calibration blocks; with ``model``, also its vocabulary and context."""
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            "blocks must be an integer tensor (n_samples, seq_len) of token ids; got "
            f"{type(blocks).__name__} {getattr(blocks, 'dtype', '')} {tuple(getattr(blocks, 'shape', ()))}"
        )
    if blocks.shape[0] == 0 or blocks.shape[1] == 0:
        raise ValueError(f"blocks has shape {tuple(blocks.shape)}; pass at least one block of at least one token")
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and (int(blocks.min()) < 0 or int(blocks.max()) >= vocab):
        raise ValueError(f"blocks hold token ids {int(blocks.min())}..{int(blocks.max())}, outside the model's "
                         f"vocabulary [0, {vocab}); tokenize with the model's own tokenizer")
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and blocks.shape[1] > context:
        raise ValueError(f"blocks have seq_len={blocks.shape[1]} > the model's context of {context}; "
                         f"pass blocks of at most {context} tokens")


def hidden_state(output) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if hidden is not None else output[0]


@torch.no_grad()
def storage_key(t: torch.Tensor) -> tuple:
    """Identity of a tensor within one forward: the same storage, offset, shape, strides and dtype.
    Keep the tensor referenced while keys are compared, or its address may be reused."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def forward_backbone(model: nn.Module, blocks: torch.Tensor, batch_size: int, desc: str = "calibrating",
                     progress: bool = True, layers: Iterable[nn.Module] = ()) -> None:
    """Run every block through the model in batches; hooks do the recording.

    Only the backbone runs (no LM head) unless one of ``layers``, the modules being observed,
    lives outside it (an ``lm_head`` a recipe quantizes), in which case the whole model runs.
    """
    check_blocks(blocks, model)
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    body, device = backbone(model), input_device(model)
    inside = {id(m) for m in body.modules()}
    if any(id(layer) not in inside for layer in layers):
        body = model
    starts = range(0, blocks.shape[0], batch_size)
    for start in tqdm(starts, desc=desc, unit="batch", disable=not progress, leave=False):
        body(input_ids=blocks[start : start + batch_size].to(device), use_cache=False)


@torch.no_grad()
def collect_input_ranges(
    model: nn.Module,
    layers: dict[str, nn.Module],
    blocks: torch.Tensor,
    observer: str = "absmax",
    percentile: float = 99.99,
    dtype: torch.dtype = torch.int8,
    batch_size: int = 4,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Per-tensor clipping value (0-d fp32) of the input of every layer in ``layers`` that ran (a
    mixture of experts' expert may get no calibration token: it has no entry).

    dtype: the activations' quantized dtype (the MSE observer searches the clip for that grid).
    """
    observers: dict[str, Observer] = {name: make_observer(observer, percentile, dtype) for name in layers}
    ran: set[str] = set()

    def record(name, x):
        ran.add(name)
        observers[name].update(x)

    handles = [
        module.register_forward_pre_hook(lambda _m, args, name=name: record(name, args[0]))
        for name, module in layers.items()
    ]
    try:
        forward_backbone(model, blocks, batch_size, "calibrating activations", progress, layers=layers.values())
    finally:
        for handle in handles:
            handle.remove()
    experts = expert_linears(model)
    never = [name for name in layers if name not in ran and name not in experts]
    if never:
        raise ValueError(f"{never[0]} (and {len(never) - 1} more) never ran on the calibration data, so it has no input "
                         f"range; keep it in 16 bits (ignore=[{never[0]!r}])")
    return {name: obs.amax() for name, obs in observers.items() if name in ran}
