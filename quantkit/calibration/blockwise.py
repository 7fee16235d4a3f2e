"""Run calibration data through a model one decoder block at a time, each block once per batch.

A pass that needs the inputs of block i (GPTQ's statistics, block by block) would otherwise run
blocks 0..i for every i: L(L+1)/2 block forwards for L blocks. ``BlockInputs`` records, in one
forward per batch, what enters block 0 and the other arguments of every block's call (attention
masks, rotary tables: Gemma 3 gives sliding and full-attention layers different ones), and then
steps the hidden states through the blocks: ``run(i)`` runs block i on every batch and makes its
outputs the next block's inputs. Every block thus runs once per batch per step, whatever came
before it (a caller may change block i, e.g. make it run quantized, before stepping past it).

This holds where the blocks form a chain: each block's hidden-state input is the previous block's
output, in list order. ``BlockInputs.record`` checks that on the recorded forward (the tensor
passed on is the one the block before returned, or a view of all of it) and returns None
otherwise, so the caller can fall back to whole-model forwards. The other arguments are recorded
per batch, so they may depend on the data; they must not depend on earlier blocks' outputs (no
model in transformers passes such a thing), as a caller that changes a block would otherwise see
them stale. Inputs are copied, so a block that edits its input in place does no harm.

Memory: the hidden states of every calibration sample, ``n_samples * seq_len * hidden`` in the
model's dtype, held on the decoder blocks' device (host memory when they stream: each batch then
visits the compute device with its block). Of the other arguments, those equal to the previous
batch's are shared (one copy of the masks and rotary tables of all full batches, on the device);
those that change per batch (Gemma 3n's per-layer inputs, a partial last batch's masks) wait with
the hidden states, and a block's are dropped once the hidden states have stepped past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree
from tqdm.auto import tqdm

from quantkit.calibration.calibrate import forward_backbone, hidden_state, input_device, storage_key


class _Recorded(Exception):
    """Raised once the last block needed has been recorded: the rest of the forward is not needed."""


@dataclass
class _Stored:
    """A per-batch argument kept in ``BlockInputs.store``, and the device it goes back to."""

    tensor: torch.Tensor
    device: torch.device


@dataclass
class _Call:
    """One block's call on one batch, without its hidden-state input: its (args, kwargs) flattened."""

    leaves: list
    spec: pytree.TreeSpec
    positional: bool  # the hidden state is the first positional argument (else kwargs["hidden_states"])

    def arguments(self) -> tuple[tuple, dict]:
        leaves = [leaf.tensor.to(leaf.device) if isinstance(leaf, _Stored) else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)


def _same(a, b) -> bool:
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                      and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b)))


@dataclass
class BlockInputs:
    """The hidden states entering block ``step`` for every batch, and every block's other arguments."""

    blocks: nn.ModuleList
    hidden: list[torch.Tensor]  # per batch, on ``store``
    calls: list[list[_Call | None]]  # calls[batch][block]; None once stepped past
    device: torch.device  # where a block takes its inputs
    store: torch.device  # where the hidden states wait between blocks
    step: int = 0
    _memo: dict = field(default_factory=dict)  # id -> (argument, as kept), within the batch being recorded

    @classmethod
    @torch.no_grad()
    def record(cls, model: nn.Module, blocks: nn.ModuleList, data: torch.Tensor, batch_size: int,
               last: int, progress: bool = False) -> "BlockInputs | None":
        """One forward of ``model`` per batch of ``data``, up to block ``last``; None if blocks 0..last
        do not run as a chain (in list order, each fed what the one before returned)."""
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
                prev = previous[0]
                # the very tensor, or a view of all of it (same storage, offset, shape and strides)
                linked = (isinstance(prev, torch.Tensor) and isinstance(x, torch.Tensor)
                          and storage_key(x) == storage_key(prev))
                if not isinstance(x, torch.Tensor) or (index > 0 and not linked):
                    chain[0] = False
                if index == 0 and isinstance(x, torch.Tensor):
                    out.hidden.append(x.detach().to(store, copy=True))
                rest = args[1:] if positional else args
                kwargs = {k: v for k, v in kwargs.items() if positional or k != "hidden_states"}
                out.calls[-1].append(out._call(index, (rest, kwargs), positional))
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
            starts = range(0, data.shape[0], batch_size)
            for start in tqdm(starts, desc="recording block inputs", unit="batch", disable=not progress, leave=False):
                out.calls.append([])
                out._memo.clear()
                order.clear()
                try:
                    forward_backbone(model, data[start : start + batch_size], batch_size, progress=False)
                except _Recorded:
                    pass
                previous[0] = None
                if order != list(range(last + 1)) or not chain[0]:
                    return None
        finally:
            for handle in handles:
                handle.remove()
            out._memo.clear()
        return out

    def _call(self, index: int, arguments: tuple, positional: bool) -> _Call:
        """Block ``index``'s arguments of this batch. A tensor equal to the one in its place in the
        previous batch's call is that tensor (shared); in the first batch each stays where it is;
        later ones that differ (per-batch arguments) wait in ``store``. A tensor that several
        blocks of the batch take is kept once."""
        leaves, spec = pytree.tree_flatten(arguments)
        first = len(self.calls) == 1
        before = None if first else self.calls[-2][index]
        kept = before.leaves if before is not None and before.spec == spec else [None] * len(leaves)
        for j, (leaf, earlier) in enumerate(zip(leaves, kept)):
            if not isinstance(leaf, torch.Tensor):
                continue
            if id(leaf) in self._memo:  # taken by an earlier block of this batch
                leaves[j] = self._memo[id(leaf)][1]
                continue
            if _same(earlier, leaf):
                kept_as = earlier
            elif first or leaf.device == self.store:
                kept_as = leaf
            else:
                kept_as = _Stored(leaf.detach().to(self.store), leaf.device)
            self._memo[id(leaf)] = (leaf, kept_as)  # the argument stays referenced: its id is not reused
            leaves[j] = kept_as
        return _Call(leaves, spec, positional)

    @torch.no_grad()
    def run(self, index: int, keep: bool = True, each_batch=None) -> None:
        """Run block ``index`` (the next one) on every batch; ``keep``: its outputs become the hidden
        states and its arguments are dropped (else both stay, for a pass that only records what
        enters its layers); ``each_batch()`` is called after each batch."""
        if index != self.step:
            raise ValueError(f"block {index} cannot run before block {self.step}: the hidden states are those "
                             f"entering block {self.step}")
        block = self.blocks[index]
        for b, x in enumerate(self.hidden):
            call = self.calls[b][index]
            x = x.to(self.device, copy=not keep)  # a block may edit its input in place
            args, kwargs = call.arguments()
            output = block(x, *args, **kwargs) if call.positional else block(*args, hidden_states=x, **kwargs)
            if keep:
                self.hidden[b] = hidden_state(output).detach().to(self.store)
                self.calls[b][index] = None
            if each_batch is not None:
                each_batch()
        if keep:
            self.step += 1

    def release(self) -> None:
        """Drop the hidden states and arguments (the caller is done with the blocks)."""
        self.hidden.clear()
        self.calls.clear()
