"""Greedy or sampled generation over a static KV cache, with the decode step captured as a CUDA graph.

    from quantkit.generate import generate
    tokens = generate(model, prompt_ids, max_new_tokens=64)     # (B, S + n) like model.generate
    tokens = generate(model, prompt_ids, 64, do_sample=True, temperature=0.8, top_p=0.95,
                      generator=torch.Generator("cuda").manual_seed(0))

Why its own loop: each eager Triton launch costs ~50 us of host time (benchmarks/NOTES-gemm.md),
so a decode step of a few hundred launches is launch-bound unless it replays as one graph. A graph
needs fixed shapes and addresses: the KV cache is allocated once at its full capacity, and the
step's inputs (token, position, write slot, valid lengths) live in buffers that the captured step
itself advances, so the host only calls ``replay()``.

Attention runs through ``fast_attention``'s "quantkit_static" function for the duration of the
call (the model's own attention implementation is restored afterwards): prefill is causal flash
attention over the first S slots, decode is split-KV attention over the whole buffer with the
valid lengths read from a device tensor. The output equals ``model.generate(do_sample=False)``
(same stopping and padding rules) up to the attention kernels' float rounding.

Sampling draws every step's uniform number before the loop (one per row and step, from the
caller's generator) and picks a token by the inverse CDF of the filtered distribution, so the
captured step holds no random-number state and consumes the same numbers as eager decoding.
Temperature, top-k and top-p filter the logits as transformers' warpers of the same names do.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import time
from dataclasses import dataclass

import torch
from torch import nn

from quantkit import logits_rules
from quantkit.kernels.attention_ops import write_kv_cache
from quantkit.kernels.launch import side_stream
from quantkit.kernels.ops import resolve_backend
from quantkit.models.fast_attention import padded_head_dim, register_static_cache_attention
from quantkit.models.experts import routes_on_host
from quantkit.nn import QuantLinear

_FROM_MODEL = object()


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn from one step's logits: softmax(logits / temperature), restricted to the
    top_k most likely tokens (ties with the k-th kept) and then to the smallest set of most likely
    tokens whose probability reaches top_p, renormalized."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number > 0 "
                             "(for greedy decoding leave do_sample off)")
        if self.top_k is not None and _as_int(self.top_k, "top_k") < 1:
            raise ValueError(f"top_k={self.top_k!r} must be >= 1 (or None for no top-k filter)")
        if self.top_p is not None and (not _is_number(self.top_p) or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must lie in (0, 1] (or None for no top-p filter)")

    @classmethod
    def of(cls, temperature=None, top_k=None, top_p=None) -> "Sampling":
        """From user values: numpy and 0-d tensor numbers taken as Python ones, None as the default."""
        return cls(1.0 if temperature is None else _as_number(temperature, "temperature"),
                   None if top_k is None else _as_int(top_k, "top_k"),
                   None if top_p is None else _as_number(top_p, "top_p"))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits -> (B, V) float32 probabilities of the filtered distribution."""
        scores = self._scaled_top_k(logits)
        if not self._top_p_active:
            return scores.softmax(dim=-1)
        ranked, order = torch.sort(scores, dim=-1, descending=True)
        kept = self._top_p(ranked.softmax(dim=-1))
        return torch.zeros_like(kept).scatter_(1, order, kept / kept.sum(dim=-1, keepdim=True))

    def choose(self, logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        """One token per row: the first whose cumulative probability exceeds ``uniform`` (B,) in [0, 1).
        A token of probability 0 is never chosen. With top-p the tokens are walked in the order of
        the sort that top-p needs anyway, which spares a scatter and a second softmax."""
        scores = self._scaled_top_k(logits)
        order = None
        if self._top_p_active:
            scores, order = torch.sort(scores, dim=-1, descending=True)
            probs = self._top_p(scores.softmax(dim=-1))
        else:
            probs = scores.softmax(dim=-1)
        cdf = row_cumsum(probs.double()).contiguous()  # a view past a partial last block otherwise
        target = (uniform.double() * cdf[:, -1])[:, None]
        index = torch.searchsorted(cdf, target, right=True).clamp_max(cdf.shape[-1] - 1)
        # A parallel scan's rounding can leave a step where a zero-probability token sits (about
        # 1e-16 of the mass): landing there takes the most likely token instead.
        likeliest = torch.zeros_like(index) if order is not None else probs.argmax(dim=-1, keepdim=True)
        index = torch.where(probs.gather(1, index) > 0, index, likeliest)
        return (index if order is None else order.gather(1, index))[:, 0]

    @property
    def _top_p_active(self) -> bool:
        return self.top_p is not None and self.top_p < 1

    def _scaled_top_k(self, logits: torch.Tensor) -> torch.Tensor:
        # Shifted so the largest score is 0 before the division: a tiny temperature then sends the
        # others to -inf (greedy among ties), not every score to +-inf and the softmax to NaN.
        scores = logits.float()
        scores = (scores - scores.amax(dim=-1, keepdim=True)) / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        return scores

    def _top_p(self, ranked_probs: torch.Tensor) -> torch.Tensor:
        """Probabilities in descending order with those past the top-p cut set to 0: a token stays
        while the tokens ranked above it hold less than top_p (so the first always does)."""
        above = row_cumsum(ranked_probs) - ranked_probs
        return ranked_probs.masked_fill(above >= self.top_p, 0.0)


_SCAN_BLOCK = 1024


def row_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(dim=-1)`` of a (B, V) tensor, for B > 1 in two levels: within blocks of 1024, then
    over the blocks' totals. torch scans several long rows one block of threads per row (H100, B = 8,
    V = 262,144: 444 us in float64); B x V/1024 short rows and B rows of V/1024 totals take 77 us.
    A single row torch scans device-wide (6 us), so it stays torch's (benchmarks/sampling_ops.py).
    Sums differ from a sequential scan's by rounding only."""
    rows, length = x.shape
    if rows == 1 or length <= _SCAN_BLOCK:
        return x.cumsum(dim=-1)
    padded = torch.nn.functional.pad(x, (0, -length % _SCAN_BLOCK)).view(rows, -1, _SCAN_BLOCK)
    inner = padded.cumsum(dim=-1)
    # Each block starts from the running total through the block before (0 for the first), not
    # from total - own block: that difference can land an ulp above where the last block ended.
    ends = inner[..., -1].cumsum(dim=-1)
    starts = torch.nn.functional.pad(ends[:, :-1], (1, 0))
    return (inner + starts[..., None]).view(rows, -1)[:, :length]


