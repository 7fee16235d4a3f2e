"""Run calibration blocks through a model and record what enters each target Linear."""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from quantkit.calibration.observers import Observer, make_observer


def iterate_batches(blocks: torch.Tensor, batch_size: int, desc: str, progress: bool = True):
    """Yield (batch_size, seq_len) slices of ``blocks`` under a progress bar."""
    starts = range(0, blocks.shape[0], batch_size)
    for start in tqdm(starts, desc=desc, unit="batch", disable=not progress, leave=False):
        yield blocks[start : start + batch_size]


@torch.no_grad()
def run_blocks(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4, desc: str = "calibrating",
               progress: bool = True) -> None:
    """Forward every calibration block (no outputs kept: the hooks do the recording)."""
    device = next(model.parameters()).device
    for batch in iterate_batches(blocks, batch_size, desc, progress):
        model(input_ids=batch.to(device), use_cache=False)


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
    """Per-tensor clipping value (0-d fp32) of the input of every layer in ``layers``.

    dtype: the activations' quantized dtype (the MSE observer searches the clip for that grid).
    """
    observers: dict[str, Observer] = {name: make_observer(observer, percentile, dtype) for name in layers}
    handles = [
        module.register_forward_pre_hook(lambda _m, args, name=name: observers[name].update(args[0]))
        for name, module in layers.items()
    ]
    try:
        run_blocks(model, blocks, batch_size, desc="calibrating activations", progress=progress)
    finally:
        for handle in handles:
            handle.remove()
    return {name: obs.amax() for name, obs in observers.items()}
