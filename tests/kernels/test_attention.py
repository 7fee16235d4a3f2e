"""Prefill flash attention and split-KV decode attention vs their torch twins and torch SDPA.

Runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py): shapes are small, blocks large.
fp32 inputs must match the fp32 oracles to ~1e-5; bf16 inputs to the bf16 rounding level.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from quantkit.kernels import attention_ops, reference_attention

FP32_TOL = dict(rtol=2e-5, atol=2e-5)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def sdpa_causal(q, k, v, scale, window=None):
    """torch SDPA in fp32 on (B, H, S, D), bottom-right causal (+ window) as an explicit mask."""
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    pos = torch.arange(n_queries)[:, None] + n_keys - n_queries
    key = torch.arange(n_keys)[None, :]
    visible = key <= pos
    if window is not None:
        visible &= key > pos - window
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=visible, scale=scale)


# (seq, head_dim, n_q_heads, n_kv_heads, window): odd lengths, every head_dim, MHA/GQA/MQA.
PREFILL_CASES = [
    (1, 64, 4, 2, None),
    (13, 128, 4, 1, None),
    (100, 64, 4, 2, None),
    (257, 64, 2, 1, None),
    (100, 256, 2, 2, None),
    (13, 256, 4, 1, 5),
    (257, 128, 2, 1, 64),
    (100, 64, 4, 4, 1),
    (257, 64, 2, 2, 100),
]


@pytest.mark.parametrize(
    "seq,head_dim,n_q_heads,n_kv_heads,window",
    PREFILL_CASES,
    ids=[f"s{s}-d{d}-h{hq}x{hkv}-w{w}" for s, d, hq, hkv, w in PREFILL_CASES],
)
def test_prefill_fp32_matches_twin_and_sdpa(seq, head_dim, n_q_heads, n_kv_heads, window, poisoned_empty):
    torch.manual_seed(seq * head_dim + n_q_heads)
    q = torch.randn(2, n_q_heads, seq, head_dim)
    k = torch.randn(2, n_kv_heads, seq, head_dim)
    v = torch.randn(2, n_kv_heads, seq, head_dim)
    scale = 1.0 / math.sqrt(head_dim) * 1.7  # not the default, so a dropped scale shows
    out = attention_ops.flash_attention(q, k, v, scale, window, backend="triton")
    twin = attention_ops.flash_attention(q, k, v, scale, window, backend="torch")
    assert not out.isnan().any()
    torch.testing.assert_close(out, twin, **FP32_TOL)
    torch.testing.assert_close(out, sdpa_causal(q, k, v, scale, window), **FP32_TOL)
    if window is None:
        group = n_q_heads // n_kv_heads
        plain = F.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True, scale=scale
        )
        torch.testing.assert_close(out, plain, **FP32_TOL)


def test_prefill_bf16_strided_views_continue_a_cache():
    """bf16, HF's (B, S, H, D) -> transpose views, and more keys than queries (cached prefix)."""
    torch.manual_seed(1)
    q = torch.randn(2, 37, 4, 128).bfloat16().transpose(1, 2)
    k = torch.randn(2, 100, 2, 128).bfloat16().transpose(1, 2)
    v = torch.randn(2, 100, 2, 128).bfloat16().transpose(1, 2)
    out = attention_ops.flash_attention(q, k, v, 0.1, None, backend="triton")
    assert out.dtype == torch.bfloat16
    ref = sdpa_causal(q, k, v, 0.1)
    assert rel_err(out, ref) < 1e-2
    # the window variant, with the queries at the end of the keys
    out_w = attention_ops.flash_attention(q, k, v, 0.1, 20, backend="triton")
    assert rel_err(out_w, sdpa_causal(q, k, v, 0.1, 20)) < 1e-2


