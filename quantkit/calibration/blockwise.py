"""Run calibration data through a model one decoder block at a time, each block once per batch.

A pass that needs the inputs of block i (GPTQ's statistics, block by block) would otherwise run
blocks 0..i for every i: L(L+1)/2 block forwards for L blocks. ``BlockInputs`` records, in one
forward per batch, what enters block 0 and the other arguments of every block's call (attention
masks, rotary tables: Gemma 3 gives sliding and full-attention layers different ones), and then
steps the hidden states through the blocks: ``run(i)`` runs block i on every batch and makes its
outputs the next block's inputs. Every block thus runs once per batch per step, whatever came
before it (a caller may change block i, e.g. make it run quantized, before stepping past it).

This holds only where the blocks form a chain: each block's hidden-state input is the previous
block's output, in list order, and nothing else enters them that depends on the data.
``BlockInputs.record`` checks the first part on the recorded forward (the tensor passed on is the
very object the block before returned) and returns None otherwise, so the caller can fall back to
whole-model forwards.

Memory: the hidden states of every calibration sample, ``n_samples * seq_len * hidden`` in the
model's dtype, held on the decoder blocks' device (host memory when they stream: each batch then
visits the compute device with its block), plus the other arguments of one batch (those equal to
an earlier batch's are shared, as full batches' masks and rotary tables are).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from quantkit.calibration.calibrate import forward_backbone, hidden_state, input_device


class _Recorded(Exception):
    """Raised once the last block needed has been recorded: the rest of the forward is not needed."""


@dataclass
class _Call:
    """One block's call on one batch, without its hidden-state input."""

    args: tuple
    kwargs: dict
    positional: bool  # the hidden state is the first positional argument (else kwargs["hidden_states"])


@dataclass
class BlockInputs:
    """The hidden states entering block ``step`` for every batch, and every block's other arguments."""

    blocks: nn.ModuleList
    hidden: list[torch.Tensor]  # per batch, on ``store``
    calls: list[list[_Call]]  # calls[batch][block]
    device: torch.device  # where a block takes its inputs
    store: torch.device  # where the hidden states wait between blocks
    step: int = 0
    _shared: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    @torch.no_grad()
    def record(cls, model: nn.Module, blocks: nn.ModuleList, data: torch.Tensor, batch_size: int,
               last: int) -> "BlockInputs | None":
        """One forward of ``model`` per batch of ``data``, up to block ``last``; None if blocks 0..last
        do not run as a chain (in list order, each fed the tensor the one before returned)."""
        device = input_device(model)
        first = next(blocks[0].parameters(), None)
        store = first.device if first is not None else device  # before any call: host memory if they stream
        out = cls(blocks, [], [], device, store)
        order: list[int] = []
        previous: list = [None]  # the hidden state the last block returned
        chain = [True]

        def before(index):
            def hook(_module, args, kwargs):
                positional = len(args) > 0
                x = args[0] if positional else kwargs.get("hidden_states")
                if not isinstance(x, torch.Tensor) or (index > 0 and x is not previous[0]):
                    chain[0] = False
                if index == 0 and isinstance(x, torch.Tensor):
                    out.hidden.append(x.detach().to(store))
                rest = args[1:] if positional else args
                kwargs = {k: v for k, v in kwargs.items() if positional or k != "hidden_states"}
                out.calls[-1].append(_Call(*out._dedupe((rest, kwargs)), positional=positional))
                order.append(index)
            return hook

        def after(index):
            def hook(_module, _args, output):
                previous[0] = hidden_state(output)
                if index == last:
                    raise _Recorded
            return hook

        handles = []
        for i in range(last + 1):
            handles.append(blocks[i].register_forward_pre_hook(before(i), with_kwargs=True))
            handles.append(blocks[i].register_forward_hook(after(i)))
        try:
            for start in range(0, data.shape[0], batch_size):
                out.calls.append([])
                order.clear()
                try:
                    forward_backbone(model, data[start : start + batch_size], batch_size, progress=False)
                except _Recorded:
                    pass
                if order != list(range(last + 1)) or not chain[0]:
                    return None
        finally:
            for handle in handles:
                handle.remove()
        return out

    def _dedupe(self, tree):
        """``tree`` with each tensor replaced by an equal one recorded before, if any."""
        def share(x):
            if not isinstance(x, torch.Tensor):
                return x
            for t in self._shared:
                if t is x or (t.shape == x.shape and t.dtype == x.dtype and t.device == x.device and torch.equal(t, x)):
                    return t
            self._shared.append(x)
            return x
        return pytree.tree_map(share, tree)

    @torch.no_grad()
    def run(self, index: int, keep: bool = True, each_batch=None) -> None:
        """Run block ``index`` (the next one) on every batch; ``keep``: its outputs become the hidden
        states (else they are dropped, for a pass that only records what enters its layers);
        ``each_batch()`` is called after each batch."""
        if index != self.step:
            raise ValueError(f"block {index} cannot run before block {self.step}: the hidden states are those "
                             f"entering block {self.step}")
        block = self.blocks[index]
        for b, x in enumerate(self.hidden):
            call = self.calls[b][index]
            x = x.to(self.device)
            output = block(x, *call.args, **call.kwargs) if call.positional else \
                block(*call.args, hidden_states=x, **call.kwargs)
            if keep:
                self.hidden[b] = hidden_state(output).detach().to(self.store)
            if each_batch is not None:
                each_batch()
        if keep:
            self.step += 1
