"""The generation config's rules on the logits that ``generate`` applies as ``model.generate`` does.

transformers turns these generation-config fields into logits processors, run in this order after
the repetition penalty and before the sampling warpers; each sets scores to -inf (or forces one):

    bad_words_ids (one-token words)  ->  min_length, min_new_tokens (no eos before)
    ->  forced_bos_token_id, forced_eos_token_id  ->  suppress_tokens  ->  begin_suppress_tokens

``LogitsRules`` holds them as boolean masks over the vocabulary and step numbers, applied to the
(B, V) float32 scores with the step index as a device tensor: fixed shapes and no host branch, so
the captured decode step holds them. Rules that need the generated history or the encoder
(no_repeat_ngram_size, multi-token bad_words_ids, sequence_bias, encoder_repetition_penalty,
exponential_decay_length_penalty) are not applied; ``generate`` names them in a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

# Generation-config settings that model.generate applies to the logits and generate does not, with
# the value that means "off" (bad_words_ids: only its multi-token words, see ``build``).
UNAPPLIED = {"no_repeat_ngram_size": 0, "sequence_bias": None, "encoder_repetition_penalty": 1.0,
             "exponential_decay_length_penalty": None}


@dataclass
class LogitsRules:
    """Masks (V,) on the scores' device, None where a rule is off; steps count generated tokens."""

    banned: torch.Tensor | None = None  # one-token bad words: always -inf
    eos: torch.Tensor | None = None  # the eos ids, -inf while step < eos_from
    eos_from: int = 0
    forced_bos: torch.Tensor | None = None  # at step 0 only this token (a one-token prompt)
    forced_eos: torch.Tensor | None = None  # at step forced_eos_at only these tokens
    forced_eos_at: int = -1
    suppressed: torch.Tensor | None = None  # always -inf
    begin_suppressed: torch.Tensor | None = None  # -inf at step begin_at
    begin_at: int = 0

    def apply(self, scores: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """``scores`` (B, V) float32 at generated-token index ``step`` ((1,) long, on their device)."""
        inf = float("-inf")  # a Python scalar: no host-to-device copy inside a CUDA-graph capture
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


def _ids(value, name: str) -> list[int]:
    """A token id or a list of them as ints (a generation config may hold either)."""
    if value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"the generation config's {name}={value!r} must be token ids (ints)")
    return list(values)


def _count(value, name: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    return value


def build(generation_config, min_new_tokens, eos: list[int], prompt_len: int, max_new_tokens: int, vocab: int,
          device: torch.device) -> LogitsRules | None:
    """The rules of ``generation_config`` (``min_new_tokens`` given wins over its own), for a batch
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
            raise ValueError(f"{name} holds token id {bad[0]}, outside the vocabulary of {vocab}")
        return torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, torch.tensor(ids, device=device), True)

    unapplied = [f"{name}={value!r}" for name, off in UNAPPLIED.items() if (value := field(name)) not in (off, None)]
    rules = LogitsRules()
    words = field("bad_words_ids") or []
    if words:
        if all(len(word) == 1 for word in words):
            # transformers never bans an eos id as a bad word.
            rules.banned = mask([w[0] for w in words if w[0] not in eos], "bad_words_ids")
        else:
            unapplied.append(f"bad_words_ids={words!r} (words of several tokens)")
    if unapplied:
        warnings.warn(f"quantkit's generate does not apply the generation config's {', '.join(unapplied)} "
                      "(model.generate does)", stacklevel=4)
    if min_new_tokens is None:
        min_new_tokens = field("min_new_tokens")
        name = "the generation config's min_new_tokens"
    else:
        name = "min_new_tokens"
    eos_from = max(_count(min_new_tokens, name), _count(field("min_length"), "the generation config's min_length")
                   - prompt_len)
    if eos and eos_from > 0:
        rules.eos, rules.eos_from = mask(eos, "eos_token_id"), eos_from
    forced_bos = _ids(field("forced_bos_token_id"), "forced_bos_token_id")
    if forced_bos and prompt_len == 1:  # transformers forces it when the sequence is one token long
        rules.forced_bos = mask(forced_bos, "forced_bos_token_id")
    forced_eos = _ids(field("forced_eos_token_id"), "forced_eos_token_id")
    if forced_eos:
        rules.forced_eos, rules.forced_eos_at = mask(forced_eos, "forced_eos_token_id"), max_new_tokens - 1
    rules.suppressed = mask(_ids(field("suppress_tokens"), "suppress_tokens"), "suppress_tokens")
    begin = _ids(field("begin_suppress_tokens"), "begin_suppress_tokens")
    if begin:
        # transformers' first generated token, one later after a forced BOS on a one-token prompt
        rules.begin_suppressed = mask(begin, "begin_suppress_tokens")
        rules.begin_at = 1 if (prompt_len == 1 and forced_bos) else 0
    if all(getattr(rules, f) is None for f in ("banned", "eos", "forced_bos", "forced_eos", "suppressed",
                                               "begin_suppressed")):
        return None
    return rules