def test_prefill_packed_sequences_match_per_sequence_sdpa(poisoned_empty):
    torch.manual_seed(2)
    lens_q = [1, 70, 13, 33]
    lens_k = [1, 70, 20, 33]  # the third sequence continues a 7-token prefix
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 64)
    k = torch.randn(sum(lens_k), 1, 64)
    v = torch.randn(sum(lens_k), 1, 64)
    for window in (None, 9):
        out = attention_ops.flash_attention(q, k, v, 0.2, window, cu_q, cu_k, max(lens_q), backend="triton")
        twin = attention_ops.flash_attention(q, k, v, 0.2, window, cu_q, cu_k, backend="torch")
        torch.testing.assert_close(out, twin, **FP32_TOL)
        for b in range(len(lens_q)):
            sl_q = slice(cu_q[b], cu_q[b + 1])
            sl_k = slice(cu_k[b], cu_k[b + 1])
            ref = sdpa_causal(q[sl_q].transpose(0, 1)[None], k[sl_k].transpose(0, 1)[None],
                              v[sl_k].transpose(0, 1)[None], 0.2, window)
            torch.testing.assert_close(out[sl_q], ref[0].transpose(0, 1), **FP32_TOL)


DECODE_CASES = [
    (64, 8, 2, None),
    (128, 4, 1, None),
    (256, 2, 1, None),
    (128, 8, 8, 50),
    (64, 4, 1, 1),
]


@pytest.mark.parametrize(
    "head_dim,n_q_heads,n_kv_heads,window",
    DECODE_CASES,
    ids=[f"d{d}-h{hq}x{hkv}-w{w}" for d, hq, hkv, w in DECODE_CASES],
)
def test_decode_matches_twin_and_sdpa(head_dim, n_q_heads, n_kv_heads, window, poisoned_empty):
    torch.manual_seed(head_dim + n_q_heads)
    capacity = 300
    lengths = [1, 13, 257, 300]
    q = torch.randn(len(lengths), n_q_heads, head_dim)
    k_cache = torch.randn(len(lengths), n_kv_heads, capacity, head_dim)
    v_cache = torch.randn(len(lengths), n_kv_heads, capacity, head_dim)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out = attention_ops.decode_attention(q, k_cache, v_cache, seqlens, 0.15, window, backend="triton")
    twin = attention_ops.decode_attention(q, k_cache, v_cache, seqlens, 0.15, window, backend="torch")
    assert not out.isnan().any()
    torch.testing.assert_close(out, twin, **FP32_TOL)
    for b, length in enumerate(lengths):
        ref = sdpa_causal(q[b][None, :, None], k_cache[b : b + 1, :, :length], v_cache[b : b + 1, :, :length], 0.15, window)
        torch.testing.assert_close(out[b], ref[0, :, 0], **FP32_TOL)


def test_decode_bf16_with_max_seqlen_and_empty_sequence():
    torch.manual_seed(3)
    q = torch.randn(3, 8, 128).bfloat16()
    k_cache = torch.randn(3, 2, 200, 128).bfloat16()
    v_cache = torch.randn(3, 2, 200, 128).bfloat16()
    seqlens = torch.tensor([0, 64, 150], dtype=torch.int32)
    out = attention_ops.decode_attention(q, k_cache, v_cache, seqlens, 0.09, max_seqlen=150, backend="triton")
    ref = reference_attention.decode_attention(q.float(), k_cache.float(), v_cache.float(), seqlens, 0.09)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no keys: defined as zeros
    assert rel_err(out[1:], ref[1:]) < 1e-2


def test_custom_ops_pass_opcheck():
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 2, 5, 64), torch.randn(1, 1, 5, 64), torch.randn(1, 1, 5, 64)
    torch.library.opcheck(torch.ops.quantkit.flash_attention.default, (q, k, v, 0.125, None, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))
    seqlens = torch.tensor([3], dtype=torch.int32)
    torch.library.opcheck(torch.ops.quantkit.decode_attention.default,
                          (q[:, :, 0], k, v, seqlens, 0.125, None, None), test_utils=("test_schema", "test_faketensor"))