class StaticKVCache:
    """Per-layer (B, Hkv, capacity, D) key/value buffers written at ``write_positions``; D is the
    model's head_dim rounded up to a size the attention kernels take (``padded_head_dim``).

    Implements the part of transformers' Cache interface that decoder models call during a
    forward pass (``update``, ``get_seq_length``). Buffers are allocated on first write, with the
    shape and dtype of the keys the layer produces. ``write_positions`` is a device tensor of slot
    indices owned by the caller (the generation loop advances it inside the captured step).
    ``backend`` writes both buffers in one launch ("triton", ``attention_ops.write_kv_cache``) or
    with two ``index_copy_`` calls ("torch").
    """

    def __init__(self, capacity: int, backend: str = "torch") -> None:
        self.capacity = capacity
        self.backend = backend
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.write_positions: torch.Tensor | None = None
        self.seen_tokens = 0  # host-side count, only for callers that derive positions from it

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        head_dim = key_states.shape[-1]
        if layer_idx not in self.keys:
            if value_states.shape[-1] != head_dim:
                raise ValueError(f"quantkit.generate needs values as wide as keys (k head_dim {head_dim}, v "
                                 f"{value_states.shape[-1]}); generate with model.generate instead")
            batch, heads = key_states.shape[:2]
            # At the head size the attention kernels run (zero columns past head_dim), so that
            # decode reads the buffer as it is instead of padding a copy of it every step.
            shape = (batch, heads, self.capacity, padded_head_dim(head_dim))
            self.keys[layer_idx] = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=value_states.dtype, device=value_states.device)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        write_kv_cache(key_states, value_states, keys, values, self.write_positions, backend=self.backend)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_number(value, name: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() == 0:
        value = value.item()
    if not _is_number(value):
        raise TypeError(f"{name}={value!r} must be a number")
    return float(value)


def _attention_backend(model: nn.Module, device: torch.device) -> str:
    for module in model.modules():
        if isinstance(module, QuantLinear):
            return module.backend
    return resolve_backend("auto", device)


def _as_batch(input_ids, vocab_size: int | None) -> torch.Tensor:
    if isinstance(input_ids, str):
        raise TypeError("input_ids is a string; tokenize it first: tokenizer(text, return_tensors='pt').input_ids")
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids
    else:
        try:
            ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"prompt ids must be a (batch, seq) integer tensor or nested lists of equal "
                             f"length ({exc})") from exc
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"prompt ids must be a non-empty (batch, seq) integer tensor; got {ids.dtype} {tuple(ids.shape)}")
    if vocab_size is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"prompt ids must lie in [0, {vocab_size}) (the model's vocabulary); got "
                         f"{int(ids.min())}..{int(ids.max())}")
    return ids.long()


