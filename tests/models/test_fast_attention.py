"""The "quantkit" AttentionInterface function gives the same logits and greedy tokens as sdpa.

Tiny random Llama (GQA) and Gemma-3 (MQA, query_pre_attn_scalar scale, sliding-window local layers) models in
fp32 on CPU; the Triton backend runs under the interpreter (tests/conftest.py).
"""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, StaticCache

from quantkit.models.fast_attention import register_quantkit_attention, register_static_cache_attention


def tiny_llama():
    config = LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def tiny_gemma3():
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=48,
        max_position_embeddings=256,
    )
    return Gemma3ForCausalLM(config)


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logits_and_greedy_tokens_match_sdpa(make_model, backend):
    torch.manual_seed(0)
    assert_matches_sdpa(make_model().eval(), torch.randint(0, 128, (2, 13)), backend, new_tokens=4)


def assert_matches_sdpa(model, input_ids, backend, new_tokens):
    """Logits and greedy tokens with quantkit's attention equal the same model's on sdpa."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model(input_ids).logits
        want_tokens = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
    model.set_attn_implementation(register_quantkit_attention(backend=backend))
    with torch.no_grad():
        got = model(input_ids).logits
        got_tokens = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["sliding_attention", "full_attention"]])
def test_a_layer_that_passes_no_window_gets_none(layer_types):
    """Exaone-4's global layers keep config.sliding_window on the module but pass sliding_window=None:
    quantkit used to read the module's and attend over a window there (logits off by ~1)."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    torch.manual_seed(0)
    model = Exaone4ForCausalLM(Exaone4Config(
        vocab_size=160, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=128, sliding_window=4, layer_types=layer_types,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    assert_matches_sdpa(model, torch.randint(3, 160, (1, 16)), "torch", new_tokens=4)


@pytest.mark.parametrize("head_dim, backend", [(16, "torch"), (80, "torch"), (96, "triton")])
def test_head_dims_between_the_kernels_sizes_match_sdpa(head_dim, backend):
    # 80 and 96 (Phi-style) run at 128, 16 at 64, on zero-padded q/k/v; Gemma-3's query_pre_attn_scalar
    # scale and sliding window carry over unchanged.
    torch.manual_seed(1)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=head_dim, sliding_window=5, query_pre_attn_scalar=40,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)).eval()
    input_ids = torch.randint(1, 128, (2, 11))  # no pad id (0): generate would read it as padding
    assert_matches_sdpa(model, input_ids, backend, new_tokens=3)


def test_values_narrower_than_keys_are_refused():
    # Multi-head latent attention (DeepSeek-V3): k is 64 wide, v 16; padding must not hide it.
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=32, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128)).eval()
    model.set_attn_implementation(register_quantkit_attention(backend="torch"))
    with pytest.raises(ValueError, match=r"values as wide as keys \(k head_dim 64, v 16"), torch.no_grad():
        model(torch.randint(1, 128, (1, 9)))


def test_padded_batch_is_refused():
    model = tiny_llama().eval()
    model.set_attn_implementation(register_quantkit_attention(backend="torch"))
    input_ids = torch.randint(0, 128, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="padded batch"), torch.no_grad():
        model(input_ids, attention_mask=mask)


@pytest.mark.parametrize("kwargs,match", [
    ({"softcap": 30.0}, "no logit softcap"),
    ({"dropout": 0.1}, "inference-only"),
    ({"is_causal": False}, "causal-only"),
])
def test_both_attention_functions_refuse_what_the_kernels_do_not_compute(kwargs, match):
    from transformers import AttentionInterface

    module = torch.nn.Module()
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    for name, extra in [(register_quantkit_attention(backend="torch"), {}),
                        (register_static_cache_attention(backend="torch"), {"quantkit_kv_len": 5})]:
        function = AttentionInterface()[name]
        with pytest.raises(ValueError, match=match):
            function(module, q, k, v, None, **extra, **kwargs)
        # The same call without the offending argument runs: causal attention at head_dim 64.
        out, _ = function(module, q, k, v, None, **extra)
        scores = (q @ k.transpose(-1, -2)) / 8 + torch.full((5, 5), -torch.inf).triu(1)
        torch.testing.assert_close(out, (scores.softmax(-1) @ v).transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3"])
def test_static_cache_is_refused(make_model):
    # Unpadded, HF passes no mask with a StaticCache: the kernels attended over its empty slots
    # (logits off by up to 2.6 against sdpa, no error). The mask function now refuses it.
    torch.manual_seed(0)
    model = make_model().eval()
    model.set_attn_implementation(register_quantkit_attention(backend="torch"))
    input_ids = torch.randint(0, 128, (1, 6))
    with pytest.raises(ValueError, match="StaticCache"), torch.no_grad():
        model(input_ids, past_key_values=StaticCache(config=model.config, max_cache_len=32))
    with pytest.raises(ValueError, match="StaticCache"), torch.no_grad():
        model.generate(input_ids, max_new_tokens=2, do_sample=False, cache_implementation="static")


def test_each_optimized_model_keeps_its_attention_backend(monkeypatch):
    # The registered function is global: optimizing a second model (Triton) switched the first
    # one's (torch) attention to Triton, which on a GPU host would get the first model's CPU tensors.
    import quantkit
    from quantkit.config import QuantConfig
    from quantkit.kernels import attention_ops
    from quantkit.models.fast_path import optimize

    def quantized(backend):
        torch.manual_seed(0)
        return quantkit.quantize(tiny_llama().eval(), QuantConfig.preset("int8", backend=backend), progress=False)

    first = optimize(quantized("torch"), exact=False)
    optimize(quantized("triton"), exact=False)
    seen = []
    real = attention_ops.flash_attention
    monkeypatch.setattr(attention_ops, "flash_attention", lambda *a, **k: seen.append(k["backend"]) or real(*a, **k))
    with torch.no_grad():
        first(torch.randint(0, 128, (1, 5)))
    assert seen == ["torch"] * first.config.num_hidden_layers
