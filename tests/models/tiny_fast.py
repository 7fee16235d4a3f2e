"""Tiny random Llama / Gemma-3 models with head_dim 64 (what quantkit's attention kernels take)."""

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

COMMON = dict(vocab_size=160, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, attention_bias=True, **COMMON))
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, sliding_window=6, query_pre_attn_scalar=64,
            layer_types=["sliding_attention", "full_attention"], **COMMON))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; spread them so that greedy choices are not ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
        model.lm_head.weight.mul_(8.0)
    model.config._attn_implementation = "sdpa"
    return model.eval()
