"""The generation config's rules on the logits that ``generate`` applies as ``model.generate`` does.

transformers turns these generation-config fields into logits processors, run in this order after
the repetition penalty and before the sampling warpers; each sets scores to -inf (or forces one):

    no_repeat_ngram_size  ->  bad_words_ids  ->  min_length, min_new_tokens (no eos before)
    ->  forced_bos_token_id, forced_eos_token_id  ->  suppress_tokens  ->  begin_suppress_tokens

``LogitsRules`` holds them as boolean masks over the vocabulary, step numbers and (for n-grams and
bad words of several tokens) token patterns matched against the sequence so far, a (B, L) buffer
of the prompt and the generated tokens. All of it is applied to the (B, V) float32 scores with the
step index as a device tensor: fixed shapes and no host branch, so the captured decode step holds
it. sequence_bias, the encoder rules, exponential_decay_length_penalty, guidance and watermarking
are not applied; ``generate`` names them in a warning.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass

import torch

# Generation-config settings that model.generate applies to the logits and generate does not, with
# the value that means "off" (bad_words_ids: only its multi-token words, see ``build``).
UNAPPLIED = {"sequence_bias": None, "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0,
             "exponential_decay_length_penalty": None, "guidance_scale": 1.0, "watermarking_config": None}


@dataclass
class LogitsRules:
    """Masks (V,) on the scores' device, None where a rule is off; steps count generated tokens."""

    prompt_len: int = 0
    ngram: int = 0  # no_repeat_ngram_size
    # Bad words of several tokens, by length: (prefixes (N, k - 1), last tokens (N,)) long tensors.
    word_groups: tuple = ()
    banned: torch.Tensor | None = None  # one-token bad words: always -inf
    eos: torch.Tensor | None = None  # the eos ids, -inf while step < eos_from
    eos_from: int = 0
    forced_bos: torch.Tensor | None = None  # at step 0 only this token (a one-token prompt)
    forced_eos: torch.Tensor | None = None  # at step forced_eos_at only these tokens
    forced_eos_at: int = -1
    suppressed: torch.Tensor | None = None  # always -inf
    begin_suppressed: torch.Tensor | None = None  # -inf at step begin_at
    begin_at: int = 0

    @property
    def needs_history(self) -> bool:
        return self.ngram > 0 or bool(self.word_groups)

    def apply(self, scores: torch.Tensor, step: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """``scores`` (B, V) float32 at generated-token index ``step`` ((1,) long, on their device);
        ``history`` (B, L): the prompt and the tokens generated so far from column 0 (later
        columns are ignored), needed when ``needs_history``."""
        inf = float("-inf")  # a Python scalar: no host-to-device copy inside a CUDA-graph capture
        length = self.prompt_len + step  # (1,): the sequence's length now
        if self.ngram:
            scores = torch.where(_repeated_ngram_ends(history, length, self.ngram, scores.shape[1]), inf, scores)
        for prefixes, last in self.word_groups:
            scores = torch.where(_completed_words(history, length, prefixes, last, scores.shape[1]), inf, scores)
        if self.banned is not None:
            scores = torch.where(self.banned, inf, scores)
        if self.eos is not None:
            scores = torch.where(self.eos & (step < self.eos_from), inf, scores)
        for forced, at in ((self.forced_bos, 0), (self.forced_eos, self.forced_eos_at)):
            if forced is not None:  # transformers: every score -inf, the forced tokens' 0
                scores = torch.where(step == at, torch.where(forced, 0.0, inf), scores)
        if self.suppressed is not None:
            scores = torch.where(self.suppressed, inf, scores)
        if self.begin_suppressed is not None:
            scores = torch.where(self.begin_suppressed & (step == self.begin_at), inf, scores)
        return scores


def _last_tokens(history: torch.Tensor, length: torch.Tensor, count: int) -> torch.Tensor:
    """(B, count): the last ``count`` tokens of each row of ``history`` cut at ``length``
    (positions before 0 read column 0; callers mask those cases)."""
    index = (length - count + torch.arange(count, device=history.device)).clamp_min(0)
    return history.index_select(1, index)


def _scatter_mask(rows: int, vocab: int, tokens: torch.Tensor, hit: torch.Tensor) -> torch.Tensor:
    """(rows, vocab) bool, True at ``tokens`` (rows, N) where ``hit``: misses go to a spare column
    (a False scattered after a True at one token would clear it)."""
    mask = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=tokens.device)
    mask.scatter_(1, torch.where(hit, tokens.clamp(0, vocab), vocab), True)
    return mask[:, :vocab]


