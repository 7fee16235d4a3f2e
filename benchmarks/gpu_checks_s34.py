"""GPU check of session 33's generation-config logits rules under the CUDA-graph decode, in one call.

    PYTHONPATH=. python benchmarks/gpu_checks_s34.py OUT.json

A random model of the bundled Gemma-3-270M's shape (``sampling_check.gemma3_270m_shaped``), bf16
(transformers' model) and FP8 / INT8 through ``optimize(exact=True)``; batch 1 and 4, greedy and
seeded top-k sampling. The generation config holds every rule at once (suppress_tokens,
begin_suppress_tokens, one- and two-token bad words, min_new_tokens with an eos the rule-free
decode emits early, forced_eos_token_id, no_repeat_ngram_size=3), each chosen from the rule-free
tokens so that it changes them. Checks per case:

- the captured decode step's tokens equal the eager step's, and differ from the rule-free ones;
- the tokens obey every rule (read off the output, independent of how generate applies them);
- bf16 greedy: equal to ``model.generate`` with the same generation config (reported; the two
  attention implementations round differently, so a flip of a near tie is possible).
"""

from __future__ import annotations

import copy
import sys

import torch

import quantkit
from quantkit.bench.common import environment_metadata

sys.path.insert(0, "benchmarks")
from sampling_check import RESULTS, gemma3_270m_shaped, record, write_results  # noqa: E402

PROMPT, NEW, PAD = 24, 40, 0


def rules_from(model, ids: torch.Tensor) -> tuple[dict, int]:
    """Generation-config fields from the eight likeliest first tokens of row 0 (the random model's
    greedy decode repeats one token, so its own tokens offer too few): the likeliest suppressed,
    the next suppressed first, bad words of one and two tokens, the forced eos, and an eos that
    min_new_tokens=8 holds back."""
    with torch.no_grad():
        top = model(ids[:1]).logits[0, -1].float().topk(8).indices.tolist()
    fields = dict(suppress_tokens=[top[0]], begin_suppress_tokens=[top[1]], bad_words_ids=[[top[2]], [top[3], top[4]]],
                  min_new_tokens=8, forced_eos_token_id=top[5], no_repeat_ngram_size=3)
    return fields, top[6]


def violations(tokens: torch.Tensor, fields: dict, eos: int) -> list[str]:
    """Every rule broken by ``tokens`` (B, PROMPT + NEW), read off the tokens alone."""
    found = []
    single = {w[0] for w in fields["bad_words_ids"] if len(w) == 1}
    pairs = [tuple(w) for w in fields["bad_words_ids"] if len(w) == 2]
    n = fields["no_repeat_ngram_size"]
    for b, row in enumerate(tokens.tolist()):
        new = row[PROMPT:]
        end = new.index(eos) + 1 if eos in new else NEW  # after eos the row is padding
        if eos in new and new.index(eos) < fields["min_new_tokens"]:
            found.append(f"row {b}: eos at new token {new.index(eos)} < min_new_tokens")
        if any(t in fields["suppress_tokens"] for t in new[:end]):
            found.append(f"row {b}: a suppressed token")
        if new[0] in fields["begin_suppress_tokens"]:
            found.append(f"row {b}: a begin-suppressed first token")
        # At the last step the forced eos overrides the rules that come before it (n-grams, bad words).
        free = end - 1 if end == NEW else end
        if any(t in single for t in new[:free]):
            found.append(f"row {b}: a one-token bad word")
        for t in range(PROMPT, PROMPT + free):
            if (row[t - 1], row[t]) in pairs:
                found.append(f"row {b}: a two-token bad word ending at {t}")
            gram = tuple(row[t - n + 1:t + 1])
            if any(tuple(row[s - n + 1:s + 1]) == gram for s in range(n - 1, t)):
                found.append(f"row {b}: a repeated {n}-gram ending at {t}")
        if end == NEW and new[-1] != fields["forced_eos_token_id"]:
            found.append(f"row {b}: last token {new[-1]} is not the forced eos")
    return found


def first_difference(model, ours: torch.Tensor, want: torch.Tensor, fields: dict, eos: int) -> dict:
    """Where generate and model.generate part: the first differing new token, both choices, and
    the bf16 logits of the two at that prefix (transformers' own forward); whether model.generate's
    tokens obey every rule too. A gap within bf16's rounding of the logits is a near tie that the
    two attention implementations may settle differently."""
    row, col = [int(i) for i in (ours != want).nonzero()[0]]
    with torch.no_grad():
        logits = model(want[row:row + 1, :col]).logits[0, -1].float()
    a, b = int(ours[row, col]), int(want[row, col])
    return dict(row=row, new_token=col - PROMPT, ours=a, model_generate=b, logit_ours=float(logits[a]),
                logit_model_generate=float(logits[b]), model_generate_violations=violations(want, fields, eos)[:5])


def rules_graph() -> None:
    base = gemma3_270m_shaped()
    for scheme in ("bf16", "fp8", "int8"):
        model = copy.deepcopy(base)
        if scheme != "bf16":
            model = quantkit.optimize(quantkit.quantize(model, quantkit.QuantConfig.preset(scheme), progress=False),
                                      exact=True)
        config = model.generation_config
        for batch in (1, 4):
            ids = torch.randint(3, 262144, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).cuda()
            ids[:, 12:] = ids[:, :12]  # a repeated prompt: n-gram bans from the first step
            plain = quantkit.generate_tokens(model, ids, NEW, eos_token_id=None)
            fields, eos = rules_from(model, ids)
            for kwargs in ({}, dict(do_sample=True, temperature=0.7, top_k=40)):
                for name, value in fields.items():
                    setattr(config, name, value)
                try:
                    runs = []
                    for graph in (True, False):
                        generator = torch.Generator("cuda").manual_seed(7) if kwargs else None
                        runs.append(quantkit.generate_tokens(model, ids, NEW, eos_token_id=eos, pad_token_id=PAD,
                                                             cuda_graph=graph, generator=generator, **kwargs))
                    hf_equal = rule_free_hf_equal = divergence = None
                    if scheme == "bf16" and not kwargs:  # reported: a near tie may flip between attention kernels
                        want = model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                                              pad_token_id=PAD)
                        hf_equal = torch.equal(want, runs[0])
                        if not hf_equal:
                            divergence = first_difference(model, runs[0], want, fields, eos)
                        for name in fields:
                            setattr(config, name, None)
                        rule_free_hf_equal = torch.equal(plain, model.generate(
                            ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=PAD))
                finally:
                    for name in fields:
                        setattr(config, name, None)
                broken = violations(runs[0], fields, eos)
                changed = not torch.equal(runs[0], plain)
                record("logits_rules_graph_equals_eager", torch.equal(runs[0], runs[1]) and changed and not broken,
                       scheme=scheme, batch=batch, changed_vs_rule_free=changed, violations=broken[:5],
                       equals_model_generate=hf_equal, rule_free_equals_model_generate=rule_free_hf_equal,
                       divergence_from_model_generate=divergence, **kwargs)
        del model


def main() -> None:
    out = sys.argv[1]
    RESULTS["meta"] = environment_metadata()
    rules_graph()
    write_results(out)


if __name__ == "__main__":
    main()
