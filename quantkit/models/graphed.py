"""A model's stateless forward replayed as CUDA graphs, one per input signature.

    fast = quantkit.graphed(model)                       # model on CUDA, eval mode
    logits = fast(ids, logits_to_keep=1).logits          # first call per shape captures, later calls replay

Why: an eager forward of the fast path issues ~10 Triton launches per decoder layer, each with
25-40 us of Python (benchmarks/NOTES-e2e.md, session 7). At 1x2048 tokens on an 8B model that is
about as long as the GPU work itself, so on a slow host the forward waits on Python. A replay
issues the whole forward in one call. Workloads that repeat a shape get this: scoring fixed-length
windows (perplexity), batched classification, and the prefill benchmark.

What a call does: copy the tensor arguments into the graph's static input buffers, replay, and
return the output with its tensors cloned (``clone_outputs=False`` returns the graph's own
buffers instead, valid until the next call of this wrapper). The result is the eager forward's,
bit for bit: same kernels, same arguments, same launch order. One exception: with an
``attention_mask``, transformers builds an explicit mask while a stream captures, where its eager
forward may take the causal-kernel path for an all-ones mask; the results are then equal up to
the attention kernel's rounding, not bitwise.

Signature = positional and keyword arguments: for a tensor its shape, dtype and device; for
anything else its value (which must be hashable). A new signature is captured after one warm-up
forward on a side stream (Triton compiles and autotunes there, outside the capture). Graphs share
one memory pool; at most ``max_graphs`` are kept (least recently used evicted first).

Stateless only: ``use_cache`` defaults to False here and True, or a ``past_key_values``, is
refused -- a cache object that grows on the host cannot be replayed. Generation has its own
graph-captured decode step (``quantkit.generate``). Inference only: the model must be in eval
mode, and calls run under ``torch.no_grad``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only
from transformers.cache_utils import Cache

from quantkit.kernels.launch import side_stream
from quantkit.models.experts import routes_on_host
from quantkit.models.fast_norm import NormOutput, plain_tensor


@dataclass
class _Entry:
    graph: Any
    inputs: list[torch.Tensor]   # static buffers, in the order of the signature's tensors
    output: Any                  # the captured forward's output (its tensors live in the pool)


class GraphedForward:
    """Callable wrapper; see the module docstring. ``stats`` counts captures, replays and capture time."""

    def __init__(self, model: nn.Module, max_graphs: int = 8, clone_outputs: bool = True, _graphs=None) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs}: keep at least one graph")
        device = _model_device(model)
        if _graphs is None and device.type != "cuda":
            raise ValueError(f"graphed() needs a model on a CUDA device (it is on {device}); move it with model.cuda()")
        if routes_on_host(model):
            raise ValueError("graphed() cannot capture this model's mixture of experts (its routing runs on the host); "
                             "call the model itself")
        self.model = model
        self.device = device
        self.max_graphs = max_graphs
        self.clone_outputs = clone_outputs
        # The graph API: torch.cuda's, or a stand-in with the same three calls (tests on CPU).
        self._api = _graphs or _CudaGraphs(device)
        self._pool = self._api.pool()
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.stats = {"captures": 0, "replays": 0, "evictions": 0, "capture_s": 0.0}

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        if self.model.training:
            raise ValueError("graphed() runs inference only: call model.eval() first")
        if kwargs.get("past_key_values") is not None:
            raise ValueError("graphed() replays a stateless forward: drop past_key_values "
                             "(use quantkit.generate for generation with a KV cache)")
        if kwargs.get("use_cache"):
            raise ValueError("graphed() replays a stateless forward: pass use_cache=False "
                             "(use quantkit.generate for generation with a KV cache)")
        # Set, not defaulted: None (HF's default) means the config's use_cache, which builds a cache.
        kwargs["use_cache"] = False
        key, tensors = self._signature(args, kwargs)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._capture(key, args, kwargs)
        else:
            self._entries.move_to_end(key)
            for buffer, tensor in zip(entry.inputs, tensors):
                buffer.copy_(tensor)
        self._api.replay(entry.graph)
        self.stats["replays"] += 1
        if not self.clone_outputs:
            return entry.output
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, entry.output)

    def reset(self) -> None:
        """Drop every captured graph; the next capture starts a new memory pool."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _signature(self, args, kwargs) -> tuple[tuple, list[torch.Tensor]]:
        leaves, spec = tree_flatten((args, kwargs))
        key, tensors = [repr(spec)], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.device != self.device:
                    raise ValueError(f"graphed(): an input tensor is on {leaf.device}, the model on {self.device}; "
                                     f"move the inputs to {self.device}")
                if leaf.requires_grad:
                    raise ValueError("graphed() runs inference only: pass inputs that do not require grad")
                key.append(("tensor", tuple(leaf.shape), leaf.dtype))
                tensors.append(leaf)
            elif isinstance(leaf, Cache):  # a KV cache passed by position
                raise ValueError("graphed() replays a stateless forward: drop the KV cache argument "
                                 "(use quantkit.generate for generation with a KV cache)")
            else:
                try:
                    hash(leaf)
                except TypeError:
                    raise ValueError(f"graphed(): argument {leaf!r} of type {type(leaf).__name__} is not hashable; "
                                     "pass tensors or plain values") from None
                key.append(("value", type(leaf), leaf))
        return tuple(key), tensors

    @torch.no_grad()
    def _capture(self, key: tuple, args, kwargs) -> _Entry:
        start = time.perf_counter()
        # Static inputs outside the pool: another graph's intermediates must never overlap them.
        static_args, static_kwargs = tree_map(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (args, kwargs))
        inputs = [leaf for leaf in tree_flatten((static_args, static_kwargs))[0] if isinstance(leaf, torch.Tensor)]

        def forward():
            # Deferred norm outputs (fast_norm.NormOutput: e.g. a base model's last_hidden_state,
            # which nothing inside the forward reads) are computed here, inside the capture: left
            # deferred, the first read after a replay would compute them eagerly and cache them,
            # and every later replay would return those values.
            return tree_map_only(NormOutput, plain_tensor, self.model(*static_args, **static_kwargs))

        self._api.warm_up(forward)
        if not self._entries:
            # A pool whose graphs are all gone must not be captured into again (torch's caching
            # allocator asserts on it while a block of it is still alive, e.g. a kept output).
            self._pool = self._api.pool()
        try:
            graph, output = self._api.capture(forward, self._pool)
        except RuntimeError as exc:  # e.g. a forward that reads a device value on the host
            first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"graphed(): this forward cannot be captured as a CUDA graph ({first_line}); "
                             "call the model directly") from exc
        # Evicted only once the new graph exists: a refused capture keeps the graphs there were.
        if len(self._entries) >= self.max_graphs:
            self._entries.popitem(last=False)
            self.stats["evictions"] += 1
        entry = self._entries[key] = _Entry(graph, inputs, output)
        self.stats["captures"] += 1
        self.stats["capture_s"] += time.perf_counter() - start
        return entry


