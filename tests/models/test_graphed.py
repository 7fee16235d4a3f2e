"""``quantkit.graphed``: per-signature capture, static inputs, output cloning, eviction, refusals.

CUDA graphs need a GPU; on the CPU the wrapper runs against a stand-in for torch.cuda's three
graph calls whose "replay" re-runs the captured forward on the static input buffers and writes
the result into the captured output tensors, as a real replay does. What is tested is the
wrapper's own logic: which call captures, that later calls see their own inputs, that returned
tensors survive the next call (or not, with clone_outputs=False). The real capture is checked
on the GPU by benchmarks/e2e.py (``graphed_logits_equal``: replayed logits == eager logits).
"""

import copy

import pytest
import torch
from transformers import DynamicCache
from torch.utils._pytree import tree_flatten

import quantkit
from quantkit.config import QuantConfig
from quantkit.models.fast_path import optimize
from quantkit.models.graphed import GraphedForward, graphed
from tests.models.test_fast_path import make_tiny


class _StandInGraph:
    def __init__(self, forward):
        self.forward = forward
        self.output = forward()


class StandInGraphs:
    """Replays by re-running the forward and copying its tensors into the captured ones."""

    def __init__(self):
        self.warm_ups = 0

    def pool(self):
        return object()

    def warm_up(self, forward):
        self.warm_ups += 1
        forward()

    def capture(self, forward, pool):
        graph = _StandInGraph(forward)
        return graph, graph.output

    def replay(self, graph):
        fresh = graph.forward()
        for target, value in zip(tree_flatten(graph.output)[0], tree_flatten(fresh)[0]):
            if isinstance(target, torch.Tensor):
                target.copy_(value)


def _wrapper(model, **kwargs):
    api = StandInGraphs()
    return GraphedForward(model, _graphs=api, **kwargs), api


@pytest.fixture(scope="module")
def fast_model():
    model = quantkit.quantize(make_tiny("llama"), QuantConfig.preset("int8"), progress=False)
    return optimize(model, exact=False)


def _eager(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, use_cache=False, **kwargs).logits


def test_replays_see_their_own_inputs(fast_model):
    forward, api = _wrapper(fast_model)
    torch.manual_seed(1)
    first, second = (torch.randint(0, 160, (2, 13)) for _ in range(2))
    out1 = forward(first).logits
    out2 = forward(second, use_cache=False).logits  # use_cache=False is the default: same signature
    assert forward.stats["captures"] == 1 and forward.stats["replays"] == 2 and api.warm_ups == 1
    assert torch.equal(out1, _eager(fast_model, first))
    assert torch.equal(out2, _eager(fast_model, second))
    assert not torch.equal(out1, out2)


def test_new_signature_captures_again(fast_model):
    forward, _ = _wrapper(fast_model)
    ids = torch.randint(0, 160, (1, 7))
    forward(ids)
    forward(ids, logits_to_keep=1)        # a different value is a different signature
    forward(torch.randint(0, 160, (1, 9)))
    forward(ids.to(torch.int32))            # and a different dtype
    assert forward.stats["captures"] == 4 and len(forward) == 4
    assert torch.equal(forward(ids, logits_to_keep=1).logits, _eager(fast_model, ids, logits_to_keep=1))
    assert forward.stats["captures"] == 4


def test_outputs_cloned_or_shared(fast_model):
    cloned, _ = _wrapper(fast_model)
    shared, _ = _wrapper(fast_model, clone_outputs=False)
    a, b = torch.randint(0, 160, (1, 11)), torch.randint(0, 160, (1, 11))
    kept = cloned(a).logits
    cloned(b)
    assert torch.equal(kept, _eager(fast_model, a))
    view = shared(a).logits
    again = shared(b).logits
    assert again is view and torch.equal(view, _eager(fast_model, b))