def _as_int(value, name: str) -> int:
    """``value`` as a Python int: ints, numpy integers and 0-d integer tensors; TypeError otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int") from None


def _eos_ids(model: nn.Module, eos_token_id) -> list[int]:
    if eos_token_id is _FROM_MODEL:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    if hasattr(eos_token_id, "tolist"):  # a tensor or numpy array (or scalar) of ids
        eos_token_id = eos_token_id.tolist()
    if isinstance(eos_token_id, (str, bytes)) or not hasattr(eos_token_id, "__iter__"):
        return [_as_int(eos_token_id, "eos_token_id")]
    return [_as_int(t, "eos_token_id") for t in eos_token_id]


def check_lengths(model: nn.Module, prompt_len: int, max_new_tokens: int, cache_capacity: int | None) -> int:
    """Validate lengths (and head_dim) before any device work; return the cache capacity to allocate."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: ask for at least one new token")
    total = prompt_len + max_new_tokens
    capacity = total if cache_capacity is None else _as_int(cache_capacity, "cache_capacity")
    if total > capacity:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} does not fit the static "
            f"cache of {capacity} tokens; pass cache_capacity >= {total} or generate fewer tokens"
        )
    config = model.config
    padded_head_dim(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and total > context:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the model's "
            f"context of {context} tokens; shorten the prompt or generate at most {max(context - prompt_len, 0)}"
        )
    return capacity