def _qkv(q_shape, kv_shape, dtype=torch.float32):
    return torch.randn(q_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_prefill_bad_input_raises_before_launch(backend):
    cases = [
        (_qkv((1, 2, 8, 96), (1, 2, 8, 96)), {}, "head_dim=96"),
        (_qkv((1, 3, 8, 64), (1, 2, 8, 64)), {}, "multiple of n_kv_heads"),
        (_qkv((1, 2, 9, 64), (1, 2, 8, 64)), {}, "fewer keys"),
        (_qkv((1, 2, 8, 64), (1, 2, 8, 64)), {"window": 0}, "window"),
        (_qkv((10, 2, 64), (10, 2, 64)), {"cu_seqlens_q": torch.tensor([0, 10]), "cu_seqlens_k": torch.tensor([0, 10])}, "int32"),
    ]
    for (q, k, v), kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            attention_ops.flash_attention(q, k, v, 0.1, backend=backend, **kwargs)
    q, k, v = _qkv((1, 2, 8, 64), (1, 2, 8, 64))
    with pytest.raises(ValueError, match="dtypes differ"):
        attention_ops.flash_attention(q, k.half(), v, 0.1, backend=backend)
    with pytest.raises(ValueError, match="window=True"):
        attention_ops.flash_attention(q, k, v, 0.1, window=True, backend=backend)
    # Packed offsets past the packed length were read out of bounds by the kernel (CPU tensors are checked).
    q, k, v = _qkv((5, 4, 64), (5, 2, 64))
    for offsets in ([0, 2, 9], [1, 2, 5], [0, 3, 2, 5]):
        cu = torch.tensor(offsets, dtype=torch.int32)
        with pytest.raises(ValueError, match="must start at 0, never decrease"):
            attention_ops.flash_attention(q, k, v, 0.1, None, cu, cu, 7, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_decode_bad_input_raises_before_launch(backend):
    q = torch.randn(2, 4, 64)
    cache = torch.randn(2, 2, 16, 64)
    seqlens = torch.tensor([3, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="capacity 16"):
        attention_ops.decode_attention(q, cache, cache, seqlens, 0.1, max_seqlen=17, backend=backend)
    with pytest.raises(ValueError, match="int32"):
        attention_ops.decode_attention(q, cache, cache, seqlens.long(), 0.1, backend=backend)
    with pytest.raises(ValueError, match="head_dim=32"):
        attention_ops.decode_attention(torch.randn(2, 4, 32), torch.randn(2, 2, 16, 32), torch.randn(2, 2, 16, 32),
                                       seqlens, 0.1, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        attention_ops.decode_attention(q, cache, cache, seqlens, 0.1, backend="auto")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_batch_returns_empty_outputs(backend):
    cache = torch.randn(0, 2, 8, 64)
    out = attention_ops.decode_attention(torch.randn(0, 4, 64), cache, cache, torch.zeros(0, dtype=torch.int32), 0.1,
                                         backend=backend)
    assert out.shape == (0, 4, 64)
    q, k, v = _qkv((0, 4, 5, 64), (0, 2, 5, 64))
    assert attention_ops.flash_attention(q, k, v, 0.1, backend=backend).shape == (0, 4, 5, 64)


def test_twin_refuses_negative_cache_lengths():
    # Python slicing made a length of -1 attend to capacity - 1 keys.
    cache = torch.randn(2, 2, 8, 64)
    with pytest.raises(ValueError, match="must lie in 0..8"):
        attention_ops.decode_attention(torch.randn(2, 4, 64), cache, cache, torch.tensor([3, -1], dtype=torch.int32),
                                       0.1, backend="torch")


# (batch, length, block_n, programs_per_sm, splits): the pointer kernel's (64-key tiles, two per SM)
# and the head_dim-128 default's (128-key TMA tiles, one per SM).
PLAN_CASES = [(8, 32768, 64, 2, 4), (8, 4096, 64, 2, 4), (1, 32768, 64, 2, 32), (1, 1024, 64, 2, 16),
              (8, 32768, 128, 1, 2), (8, 1024, 128, 1, 2), (1, 32768, 128, 1, 16), (1, 1024, 128, 1, 8)]


@pytest.mark.parametrize("batch,length,block_n,per_sm,splits", PLAN_CASES)
def test_decode_split_plan_fills_whole_waves(monkeypatch, batch, length, block_n, per_sm, splits):
    from quantkit.kernels import attention_decode

    monkeypatch.setattr(attention_decode, "num_sms", lambda index: 132)
    attention_decode.decode_split_plan.cache_clear()
    split_len, n_splits = attention_decode.decode_split_plan(batch, 8, length, torch.device("cuda", 0), block_n,
                                                             per_sm)
    assert (split_len, n_splits) == (triton_cdiv(length, splits), splits)
    assert split_len % block_n == 0 and (n_splits - 1) * split_len < length <= n_splits * split_len
    assert batch * 8 * n_splits <= per_sm * 132  # one wave
    attention_decode.decode_split_plan.cache_clear()  # the patched SM count must not leak


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("n_splits", [1, 3, 7, 100])
def test_decode_any_split_count_matches_twin(n_splits):
    from quantkit.kernels import attention

    torch.manual_seed(n_splits)
    q, k_cache, v_cache = torch.randn(2, 4, 64), torch.randn(2, 2, 333, 64), torch.randn(2, 2, 333, 64)
    seqlens = torch.tensor([333, 70], dtype=torch.int32)
    out = attention.decode_attention(q, k_cache, v_cache, seqlens, 0.125, n_splits=n_splits)
    twin = reference_attention.decode_attention(q, k_cache, v_cache, seqlens, 0.125)
    torch.testing.assert_close(out, twin, **FP32_TOL)


def test_eager_calls_launch_directly_and_equal_the_registered_ops(monkeypatch):
    from quantkit.kernels import triton_ops

    torch.manual_seed(5)
    q, k, v = torch.randn(1, 4, 37, 64), torch.randn(1, 2, 37, 64), torch.randn(1, 2, 37, 64)
    x, weight = torch.randn(19, 64), torch.randn(64)
    cos, sin = torch.randn(1, 37, 64), torch.randn(1, 37, 64)

    def run():
        return (
            attention_ops.flash_attention(q, k, v, 0.125, backend="triton"),
            attention_ops.decode_attention(q[:, :, 0], k, v, torch.tensor([37], dtype=torch.int32), 0.125,
                                           backend="triton"),
            attention_ops.rms_norm(x, weight, 1e-6, residual=x.flip(0), backend="triton"),
            attention_ops.layer_norm(x, weight, None, 1e-6, backend="triton")[0],
            attention_ops.apply_rope(q, k, cos, sin, backend="triton"),
        )

    calls = []
    real = torch.ops.quantkit.flash_attention.default
    monkeypatch.setattr(attention_ops, "_flash_attention_op", lambda *a: calls.append(a) or real(*a))
    direct = run()
    assert calls == []  # eager: no custom-op dispatch
    monkeypatch.setattr(triton_ops, "DIRECT_EAGER_LAUNCH", False)
    through_ops = run()
    assert len(calls) == 1
    flat = lambda t: [y for x in t for y in (x if isinstance(x, tuple) else (x,)) if y is not None]  # noqa: E731
    for a, b in zip(flat(direct), flat(through_ops)):
        assert torch.equal(a, b)


# (head_dim, n_q_heads, n_kv_heads, window, n_splits): the fused combine's chunking differs with
# the group size and head_dim (GROUP_P2 x SPLIT_CHUNK x D ~ 4096): one chunk, several, one split each.
FUSED_CASES = [
    (64, 2, 1, None, 5),     # group 2: SPLIT_CHUNK 32, one chunk
    (128, 8, 1, None, 7),    # group 8: SPLIT_CHUNK 4, two chunks
    (256, 8, 8, 130, 3),     # MHA with a window
    (256, 32, 1, None, 2),   # MQA, 32 heads: SPLIT_CHUNK 1, two chunks
    (64, 32, 1, None, 6),    # MQA, partials too large for one program: the two-launch combine
    (128, 4, 2, None, 1),    # one split: the program writes the output itself
]


@pytest.mark.parametrize(
    "head_dim,n_q_heads,n_kv_heads,window,n_splits",
    FUSED_CASES,
    ids=[f"d{d}-h{hq}x{hkv}-w{w}-splits{n}" for d, hq, hkv, w, n in FUSED_CASES],
)
def test_decode_fused_combine_matches_two_launch_combine_and_twin(
    head_dim, n_q_heads, n_kv_heads, window, n_splits, poisoned_empty
):
    from quantkit.kernels import attention

    torch.manual_seed(head_dim * n_q_heads + n_splits)
    lengths = [0, 1, 65, 383, 400]  # empty, one key, odd, capacity
    q = torch.randn(len(lengths), n_q_heads, head_dim)
    k_cache = torch.randn(len(lengths), n_kv_heads, 400, head_dim)
    v_cache = torch.randn(len(lengths), n_kv_heads, 400, head_dim)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    twin = reference_attention.decode_attention(q, k_cache, v_cache, seqlens, 0.11, window)
    for _ in range(2):  # a second call sees the counters the first one left: all reset to zero
        fused = attention.decode_attention(q, k_cache, v_cache, seqlens, 0.11, window, n_splits=n_splits)
        two_launch = attention.decode_attention(q, k_cache, v_cache, seqlens, 0.11, window, n_splits=n_splits,
                                                fuse_combine=False)
        torch.testing.assert_close(fused, twin, **FP32_TOL)
        torch.testing.assert_close(two_launch, twin, **FP32_TOL)
        assert torch.equal(fused[0], torch.zeros_like(fused[0]))
        assert not attention._group_counters(q.device, 1).any()


def test_decode_group_counters_grow_and_keep_the_old_buffer():
    from quantkit.kernels import attention

    small = attention._group_counters(torch.device("cpu"), 3)
    assert small.dtype == torch.int32 and not small.any()
    grown = attention._group_counters(torch.device("cpu"), small.numel() + 1)
    assert grown.numel() > small.numel() and not grown.any()
    assert any(old is small for old in attention._RETIRED_COUNTERS)  # a captured graph may use it
    assert attention._group_counters(torch.device("cpu"), 5) is grown


def test_decode_epilogue_choice_bounds_the_fused_combine():
    from quantkit.kernels import attention

    assert attention.decode_epilogue(1, 4, 128) == (attention.EPILOGUE_FINAL, 1)
    assert attention.decode_epilogue(32, 4, 128) == (attention.EPILOGUE_FUSED, 8)  # batch 1, Llama-3-8B
    assert attention.decode_epilogue(4, 4, 128) == (attention.EPILOGUE_FUSED, 4)   # batch 8
    assert attention.decode_epilogue(4, 4, 128, fuse_combine=False)[0] == attention.EPILOGUE_PARTIAL
    assert attention.decode_epilogue(141, 32, 256)[0] == attention.EPILOGUE_PARTIAL  # MQA, many splits
    for n_splits in range(2, 300):
        for group in (1, 2, 4, 8, 32):
            for head_dim in (64, 128, 256):
                epilogue, chunk = attention.decode_epilogue(n_splits, group, head_dim)
                if epilogue == attention.EPILOGUE_FUSED:
                    block_splits = attention.triton.next_power_of_2(n_splits)
                    assert chunk & (chunk - 1) == 0 and block_splits // chunk <= 4  # bounded unroll


def test_decode_two_launch_combine_over_many_split_chunks():
    from quantkit.kernels import attention

    torch.manual_seed(18)
    q, k_cache, v_cache = torch.randn(2, 2, 64), torch.randn(2, 1, 1100, 64), torch.randn(2, 1, 1100, 64)
    seqlens = torch.tensor([1100, 5], dtype=torch.int32)  # 18 splits (two chunks of 16); most empty for b=1
    out = attention.decode_attention(q, k_cache, v_cache, seqlens, 0.125, n_splits=18, fuse_combine=False)
    torch.testing.assert_close(out, reference_attention.decode_attention(q, k_cache, v_cache, seqlens, 0.125),
                               **FP32_TOL)


# Session-4 load paths of the split kernel (DecodeConfig): each must equal the twin, with odd
# lengths (a partial last block), an empty sequence, a sliding window, and caches that are views
# (sliced capacity, a transposed (B, L, H, D) layout that the TMA row view cannot take).
LOAD_VARIANTS = {
    "pointer-k-rows": dict(k_rows=True),
    "pointer-evict": dict(evict_first=True),
    "prefetch": dict(prefetch_first=True),
    "tma": dict(loads="tma"),
    "tma-prefetch": dict(loads="tma", prefetch_first=True),
}


@pytest.mark.parametrize("variant", list(LOAD_VARIANTS), ids=list(LOAD_VARIANTS))
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "transposed", "padded-rows"])
def test_decode_load_variants_match_twin(variant, layout, poisoned_empty):
    from quantkit.kernels import attention_decode

    torch.manual_seed(len(variant) * 7 + len(layout))
    batch, n_q_heads, n_kv_heads, head_dim, capacity = 4, 8, 2, 64, 200
    config = attention_decode.DecodeConfig(32, 4, 1, 2, **LOAD_VARIANTS[variant])
    shape = (batch, n_kv_heads, capacity + 37, head_dim)
    if layout == "transposed":
        k_cache = torch.randn(batch, capacity, n_kv_heads, head_dim).transpose(1, 2)
        v_cache = torch.randn(batch, capacity, n_kv_heads, head_dim).transpose(1, 2)
    elif layout == "padded-rows":  # rows of 65 floats: not 16-byte aligned, no TMA row view
        k_cache = torch.randn(batch, n_kv_heads, capacity, head_dim + 1)[..., :head_dim]
        v_cache = torch.randn(batch, n_kv_heads, capacity, head_dim + 1)[..., :head_dim]
    else:
        k_cache, v_cache = torch.randn(shape), torch.randn(shape)
        if layout == "sliced":
            k_cache, v_cache = k_cache[:, :, :capacity], v_cache[:, :, :capacity]
        else:
            k_cache, v_cache = k_cache[:, :, :capacity].contiguous(), v_cache[:, :, :capacity].contiguous()
    assert (attention_decode.cache_rows(k_cache) is None) == (layout in ("transposed", "padded-rows"))
    q = torch.randn(batch, n_q_heads, head_dim)
    lengths = [0, 1, 97, 150]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    twin_k, twin_v = k_cache.clone(), v_cache.clone()
    for b, length in enumerate(lengths):
        # Slots past a sequence's length hold NaN: a variant that lets them into a sum shows.
        k_cache[b, :, length:], v_cache[b, :, length:] = float("nan"), float("nan")
    for window, max_seqlen, n_splits in ((None, None, None), (None, 150, 3), (40, None, 2)):
        out = attention_decode.decode_attention(q, k_cache, v_cache, seqlens, 0.13, window, max_seqlen,
                                                block_config=config, n_splits=n_splits)
        twin = reference_attention.decode_attention(q, twin_k, twin_v, seqlens, 0.13, window)
        torch.testing.assert_close(out, twin, **FP32_TOL)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_decode_config_accepts_the_old_tuple_and_rejects_bad_values():
    from quantkit.kernels import attention, attention_decode

    assert attention_decode.DecodeConfig.of((64, 4, 3, 2)) == attention_decode.DecodeConfig()
    assert attention.DecodeConfig is attention_decode.DecodeConfig  # re-exported
    assert attention.decode_attention is attention_decode.decode_attention
    for bad, message in ((dict(block_n=48), "block_n=48"), (dict(num_warps=3), "num_warps=3"),
                         (dict(loads="cp.async"), "loads='cp.async'"), (dict(programs_per_sm=0), "programs_per_sm=0"),
                         (dict(schedule="persistent"), "schedule='persistent'"),
                         (dict(schedule="flat", min_blocks=0), "min_blocks=0"),
                         (dict(schedule="flat", prefetch_first=True), "prefetch_first")):
        with pytest.raises(ValueError, match=message):
            attention_decode.DecodeConfig(**bad)
    with pytest.raises(ValueError, match="block_config"):
        attention_decode.DecodeConfig.of((64, 4, 3))


# Session 5: the balanced persistent schedule (DecodeConfig(schedule="flat")). Under the
# interpreter the grid is patched to a few programs, so that one program's range spans several
# sequences, a sequence spans several programs, and (few blocks) programs past the cut stay idle.
def _flat_case(seed, batch, n_q_heads, n_kv_heads, capacity, lengths, layout="contiguous", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    head_dim = 64
    if layout == "transposed":  # (B, L, H, D) storage: no TMA row view, pointer fallback
        k_cache = torch.randn(batch, capacity, n_kv_heads, head_dim, generator=gen).transpose(1, 2)
        v_cache = torch.randn(batch, capacity, n_kv_heads, head_dim, generator=gen).transpose(1, 2)
    else:
        k_cache = torch.randn(batch, n_kv_heads, capacity + 19, head_dim, generator=gen)[:, :, :capacity]
        v_cache = torch.randn(batch, n_kv_heads, capacity + 19, head_dim, generator=gen)[:, :, :capacity]
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(batch, n_q_heads, head_dim, generator=gen).to(dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    twin_k, twin_v = k_cache.float().clone(), v_cache.float().clone()
    for b, length in enumerate(lengths):
        k_cache[b, :, length:], v_cache[b, :, length:] = float("nan"), float("nan")  # must stay unread
    return q, k_cache, v_cache, seqlens, twin_k, twin_v


@pytest.mark.parametrize("programs", [1, 3, 7, 13])
@pytest.mark.parametrize("loads,layout,block_n,min_blocks", [
    ("tma", "contiguous", 32, 1), ("tma", "contiguous", 16, 3), ("pointer", "contiguous", 32, 2),
    ("tma", "transposed", 32, 1),
])
def test_decode_flat_schedule_matches_twin(monkeypatch, poisoned_empty, programs, loads, layout, block_n, min_blocks):
    from quantkit.kernels import attention_decode

    monkeypatch.setattr(attention_decode, "flat_programs", lambda device, per_sm: programs)
    config = attention_decode.DecodeConfig(block_n, 4, 1, 1, loads=loads, schedule="flat", min_blocks=min_blocks)
    lengths = [0, 1, 131, 77, 150]  # empty, one key, odd lengths (partial last blocks)
    q, k_cache, v_cache, seqlens, twin_k, twin_v = _flat_case(programs * 10 + block_n, 5, 8, 2, 150, lengths, layout)
    for window, max_seqlen in ((None, None), (None, 150), (37, None)):
        out = attention_decode.decode_attention(q, k_cache, v_cache, seqlens, 0.13, window, max_seqlen,
                                                block_config=config)
        twin = reference_attention.decode_attention(q, twin_k, twin_v, seqlens, 0.13, window)
        torch.testing.assert_close(out, twin, **FP32_TOL)
        assert torch.equal(out[0], torch.zeros_like(out[0]))  # no keys: zeros
    assert int(attention_decode._GROUP_COUNTERS[q.device].abs().sum()) == 0  # reset for the next launch


def test_decode_flat_schedule_bf16_is_deterministic_and_spreads_a_partly_filled_cache(monkeypatch):
    """bf16 over a mostly empty cache (as generate's captured decode sees it): the cut follows
    the lengths, so every program gets work; two calls give bit-identical outputs."""
    from quantkit.kernels import attention_decode

    monkeypatch.setattr(attention_decode, "flat_programs", lambda device, per_sm: 6)
    config = attention_decode.DecodeConfig(32, 4, 1, 1, loads="tma", schedule="flat", min_blocks=1)
    q, k_cache, v_cache, seqlens, twin_k, twin_v = _flat_case(5, 2, 8, 2, 512, [45, 70], dtype=torch.bfloat16)
    first = attention_decode.decode_attention(q, k_cache, v_cache, seqlens, 0.125, block_config=config)
    second = attention_decode.decode_attention(q, k_cache, v_cache, seqlens, 0.125, block_config=config)
    assert torch.equal(first, second)
    twin = reference_attention.decode_attention(q.float(), twin_k, twin_v, seqlens, 0.125)
    assert rel_err(first, twin) < 1e-2


@pytest.mark.parametrize("seed", range(6))
def test_decode_flat_parts_per_sequence_fit_the_workspace(seed):
    """The kernel's cut, in Python: each program's range is non-empty and no sequence is split
    into more parts than the host's workspace holds (ceil(P / kv heads) + 1)."""
    gen = torch.Generator().manual_seed(seed)
    batch, n_kv_heads = int(torch.randint(1, 9, (1,), generator=gen)), [1, 2, 8][seed % 3]
    programs, min_blocks = [132, 264, 396, 5][seed % 4], 1 + seed % 3
    blocks = [max(1, int(n)) for n in torch.randint(0, 300, (batch,), generator=gen)]
    blocks[0] = max(blocks) * 7  # one long sequence among short ones
    seq_blocks = [nb for nb in blocks for _ in range(n_kv_heads)]
    total = sum(seq_blocks)
    n_prog = min(programs, -(-total // min_blocks))
    bounds = [p * total // n_prog for p in range(n_prog + 1)]
    assert all(bounds[p + 1] > bounds[p] for p in range(n_prog))
    start = 0
    for nb in seq_blocks:
        p_first, p_last = ((start + 1) * n_prog - 1) // total, ((start + nb) * n_prog - 1) // total
        assert bounds[p_first] <= start < bounds[p_first + 1] and bounds[p_last] < start + nb <= bounds[p_last + 1]
        assert p_last - p_first + 1 <= -(-programs // n_kv_heads) + 1
        start += nb


def test_decode_descriptor_cache_follows_the_tensor_object():
    from quantkit.kernels import attention_decode

    cache = torch.randn(2, 2, 40, 64)
    first = attention_decode._cache_descriptor(cache, 32)
    assert first is not None and attention_decode._cache_descriptor(cache, 32) is first  # hit
    assert attention_decode._cache_descriptor(cache, 16) is not first  # other box: own entry
    view = cache[:, :, :24]  # another object over the same storage: own entry, own shape
    assert attention_decode._cache_descriptor(view, 32)[1].shape != first[1].shape
    cache.set_(torch.randn(2, 2, 48, 64))  # same object, new storage and shape: a miss
    assert attention_decode._cache_descriptor(cache, 32)[1].shape[0] == 4 * 48  # rows of (B, H, 48)
    keys = [key for key in attention_decode._DESCRIPTORS if key[0] == id(view)]
    del view
    assert not any(key in attention_decode._DESCRIPTORS for key in keys)  # freed with the tensor
    assert attention_decode._cache_descriptor(torch.randn(2, 2, 40, 65)[..., :64], 32) is None  # no row view
    # The base tensor too: a cached descriptor must not keep the caller's cache (and its memory) alive.
    keys = [key for key in attention_decode._DESCRIPTORS if key[0] == id(cache)]
    assert keys
    del cache, first
    assert not any(key in attention_decode._DESCRIPTORS for key in keys)  # no gc needed: nothing pins it


@pytest.mark.parametrize("split_by_fill", [True, False])
@pytest.mark.parametrize("loads", ["tma", "pointer"])
def test_decode_splits_cut_over_the_filled_blocks_match_twin(poisoned_empty, split_by_fill, loads):
    """Split grid planned for a large capacity, caches filled to a fraction of it (generate's
    captured decode): the device-side cut over the filled blocks gives the twin's result."""
    from quantkit.kernels import attention_decode

    config = attention_decode.DecodeConfig(16, 4, 1, 1, loads=loads, split_by_fill=split_by_fill)
    lengths = [0, 1, 33, 70, 9]
    q, k_cache, v_cache, seqlens, twin_k, twin_v = _flat_case(11 + split_by_fill, 5, 8, 2, 300, lengths)
    for window, n_splits in ((None, 7), (None, 3), (20, 5)):
        out = attention_decode.decode_attention(q, k_cache, v_cache, seqlens, 0.12, window, block_config=config,
                                                n_splits=n_splits)
        twin = reference_attention.decode_attention(q, twin_k, twin_v, seqlens, 0.12, window)
        torch.testing.assert_close(out, twin, **FP32_TOL)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