def test_least_recently_used_is_evicted(fast_model):
    forward, _ = _wrapper(fast_model, max_graphs=2)
    x, y, z = (torch.randint(0, 160, (1, n)) for n in (5, 6, 7))
    forward(x)
    forward(y)
    forward(x)             # x is now the most recent
    forward(z)             # evicts y
    assert forward.stats["evictions"] == 1 and len(forward) == 2
    forward(x)
    assert forward.stats["captures"] == 3
    forward(y)
    assert forward.stats["captures"] == 4


def test_refusals(fast_model):
    forward, _ = _wrapper(fast_model)
    ids = torch.randint(0, 160, (1, 5))
    with pytest.raises(ValueError, match="use_cache=False"):
        forward(ids, use_cache=True)
    with pytest.raises(ValueError, match="past_key_values"):
        forward(ids, past_key_values=object())
    with pytest.raises(ValueError, match="KV cache"):
        forward(ids, None, None, DynamicCache())  # LlamaForCausalLM's 4th parameter, by position
    with pytest.raises(ValueError, match="not hashable"):
        forward(ids, labels={1, 2})
    with pytest.raises(ValueError, match="require grad"):
        forward(inputs_embeds=torch.randn(1, 5, 128, requires_grad=True))
    with pytest.raises(ValueError, match="max_graphs=0"):
        GraphedForward(fast_model, max_graphs=0, _graphs=StandInGraphs())
    fast_model.train()
    try:
        with pytest.raises(ValueError, match="eval"):
            forward(ids)
    finally:
        fast_model.eval()
    assert forward.stats["captures"] == 0


def test_use_cache_none_builds_no_cache(fast_model):
    # None is HF's default and means the config's use_cache (True): the captured forward built a
    # DynamicCache, and every call returned that same object of graph-pool tensors.
    forward, _ = _wrapper(fast_model)
    out = forward(torch.randint(0, 160, (1, 7)), use_cache=None)
    assert out.past_key_values is None



def test_needs_cuda_model():
    with pytest.raises(ValueError, match="CUDA device"):
        graphed(make_tiny("llama"))
    with pytest.raises(ValueError, match="CUDA device"):
        quantkit.graphed(make_tiny("llama"))


def test_perplexity_cuda_graph_needs_cuda():
    tokens = torch.randint(3, 160, (40,))
    with pytest.raises(ValueError, match="CUDA device"):
        quantkit.evaluate_perplexity(make_tiny("llama"), tokens, window=16, cuda_graph=True, progress=False)


def test_deferred_norm_outputs_are_computed_inside_the_capture(fast_model):
    # A base model's last_hidden_state is the final norm's deferred output: nothing in the forward
    # reads it. Each replay must return the norm of its own input, not the first call's.
    from quantkit.models.fast_norm import NormOutput, plain_tensor

    base = copy.deepcopy(fast_model.model)  # a norm that has never been read: still deferring
    forward, _ = _wrapper(base)
    x, y = torch.randint(0, 160, (1, 9)), torch.randint(0, 160, (1, 9))
    got_x = forward(x).last_hidden_state
    # What a real replay rewrites are the captured output's buffers: they must be plain tensors
    # computed by the captured forward, not a deferred norm that Python computes on first read.
    (entry,) = forward._entries.values()
    assert not any(isinstance(leaf, NormOutput) for leaf in tree_flatten(entry.output)[0])
    got_y = forward(y).last_hidden_state
    with torch.no_grad():
        expected_x = plain_tensor(base(x, use_cache=False).last_hidden_state)
        expected_y = plain_tensor(base(y, use_cache=False).last_hidden_state)
    assert torch.equal(got_x, expected_x) and torch.equal(got_y, expected_y)


def test_a_refused_capture_keeps_the_graphs_there_were(fast_model):
    forward, api = _wrapper(fast_model, max_graphs=1)
    x = torch.randint(0, 160, (1, 5))
    forward(x)
    capture = api.capture

    def refuse(fn, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    api.capture = refuse
    with pytest.raises(ValueError, match="cannot be captured as a CUDA graph .*operation not permitted"):
        forward(torch.randint(0, 160, (1, 6)))
    api.capture = capture
    assert len(forward) == 1 and forward.stats["evictions"] == 0
    forward(x)
    assert forward.stats["captures"] == 1
