"""evaluate_perplexity's windows: what each scores, and the arguments it refuses."""

import math

import pytest
import torch
import torch.nn.functional as F

from quantkit.eval.perplexity import evaluate_perplexity
from tests.models.test_fast_path import make_tiny


def _scored_per_window(model, tokens, **kwargs):
    """Tokens scored by each window (its length minus the conditioning part), from the forwards seen."""
    lengths = []
    forward = model.forward

    def counting(*args, **kw):
        lengths.append(kw["input_ids"].shape[1])
        return forward(*args, **kw)

    model.forward = counting
    result = evaluate_perplexity(model, tokens, progress=False, **kwargs)
    del model.forward
    return result, lengths


def test_with_bos_each_window_advances_by_stride():
    """With BOS in front, a window scores `stride` new tokens (it scored stride - 1 before, so
    stride=1 and stride=2 gave the same result)."""
    model = make_tiny("llama")
    tokens = torch.randint(3, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    results = {}
    for stride in (1, 2, 4):
        result, lengths = _scored_per_window(model, tokens, window=8, stride=stride, bos_token_id=1)
        # The first window scores its 7 tokens after BOS; every later one `stride` new tokens.
        assert result.tokens == 30 and len(lengths) == 1 + -(-(30 - 7) // stride), (stride, lengths)
        results[stride] = result.nll
    assert len(set(results.values())) == 3


def test_refused_arguments():
    model = make_tiny("llama")
    tokens = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="stride=0"):
        evaluate_perplexity(model, tokens, window=8, stride=0, progress=False)
    too_long = model.config.max_position_embeddings + 1
    with pytest.raises(ValueError, match=f"window={too_long} exceeds the model's context"):
        evaluate_perplexity(model, tokens, window=too_long, progress=False)
    with pytest.raises(ValueError, match="1-D stream"):
        evaluate_perplexity(model, tokens.reshape(2, 20), window=8, progress=False)


def _nll_per_token(model, ids: torch.Tensor) -> torch.Tensor:
    """-log p(ids[t] | ids[:t]) for t >= 1, from one plain forward over ``ids``."""
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0].float()
    return F.cross_entropy(logits[:-1], ids[1:], reduction="none")


@pytest.mark.parametrize("bos", [None, 1], ids=["no_bos", "bos"])
def test_one_window_equals_cross_entropy_over_the_sequence(bos):
    model = make_tiny("llama").eval()
    tokens = torch.randint(3, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(2))
    result = evaluate_perplexity(model, tokens, window=24, bos_token_id=bos, progress=False)
    ids = tokens if bos is None else torch.cat([torch.tensor([bos]), tokens])
    expected = _nll_per_token(model, ids)
    assert result.tokens == expected.numel() == (22 if bos is None else 23)
    assert result.nll == pytest.approx(expected.mean().item(), rel=1e-6)
    assert result.perplexity == pytest.approx(math.exp(expected.mean().item()), rel=1e-6)


def test_sliding_windows_score_each_token_once_with_its_context():
    """stride < window: each token is scored once, by the window whose new part holds it, with the
    window's earlier tokens as context (no BOS: the stream's first token is never scored)."""
    model = make_tiny("llama").eval()
    tokens = torch.randint(3, model.config.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    result = evaluate_perplexity(model, tokens, window=8, stride=4, progress=False)
    nll = []
    for begin, end, first in [(0, 8, 1), (4, 12, 8), (8, 16, 12), (12, 20, 16)]:
        per_token = _nll_per_token(model, tokens[begin:end])  # predicts tokens[begin + 1 : end]
        nll.append(per_token[first - begin - 1:])
    expected = torch.cat(nll)
    assert result.tokens == expected.numel() == 19
    assert result.nll == pytest.approx(expected.mean().item(), rel=1e-6)


def test_scores_in_eval_mode_and_restores_the_callers_mode():
    model = make_tiny("llama")
    model.config.attention_dropout = 0.5
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    tokens = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    want = evaluate_perplexity(model.eval(), tokens, window=16, bos_token_id=1, progress=False)
    model.train()
    got = evaluate_perplexity(model, tokens, window=16, bos_token_id=1, progress=False)
    assert model.training and got.nll == want.nll


def test_a_broken_model_has_infinite_perplexity_not_an_overflow():
    model = make_tiny("llama").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    tokens = torch.randint(3, model.config.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    result = evaluate_perplexity(model, tokens, window=16, progress=False)
    assert result.nll > 710 and result.perplexity == math.inf