def _repeated_ngram_ends(history: torch.Tensor, length: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """(B, V): the tokens that would repeat an n-gram of the sequence (transformers'
    NoRepeatNGramLogitsProcessor): every complete window whose first n - 1 tokens equal the
    sequence's last n - 1 bans its last token."""
    if n > history.shape[1]:  # longer than any sequence this call makes
        return torch.zeros(history.shape[0], vocab, dtype=torch.bool, device=history.device)
    windows = history.unfold(1, n, 1)  # (B, L - n + 1, n)
    starts = torch.arange(windows.shape[1], device=history.device)
    complete = starts <= length - n  # the window lies inside the sequence (none while length < n)
    hit = (windows[..., :-1] == _last_tokens(history, length, n - 1)[:, None, :]).all(-1) & complete
    return _scatter_mask(history.shape[0], vocab, windows[..., -1], hit)


def _completed_words(history: torch.Tensor, length: torch.Tensor, prefixes: torch.Tensor, last: torch.Tensor,
                     vocab: int) -> torch.Tensor:
    """(B, V): the last tokens of the bad words whose other tokens end the sequence."""
    prefix_len = prefixes.shape[1]
    hit = (_last_tokens(history, length, prefix_len)[:, None, :] == prefixes[None]).all(-1) & (length >= prefix_len)
    return _scatter_mask(history.shape[0], vocab, last[None].expand(history.shape[0], -1), hit)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _ids(value, name: str) -> list[int]:
    """A token id or a list of them as ints (a generation config may hold either)."""
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(_is_int(v) for v in values):
        raise ValueError(f"the generation config's {name}={value!r} must be token ids (ints)")
    return [int(v) for v in values]


def _count(value, name: str) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    return int(value)


def build(generation_config, min_new_tokens, eos: list[int], prompt_len: int, max_new_tokens: int, vocab: int,
          device: torch.device) -> LogitsRules | None:
    """The rules of ``generation_config`` (``min_new_tokens`` given wins over its own, and any
    min_new_tokens over min_length, as in transformers), for a batch
    of ``prompt_len``-token prompts and ``max_new_tokens`` steps; None if none applies. Warns about
    the rules it does not apply."""
    config = generation_config

    def field(name):
        return getattr(config, name, None) if config is not None else None

    def mask(ids: list[int], name: str) -> torch.Tensor | None:
        if not ids:
            return None
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"the generation config's {name} holds token id {bad[0]}, outside the vocabulary of "
                             f"{vocab}")
        out = torch.zeros(vocab, dtype=torch.bool, device=device)
        return out.index_fill_(0, torch.tensor(ids, device=device), True)

    unapplied = [f"{name}={value!r}" for name, off in UNAPPLIED.items() if (value := field(name)) not in (off, None)]
    rules = LogitsRules(prompt_len=prompt_len, ngram=_count(field("no_repeat_ngram_size"),
                                                            "the generation config's no_repeat_ngram_size") or 0)
    words = field("bad_words_ids")
    if words is not None and (not isinstance(words, (list, tuple)) or not words
                              or not all(isinstance(w, (list, tuple)) and w for w in words)):
        raise ValueError(f"the generation config's bad_words_ids={words!r} must be a non-empty list of non-empty "
                         "lists of token ids")
    words = [_ids(word, "bad_words_ids") for word in (words or [])]
    words = [word for word in words if not (len(word) == 1 and word[0] in eos)]  # as transformers
    rules.banned = mask([word[0] for word in words if len(word) == 1], "bad_words_ids")
    groups = []
    for k in sorted({len(word) for word in words if len(word) > 1}):
        group = [word for word in words if len(word) == k]
        mask(sorted({t for word in group for t in word}), "bad_words_ids")  # validates the ids
        groups.append((torch.tensor([w[:-1] for w in group], device=device),
                       torch.tensor([w[-1] for w in group], device=device)))
    rules.word_groups = tuple(groups)
    if unapplied:
        warnings.warn(f"quantkit's generate does not apply the generation config's {', '.join(unapplied)} "
                      "(model.generate does)", stacklevel=4)
    # transformers: a min_new_tokens (0 included) replaces min_length; the argument, the config's.
    name = "min_new_tokens"
    if min_new_tokens is None:
        min_new_tokens, name = field("min_new_tokens"), "the generation config's min_new_tokens"
    eos_from = _count(min_new_tokens, name)
    if eos_from is None:
        eos_from = (_count(field("min_length"), "the generation config's min_length") or 0) - prompt_len
    in_vocab = [i for i in eos if 0 <= i < vocab]  # transformers ignores an eos id the logits do not have
    if in_vocab and eos_from > 0:
        rules.eos, rules.eos_from = mask(in_vocab, "eos_token_id"), eos_from
        if eos_from >= max_new_tokens:  # transformers warns too
            source = name if min_new_tokens is not None else "the generation config's min_length"
            warnings.warn(f"{source} allows no eos token within max_new_tokens={max_new_tokens}: generation runs "
                          "to that length", stacklevel=4)
    forced_bos = _ids(field("forced_bos_token_id"), "forced_bos_token_id")
    if forced_bos and prompt_len == 1:  # transformers forces it when the sequence is one token long
        rules.forced_bos = mask(forced_bos, "forced_bos_token_id")
    forced_eos = _ids(field("forced_eos_token_id"), "forced_eos_token_id")
    if forced_eos:
        rules.forced_eos, rules.forced_eos_at = mask(forced_eos, "forced_eos_token_id"), max_new_tokens - 1
    suppressed = _ids(field("suppress_tokens"), "suppress_tokens")
    for forced, forced_name in ((forced_bos, "forced_bos_token_id"), (forced_eos, "forced_eos_token_id")):
        if forced and set(forced) <= set(suppressed):  # as transformers' GenerationConfig.validate
            raise ValueError(f"the generation config's {forced_name}={forced!r} is also in its suppress_tokens: "
                             "that step would have no token left; remove it from one of them")
    rules.suppressed = mask(suppressed, "suppress_tokens")
    begin = _ids(field("begin_suppress_tokens"), "begin_suppress_tokens")
    if begin:
        # transformers' first generated token, one later after a forced BOS on a one-token prompt
        rules.begin_suppressed = mask(begin, "begin_suppress_tokens")
        rules.begin_at = 1 if (prompt_len == 1 and forced_bos) else 0
    if not rules.needs_history and all(getattr(rules, f) is None for f in (
            "banned", "eos", "forced_bos", "forced_eos", "suppressed", "begin_suppressed")):
        return None
    return rules
