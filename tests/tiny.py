"""Tiny random models, a tokenizer trained on the spot, and text files: the pipeline's test bench.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained on generated English-like
sentences, and the models are built from configs with random weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

WORDS = (
    "the river city market road bridge king church war north south early later small large old new "
    "people village castle school music history language island winter summer built became known "
    "during after before under between several many first second famous local ancient modern"
).split()


def make_documents(n_docs: int, sentences: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(sentences):
            words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
            lines.append(" ".join(words).capitalize() + ".")
        docs.append(" ".join(lines))
    return docs


def make_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<bos>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(make_documents(20, seed=123), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def make_model(arch: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch in ("llama", "llama-hd64"):
        # "llama-hd64": head_dim 64, the smallest the Triton attention kernels take (fast path tests).
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            head_dim=64 if arch == "llama-hd64" else None,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, attention_bias=True,
        )
        model = LlamaForCausalLM(config)
    elif arch == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; scale up so quantization error is visible in tests.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_tiny_model(directory: Path, arch: str) -> Path:
    tokenizer = make_tokenizer()
    model = make_model(arch, len(tokenizer))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def write_text_dir(directory: Path, n_docs: int = 8, sentences: int = 40) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(make_documents(n_docs, sentences, seed=7)):
        (directory / f"doc{i:02d}.txt").write_text(doc)
    return directory