@torch.no_grad()
def generate(
    model: nn.Module,
    input_ids,
    max_new_tokens: int,
    eos_token_id=_FROM_MODEL,
    pad_token_id: int | None = None,
    cache_capacity: int | None = None,
    cuda_graph: bool | None = None,
    stats: dict | None = None,
    attention_mask=None,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    repetition_penalty: float | None = None,
    min_new_tokens: int | None = None,
) -> torch.Tensor:
    """Greedy decoding (or sampling); returns (B, S + n) token ids, prompt included, as
    ``model.generate`` with ``do_sample=False`` does, with the generation config's repetition
    penalty, minimum lengths, repeated n-grams, bad words, forced BOS / EOS and suppressed tokens
    applied as it applies them (``logits_rules``); sequence_bias and the other rules it does not
    apply are named in a warning.

    input_ids: (B, S) or (S,) token ids (or lists) of an unpadded batch (equal lengths).
    attention_mask: optional; all ones (an unpadded batch), as padding is refused.
    eos_token_id: int, list or None; defaults to the model's generation_config. A sequence that
        has finished continues with ``pad_token_id`` (default: the generation_config's pad id, else
        the first eos id, as ``model.generate`` does), and generation stops once all have finished.
        A padded batch is refused, its pads would be attended: a mask with a zero, a prompt holding a
        pad id that is not an eos id, or (batch > 1) rows that start with the pad id or not all end
        with it.
    cache_capacity: slots of the static KV cache (default: S + max_new_tokens).
    cuda_graph: capture the decode step (default: on when the model is on CUDA, unless its mixture of
        experts routes on the host: quantized experts decode eagerly).
    stats: if a dict is given, it receives prefill_s, decode_s, decode_steps, capture_s
        (host clocks around device-synchronized regions).
    do_sample: draw each token from the model's distribution instead of taking the argmax, filtered
        by ``temperature`` (default 1.0), ``top_k`` and ``top_p`` (default: no filter). These come
        from the arguments only, never from the generation config, and are refused without do_sample.
    generator: a torch.Generator (on the CPU or the model's device) that makes the samples
        reproducible; default: torch's global generator of the model's device. The captured and
        the eager decode step consume the same uniform numbers.
    repetition_penalty: > 0; every token already in a row (prompt or generated) has its logit
        divided by it where positive and multiplied where negative before the choice, as
        transformers' RepetitionPenaltyLogitsProcessor does (1.0: off). Default: the generation
        config's, as ``model.generate`` takes it.
    min_new_tokens: no eos token before this many new tokens (default: the generation config's);
        as in transformers, any value (0 included) replaces the generation config's min_length.
    """
    ids = _as_batch(input_ids, getattr(model.config, "vocab_size", None))
    batch, prompt_len = ids.shape
    max_new_tokens = _as_int(max_new_tokens, "max_new_tokens")
    capacity = check_lengths(model, prompt_len, max_new_tokens, cache_capacity)
    eos = _eos_ids(model, eos_token_id)
    if pad_token_id is not None:
        pad_token_id = _as_int(pad_token_id, "pad_token_id")
    generation_config = getattr(model, "generation_config", None)
    config_pad = getattr(generation_config, "pad_token_id", None)
    _refuse_padding(ids, attention_mask, pad_token_id if pad_token_id is not None else config_pad, eos)
    if pad_token_id is None:
        pad_token_id = config_pad if isinstance(config_pad, int) else eos[0] if eos else 0
    sampling = _sampling(do_sample, temperature, top_k, top_p, generator)
    penalty = _repetition_penalty(repetition_penalty, generation_config)
    device = next(model.parameters()).device
    rules = logits_rules.build(generation_config, min_new_tokens, eos, prompt_len, max_new_tokens,
                               _logits_width(model), device)
    use_graph = device.type == "cuda" and not routes_on_host(model) if cuda_graph is None else cuda_graph
    if use_graph and routes_on_host(model):
        raise ValueError("cuda_graph=True cannot capture this model's mixture of experts (its routing runs on the "
                         "host); decode with cuda_graph=False")
    if use_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a model on CUDA (it is on {device})")

    previous_attention = model.config._attn_implementation
    backend = _attention_backend(model, device)
    model.set_attn_implementation(register_static_cache_attention(backend, device, model=model))
    try:
        uniforms = None
        if sampling is not None:
            # Every step's uniform number up front: the captured step then holds no RNG state.
            uniforms = torch.rand((max_new_tokens, batch), generator=generator, dtype=torch.float64,
                                  device=generator.device if generator is not None else device).to(device)
        # The model's GPU current throughout: torch.cuda.graph captures on, and a graph replays on,
        # the current GPU's streams, and the kernels launch there.
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return _generate(model, ids.to(device), max_new_tokens, eos, pad_token_id, capacity, use_graph, stats,
                             sampling, uniforms, backend, penalty, rules)
    finally:
        model.set_attn_implementation(previous_attention)


