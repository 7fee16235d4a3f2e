"""evaluate_perplexity's windows: what each scores, and the arguments it refuses."""

import pytest
import torch

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
