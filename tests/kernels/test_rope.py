"""RoPE kernel vs its twin and transformers' own apply_rotary_pos_emb (Llama convention)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from quantkit.kernels import attention_ops


def hf_cos_sin(batch: int, seq: int, head_dim: int, base: float = 10000.0):
    """cos/sin as HF's rotary embedding builds them: both halves repeated, random positions."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    positions = torch.randint(0, 4096, (batch, seq)).float()
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


CASES = [(1, 64, 4, 2), (13, 128, 4, 1), (100, 256, 2, 2), (257, 64, 8, 1)]


@pytest.mark.parametrize("seq,head_dim,n_q_heads,n_kv_heads", CASES, ids=[f"s{s}-d{d}-h{q}x{k}" for s, d, q, k in CASES])
def test_rope_fp32_matches_hf_and_twin(seq, head_dim, n_q_heads, n_kv_heads, poisoned_empty):
    torch.manual_seed(seq + head_dim)
    q = torch.randn(2, n_q_heads, seq, head_dim)
    k = torch.randn(2, n_kv_heads, seq, head_dim)
    cos, sin = hf_cos_sin(2, seq, head_dim)
    q_out, k_out = attention_ops.apply_rope(q, k, cos, sin, backend="triton")
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    q_twin, k_twin = attention_ops.apply_rope(q, k, cos, sin, backend="torch")
    torch.testing.assert_close(q_out, q_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_out, k_hf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q_out, q_twin, rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_twin, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_16_bit_strided_views_bit_equal_to_hf(dtype):
    """HF hands over transposed (B, S, H, D) views; cos/sin with batch 1 broadcast. In 16 bits the
    kernel rounds as HF's eager function does (each product, then the sum): equal bits."""
    torch.manual_seed(5)
    q = (3 * torch.randn(3, 13, 4, 128)).to(dtype).transpose(1, 2)
    k = (3 * torch.randn(3, 13, 2, 128)).to(dtype).transpose(1, 2)
    cos, sin = (t.to(dtype) for t in hf_cos_sin(1, 13, 128))
    q_out, k_out = attention_ops.apply_rope(q, k, cos, sin, backend="triton")
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    q_twin, k_twin = attention_ops.apply_rope(q, k, cos, sin, backend="torch")
    assert q_out.dtype == dtype and q_out.is_contiguous()
    for got in (q_out, q_twin):
        assert torch.equal(got, q_hf)
    for got in (k_out, k_twin):
        assert torch.equal(got, k_hf)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_rope_bad_input_raises(backend):
    q, k = torch.randn(1, 2, 5, 64), torch.randn(1, 1, 5, 64)
    cos, sin = hf_cos_sin(1, 5, 64)
    with pytest.raises(ValueError, match="cos must be"):
        attention_ops.apply_rope(q, k, cos[:, :4], sin, backend=backend)
    with pytest.raises(ValueError, match="does not match q"):
        attention_ops.apply_rope(q, k[:, :, :4], cos, sin, backend=backend)
    with pytest.raises(ValueError, match="power of two"):
        attention_ops.apply_rope(q[..., :48], k[..., :48], cos[..., :48], sin[..., :48], backend=backend)
    with pytest.raises(ValueError, match="dtype"):
        attention_ops.apply_rope(q.to(torch.float64), k, cos, sin, backend=backend)
    # Zero q heads used to skip the launch and return k's output uninitialised.
    with pytest.raises(ValueError, match="at least one head"):
        attention_ops.apply_rope(q[:, :0], k, cos, sin, backend=backend)


@pytest.mark.parametrize("dtype,magnitude", [(torch.float16, 1e-4), (torch.float16, 2e4), (torch.bfloat16, 1e-30),
                                             (torch.float32, 3.0)])
def test_rope_rounding_at_range_edges_bit_equal_to_hf(dtype, magnitude):
    """Products in float16's subnormal range (below 2**-14), near its overflow, bfloat16's tiny
    values, and float32 (no FMA contraction): the kernel's bit-level rounding still gives HF's bits."""
    torch.manual_seed(11)
    # Clamped inside float16's range: products stay finite, sums of two may round past 65504 to inf.
    q = (magnitude * torch.randn(2, 3, 37, 64)).clamp(-6e4, 6e4).to(dtype)
    k = (magnitude * torch.randn(2, 1, 37, 64)).clamp(-6e4, 6e4).to(dtype)
    cos, sin = (t.to(dtype) for t in hf_cos_sin(2, 37, 64))
    q_out, k_out = attention_ops.apply_rope(q, k, cos, sin, backend="triton")
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    if dtype == torch.float16 and magnitude < 1:
        assert (q_hf.abs() < 2**-14).float().mean() > 0.3  # the subnormal path is exercised
    assert torch.equal(q_out, q_hf) and torch.equal(k_out, k_hf)


@pytest.mark.parametrize("seq,heads_per_program", [(1, 1), (1, 3), (19, 2), (70, 5)])
def test_rope_heads_split_over_programs(seq, heads_per_program, poisoned_empty):
    """Decode-shaped launches split the q + k heads over programs (ranges straddling the q/k
    boundary included): every head rotated once, HF's bits, nothing written twice or skipped."""
    from quantkit.kernels import rope

    torch.manual_seed(seq)
    q = (2 * torch.randn(3, 5, seq, 64)).to(torch.bfloat16)
    k = (2 * torch.randn(3, 2, seq, 64)).to(torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in hf_cos_sin(3, seq, 64))
    q_out, k_out = rope.apply_rope(q, k, cos, sin, heads_per_program=heads_per_program)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(q_out, q_hf) and torch.equal(k_out, k_hf)
    with pytest.raises(ValueError, match="heads_per_program=0"):
        rope.apply_rope(q, k, cos, sin, heads_per_program=0)