def _sampling(do_sample: bool, temperature, top_k, top_p, generator) -> Sampling | None:
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample={do_sample!r} must be True or False")
    if not do_sample:
        given = [f"{name}={value!r}" for name, value in
                 (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("generator", generator))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only applies when sampling; pass do_sample=True (or drop it "
                             "for greedy decoding)")
        return None
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator={generator!r} must be a torch.Generator")
    return Sampling.of(temperature, top_k, top_p)


def _repetition_penalty(value, generation_config) -> float | None:
    """The penalty to apply (None: off): the argument, else the generation config's."""
    origin = "repetition_penalty"
    if value is None:
        value = getattr(generation_config, "repetition_penalty", None)
        if value is None:
            return None
        origin = "the generation config's repetition_penalty"
    value = _as_number(value, origin)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{origin}={value!r} must be a finite number > 0 (1.0: no penalty; above 1 discourages "
                         "repeats)")
    return None if value == 1.0 else value


def _penalize(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Each row's scores of the tokens it has seen divided by ``penalty`` where positive, multiplied
    where negative (transformers' RepetitionPenaltyLogitsProcessor, on a (B, V) mask of seen tokens:
    fixed shapes, so the captured decode step holds it)."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def _refuse_padding(ids: torch.Tensor, attention_mask, pad, eos: list[int]) -> None:
    padded = ("a padded batch (its pads would be attended as text); pass prompts of equal length unpadded, "
              "or one prompt per call")
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask)
        if mask.numel() != ids.numel():
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} for prompt ids of shape {tuple(ids.shape)}")
        if not bool((mask != 0).all()):
            raise ValueError(f"attention_mask holds zeros: {padded}")
    if not isinstance(pad, int):
        return
    if pad not in eos and bool((ids == pad).any()):
        raise ValueError(f"the prompt holds the pad token id {pad}: {padded}")
    if ids.shape[0] > 1:
        ends = ids[:, -1] == pad
        if bool((ids[:, 0] == pad).any()) or (bool(ends.any()) and not bool(ends.all())):
            raise ValueError(f"rows of the prompt start or end with the pad token id {pad}: {padded}")


