"""Sliding-window perplexity: every token is scored once, with up to ``window`` tokens of context.

Each window starts with the BOS token when the model has one, as every real prompt does: models
such as Gemma put an attention sink on their first position and predict far worse when a
window starts mid-text (Gemma-3-270M: perplexity 59 instead of 25 at window 512).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from sys import float_info

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from quantkit.models.graphed import graphed


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    window: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


def window_spans(n_tokens: int, span: int, context: int, first_scorable: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window of at most ``span`` tokens of the stream.

    The scored ranges [first_scored, end) tile [first_scorable, n_tokens) exactly once; each window
    reaches back ``context`` tokens before its first scored token (fewer at the start).
    """
    if span < 1:
        raise ValueError(f"window={span} is too small")
    if not 0 <= context < span:
        raise ValueError(f"stride must leave room for new tokens: context={context}, window={span}")
    if n_tokens <= first_scorable:
        raise ValueError(f"{n_tokens} tokens cannot be scored; perplexity needs at least {first_scorable + 1}")
    spans, scored_up_to = [], first_scorable
    while scored_up_to < n_tokens:
        begin = max(0, scored_up_to - context)
        end = min(begin + span, n_tokens)
        spans.append((begin, end, scored_up_to))
        scored_up_to = end
    return spans


@torch.no_grad()
def evaluate_perplexity(
    model: nn.Module,
    tokens: torch.Tensor,
    window: int = 1024,
    stride: int | None = None,
    bos_token_id: int | None = None,
    progress: bool = True,
    desc: str = "perplexity",
    cuda_graph: bool = False,
) -> PerplexityResult:
    """Perplexity of ``model`` on a 1-D token stream.

    Windows hold ``window`` tokens (BOS included when ``bos_token_id`` is given) and advance by
    ``stride`` new tokens (default: ``window``, i.e. independent windows; with BOS a window scores
    at most ``window - 1``); with a smaller stride each window re-reads the tokens before its new
    ones, which earlier windows scored, as context. ``tokens`` is one 1-D stream.
    cuda_graph: replay each window's forward as a CUDA graph (``quantkit.graphed``; CUDA models
    only). Windows share one shape, so one capture (two with a shorter last window) serves them
    all; the logits are the eager forward's bit for bit, without its per-launch host time.
    """
    stride = window if stride is None else stride
    if window < 2 or not 0 < stride <= window:
        raise ValueError(f"window={window} must be >= 2 and stride={stride} in [1, window]")
    context_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if context_length is not None and window > context_length:
        raise ValueError(f"window={window} exceeds the model's context of {context_length} tokens; "
                         f"use a window of at most {context_length}")
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int64, torch.int32):
        kind = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"tokens are {kind}; pass token ids as an integer tensor "
                         "(quantkit.prepare_evaluation_tokens returns one)")
    tokens = tokens.long()  # cross_entropy takes int64 targets
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be one 1-D stream, got shape {tuple(tokens.shape)}; "
                         "pass tokens.reshape(-1) if its rows are one text")
    prefix = None
    if bos_token_id is not None:
        if tokens.numel() and tokens[0].item() == bos_token_id:
            tokens = tokens[1:]
        prefix = torch.tensor([bos_token_id], dtype=tokens.dtype, device=tokens.device)
        # With BOS in front, a window's first token can be scored: it is conditioned on BOS. BOS
        # takes one of the window's slots, so a window scores min(stride, window - 1) new tokens.
        spans = window_spans(tokens.numel(), window - 1, max(0, min(window - 1 - stride, window - 2)), 0)
    else:
        spans = window_spans(tokens.numel(), window, max(window - stride, 1), 1)
    device = next(model.parameters()).device
    forward = graphed(model, max_graphs=2, clone_outputs=False) if cuda_graph else model
    was_training = model.training
    model.eval()  # scored without dropout; the caller's mode comes back afterwards
    try:
        total_nll, total = _score(forward, tokens, spans, prefix, device, desc, progress)
    finally:
        model.train(was_training)
    nll = total_nll / total
    # exp overflows past ~709 nats per token (a broken model): its perplexity is infinite.
    perplexity = math.exp(nll) if nll < math.log(float_info.max) else math.inf
    return PerplexityResult(perplexity=perplexity, nll=nll, tokens=total, window=window, stride=stride)


def _score(forward, tokens, spans, prefix, device, desc: str, progress: bool) -> tuple[float, int]:
    """Summed NLL and count of the scored tokens over ``spans``."""
    total_nll, total = 0.0, 0
    for begin, end, first_scored in tqdm(spans, desc=desc, unit="window", disable=not progress, leave=False):
        ids = tokens[begin:end]
        offset = 0
        if prefix is not None:
            ids, offset = torch.cat([prefix, ids]), 1
        ids = ids.to(device).unsqueeze(0)
        logits = forward(input_ids=ids, use_cache=False).logits[0].float()
        first = first_scored - begin + offset  # position of the first scored token inside ids
        # logits at position p predict the token at p + 1
        total_nll += F.cross_entropy(logits[first - 1 : -1], ids[0, first:], reduction="sum").item()
        total += ids.shape[1] - first
    return total_nll, total
