"""Calibrate a model larger than the GPU: decoder blocks live in host memory and visit the GPU one at a time.

``stream_blocks(model, device)`` moves everything outside the decoder blocks (embeddings, final
norm, rotary tables, LM head) to ``device`` for good, keeps every block in host memory, and hooks
each block so that it is copied to ``device`` just before it runs and back right after. Every
calibration pass (SmoothQuant statistics, sensitivity forwards, static ranges, GPTQ Hessians) is
a plain forward of the model, so all of them stream without knowing it, and in-place edits of the
weights (SmoothQuant folding) land on the host copy, which is the only copy.

Memory bound on ``device`` (the caching allocator's peak):

    params outside the blocks + the largest block + one calibration batch's activations in one
    block + the statistics being collected

with 16-bit parameters counted in float32 while SmoothQuant runs (it computes in float32: the
parameters outside the blocks are then held in both precisions during the cast, 3x their 16-bit
size, and each visiting block in float32), where the statistics are O(hidden) per layer for
SmoothQuant and observers, and for GPTQ the
Hessians of one block's Linears at a time (``sum K^2 * 4`` bytes over the block's distinct
inputs: ~1 GiB for a Llama-3-8B block), because ``gptq_quantize_weights(..., per_block=True)``
collects them block by block. It runs each block on recorded inputs (``calibration.blockwise``):
the calibration hidden states and any per-batch block arguments wait in host memory, next to the
blocks; one batch of them visits the device with its block, and the masks and rotary tables shared
by all full batches stay there (one copy).

Models dispatched by accelerate (``hf_device_map``) across real devices need nothing from here:
their hooks move activations. Accelerate's own CPU/disk offload keeps weights behind hooks that
discard in-place edits, so ``check_offload`` refuses it with the way out (load on the CPU and
stream with quantkit instead).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.calibration.calibrate import backbone


@dataclass
class StreamStats:
    """What streaming did: blocks moved in, and the most blocks ever resident on the device at once."""

    onloads: int = 0
    resident: int = 0
    max_resident: int = 0


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: the ModuleList of the backbone holding the most parameters."""
    best, best_size = None, 0
    for module in backbone(model).modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = module, size
    if best is None:
        raise ValueError(f"{type(model).__name__} has no list of decoder blocks to stream; quantize it on one device")
    return best


def check_offload(model: nn.Module) -> None:
    """Refuse accelerate CPU/disk offload: its hooks would drop SmoothQuant's in-place weight edits."""
    device_map = getattr(model, "hf_device_map", None) or {}
    offloaded = sorted(k for k, v in device_map.items() if v in ("cpu", "disk"))
    if offloaded and len(set(device_map.values())) > 1:
        raise ValueError(
            f"the model is dispatched by accelerate with offloaded modules ({offloaded[0]} on "
            f"{device_map[offloaded[0]]}); load it on the CPU instead and pass offload_device='cuda' "
            "(CLI: --offload), which streams one decoder block at a time"
        )


def block_of(model: nn.Module, names: list[str]) -> dict[str, int]:
    """Decoder-block index of each named module (modules outside the blocks are left out)."""
    blocks = decoder_blocks(model)
    owner = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    modules = dict(model.named_modules())
    return {n: owner[id(modules[n])] for n in names if id(modules[n]) in owner}


@contextmanager
def stream_blocks(model: nn.Module, device: str | torch.device):
    """Run ``model`` with its decoder blocks streamed to ``device`` one at a time (see the module doc).

    The model must sit in host memory. Yields a ``StreamStats``; on exit every block is back on
    the host and the rest of the model stays on ``device`` (moved back to the host as well).
    """
    device = torch.device(device)
    host = torch.device("cpu")
    on_host = {p.device.type for p in model.parameters()}
    if on_host != {"cpu"}:
        raise ValueError(f"streaming needs the model in host memory; its parameters are on {sorted(on_host)}: "
                         "load it with device='cpu'")
    blocks = decoder_blocks(model)
    stats = StreamStats()
    inside = {id(t) for t in list(blocks.parameters()) + list(blocks.buffers())}
    # Everything outside the blocks goes to the device once (tied weights are one Parameter).
    moved = []
    for module in model.modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if tensor is not None and id(tensor) not in inside:
                moved.append(tensor)
    for tensor in {id(t): t for t in moved}.values():
        tensor.data = tensor.data.to(device)

    def onload(block, _args):
        block.to(device)
        stats.onloads += 1
        stats.resident += 1
        stats.max_resident = max(stats.max_resident, stats.resident)

    def offload(block, _args, _output):
        block.to(host)
        stats.resident -= 1

    handles = []
    for block in blocks:
        handles.append(block.register_forward_pre_hook(onload))
        handles.append(block.register_forward_hook(offload, always_call=True))
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()
        model.to(host)