def _logits_width(model: nn.Module) -> int:
    """The width of the model's logits: its output layer's, else the config's vocabulary."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    width = getattr(head, "out_features", None)
    return width if isinstance(width, int) else model.config.vocab_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, ids, max_new_tokens, eos, pad_token_id, capacity, use_graph, stats, sampling, uniforms,
              backend: str, penalty=None, rules: logits_rules.LogitsRules | None = None):
    device = ids.device
    batch, prompt_len = ids.shape
    cache = StaticKVCache(capacity, backend=backend)
    eos_tensor = torch.tensor(eos, dtype=torch.long, device=device)
    history = None  # (B, S + n): the prompt and the generated tokens, for rules that match patterns
    if rules is not None and rules.needs_history:
        history = torch.full((batch, prompt_len + max_new_tokens), pad_token_id, dtype=torch.long, device=device)
        history[:, :prompt_len] = ids
        out = history[:, prompt_len:]  # a view: the tokens written to out extend the history
    else:
        out = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    seen = None  # (B, V): the tokens each row holds, for the repetition penalty

    def pick(logits: torch.Tensor, step_index: torch.Tensor) -> torch.Tensor:
        # Greedy (or sampled) choice on fp32 logits (penalized first, as model.generate's logits
        # processors run before its sampling warpers), then model.generate's rule for finished rows.
        scores = logits[:, -1].float()
        if seen is not None:
            scores = _penalize(scores, seen, penalty)
        if rules is not None:
            scores = rules.apply(scores, step_index, history)
        if sampling is None:
            token = scores.argmax(dim=-1)
        else:
            token = sampling.choose(scores, uniforms.index_select(0, step_index)[0])
        if eos:
            token = torch.where(finished, torch.full_like(token, pad_token_id), token)
            finished.logical_or_((token[:, None] == eos_tensor).any(dim=1))
        if seen is not None:  # model.generate appends a finished row's pad too, and penalizes it
            seen.scatter_(1, token[:, None], True)
        return token

    _sync(device)
    start = time.perf_counter()
    cache.write_positions = torch.arange(prompt_len, device=device)
    positions = torch.arange(prompt_len, device=device)[None]
    # A one-token prompt is a query of length 1, which the attention takes for a decode step: it
    # needs the valid lengths as a decode step does.
    prefill_seqlens = torch.full((batch,), prompt_len, dtype=torch.int32, device=device)
    logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                   logits_to_keep=1, quantkit_kv_len=prompt_len, quantkit_cache_seqlens=prefill_seqlens).logits
    if penalty is not None:
        seen = torch.zeros(batch, logits.shape[-1], dtype=torch.bool, device=device).scatter_(1, ids, True)
    out[:, 0] = pick(logits, torch.zeros(1, dtype=torch.long, device=device))
    cache.seen_tokens = prompt_len
    _sync(device)
    prefill_s = time.perf_counter() - start

    # Decode state, advanced by the step itself so that a captured step replays without host work.
    token = out[:, :1].clone()
    position = torch.full((1, 1), prompt_len, dtype=torch.long, device=device)
    write_slot = torch.full((1,), prompt_len, dtype=torch.long, device=device)
    seqlens = torch.full((batch,), prompt_len + 1, dtype=torch.int32, device=device)
    out_index = torch.ones(1, dtype=torch.long, device=device)
    cache.write_positions = write_slot
    state = (token, position, write_slot, seqlens, out_index, finished) + ((seen,) if seen is not None else ())

    def step() -> None:
        logits = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True,
                       logits_to_keep=1, quantkit_kv_len=capacity, quantkit_cache_seqlens=seqlens).logits
        chosen = pick(logits, out_index)
        out.index_copy_(1, out_index, chosen[:, None])
        token.copy_(chosen[:, None])
        for counter in (position, write_slot, seqlens, out_index):
            counter.add_(1)

    steps = max_new_tokens - 1
    capture_s = 0.0
    run_step = step
    if use_graph and steps > 0:
        _sync(device)
        start = time.perf_counter()
        saved = [t.clone() for t in state]
        side = side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()  # compiles and autotunes every kernel outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        for buffer, value in zip(state, saved):
            buffer.copy_(value)
        graph = torch.cuda.CUDAGraph()
        # On a stream of the model's GPU: torch.cuda.graph's default capture stream is one stream
        # for the whole process, made on whichever GPU was current at its first capture.
        with torch.cuda.graph(graph, stream=side):
            step()
        _sync(device)
        capture_s = time.perf_counter() - start
        run_step = graph.replay

    # How often the host checks whether every row has finished (a check is a device sync).
    check_every = 1 if not use_graph else 16
    _sync(device)
    start = time.perf_counter()
    done = 0
    all_finished = bool(eos) and bool(finished.all())
    while done < steps and not all_finished:
        run_step()
        done += 1
        if eos and done % check_every == 0:
            all_finished = bool(finished.all())
    _sync(device)
    decode_s = time.perf_counter() - start
    if stats is not None:
        stats.update(prefill_s=prefill_s, decode_s=decode_s, decode_steps=done, capture_s=capture_s)

    generated = out[:, : done + 1]
    if eos:
        # model.generate stops at the step where the last row finished: cut there.
        is_eos = torch.isin(generated, eos_tensor)
        first = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), generated.shape[1] - 1)
        generated = generated[:, : int(first.max()) + 1]
    return torch.cat([ids, generated], dim=1)