class _CudaGraphs:
    """torch.cuda's graph calls, as GraphedForward uses them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pool(self):
        return torch.cuda.graph_pool_handle()

    def warm_up(self, forward) -> None:
        # On a side stream, as torch's graph docs ask: lazy initialisation (cuBLAS handles,
        # Triton compiles and autotuning) must not happen on the capturing stream.
        side = side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, forward, pool):
        # On a stream of the model's GPU (torch.cuda.graph's default capture stream is one stream
        # for the whole process, made on whichever GPU was current at its first capture), with
        # that GPU current.
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        try:
            with torch.cuda.device(self.device), torch.cuda.graph(graph, pool=pool, stream=side_stream(self.device)):
                output = forward()
        except RuntimeError:
            # A capture that fails inside the forward can leave the capture's side stream current
            # (torch.cuda.graph's exit raises before restoring it): the caller's next eager call
            # must run on its own stream.
            torch.cuda.set_stream(stream)
            raise
        return graph, output

    def replay(self, graph) -> None:
        with torch.cuda.device(self.device):  # on the current stream of the graph's GPU
            graph.replay()


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    raise ValueError("graphed() needs a model with parameters")


def graphed(model: nn.Module, max_graphs: int = 8, clone_outputs: bool = True) -> GraphedForward:
    """Wrap a CUDA model's stateless forward so that repeated input shapes replay a CUDA graph."""
    return GraphedForward(model, max_graphs=max_graphs, clone_outputs=clone_outputs)
