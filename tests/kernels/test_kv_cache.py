"""The one-launch KV-cache write (kernels/kv_cache.py) against its twin (two index_copy_ calls)."""

import pytest
import torch

from quantkit.kernels import attention_ops, kv_cache

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (batch, kv heads, positions written, head_dim, cache head_dim, capacity): a decode step (S = 1),
# prompts of odd lengths, a head_dim below the cache's padded one (80 in 128), a cache filled to
# the last slot.
CASES = [(1, 2, 1, 64, 64, 9), (2, 3, 5, 80, 128, 11), (3, 1, 37, 128, 128, 37), (1, 4, 70, 32, 32, 131)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _inputs(case, dtype, seed):
    batch, heads, seqlen, head_dim, cache_dim, capacity = case
    gen = torch.Generator().manual_seed(seed)
    # k as HF hands it over: a transposed (B, S, H, D) view; v contiguous.
    k = torch.randn(batch, seqlen, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(batch, heads, seqlen, head_dim, generator=gen).to(dtype)
    positions = torch.randperm(capacity, generator=gen)[:seqlen]
    k_cache = torch.randn(batch, heads, capacity, cache_dim, generator=gen).to(dtype)
    v_cache = torch.randn(batch, heads, capacity, cache_dim, generator=gen).to(dtype)
    return k, v, k_cache, v_cache, positions


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-h{}-s{}-d{}in{}-c{}".format(*c))
def test_kv_cache_write_equals_the_twin_bit_for_bit(case, dtype):
    k, v, k_cache, v_cache, positions = _inputs(case, dtype, seed=sum(case))
    k_twin, v_twin = k_cache.clone(), v_cache.clone()
    attention_ops.write_kv_cache(k, v, k_cache, v_cache, positions, backend="triton")
    attention_ops.write_kv_cache(k, v, k_twin, v_twin, positions, backend="torch")
    # The written slots hold k and v; every other slot and the padding columns are untouched.
    assert torch.equal(_bits(k_cache), _bits(k_twin))
    assert torch.equal(_bits(v_cache), _bits(v_twin))
    assert torch.equal(_bits(k_cache[:, :, positions, : k.shape[-1]]), _bits(k.contiguous()))


def test_strided_positions_are_read_with_their_stride():
    k, v, k_cache, v_cache, _ = _inputs((2, 2, 3, 64, 64, 12), torch.float16, seed=7)
    positions = torch.tensor([9, 0, 4, 2, 7, 11])[::2]  # slots 9, 4, 7
    k_twin, v_twin = k_cache.clone(), v_cache.clone()
    kv_cache.write_kv_cache(k, v, k_cache, v_cache, positions)
    attention_ops.write_kv_cache(k, v, k_twin, v_twin, positions, backend="torch")
    assert torch.equal(_bits(k_cache), _bits(k_twin)) and torch.equal(_bits(v_cache), _bits(v_twin))


def test_positions_outside_the_cache_are_skipped_not_written_out_of_bounds():
    k, v, k_cache, v_cache, _ = _inputs((2, 2, 4, 64, 64, 6), torch.float32, seed=3)
    before = k_cache.clone()
    positions = torch.tensor([5, -1, 6, 0])
    kv_cache.write_kv_cache(k, v, k_cache, v_cache, positions)
    assert torch.equal(k_cache[:, :, 5], k[:, :, 0]) and torch.equal(k_cache[:, :, 0], k[:, :, 3])
    assert torch.equal(v_cache[:, :, 5], v[:, :, 0]) and torch.equal(v_cache[:, :, 0], v[:, :, 3])
    assert torch.equal(k_cache[:, :, 1:5], before[:, :, 1:5])


def test_an_empty_write_changes_nothing():
    k, v, k_cache, v_cache, _ = _inputs((1, 2, 1, 64, 64, 4), torch.bfloat16, seed=4)
    before = k_cache.clone()
    kv_cache.write_kv_cache(k[:, :, :0], v[:, :, :0], k_cache, v_cache, torch.zeros(0, dtype=torch.long))
    assert torch.equal(_bits(k_cache), _bits(before))


BAD = [
    (lambda k, v, kc, vc, p: (k, v.double(), kc, vc, p), "must share a dtype"),
    (lambda k, v, kc, vc, p: (k, v[:, :1], kc, vc, p), r"v \(1, 1, 3, 64\) .* must match k"),
    (lambda k, v, kc, vc, p: (k, v, kc[..., :32], vc[..., :32], p), "does not fit k_cache"),
    (lambda k, v, kc, vc, p: (k, v, kc, vc, p.int()), r"positions must be int64 of shape \(3,\)"),
    (lambda k, v, kc, vc, p: (k, v, kc, vc, p[:2]), r"positions must be int64 of shape \(3,\)"),
    (lambda k, v, kc, vc, p: (k[0], v[0], kc, vc, p), r"takes k, v \(B, Hkv, S, D\)"),
    (lambda k, v, kc, vc, p: (k, v, kc.transpose(2, 3), vc.transpose(2, 3), p), "does not fit|contiguous in its last"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bad,message", BAD)
def test_bad_inputs_raise_one_line_value_errors(bad, message, backend):
    k, v, k_cache, v_cache, positions = _inputs((1, 2, 3, 64, 64, 64), torch.float32, seed=5)
    with pytest.raises(ValueError, match=message):
        attention_ops.write_kv_cache(*bad(k, v, k_cache, v_cache, positions), backend=backend)


def test_the_registered_op_passes_opcheck():
    k, v, k_cache, v_cache, positions = _inputs((2, 2, 3, 64, 128, 8), torch.float32, seed=6)
    torch.library.opcheck(torch.ops.quantkit.write_kv_cache.default, (k.contiguous(), v, k_cache, v_cache, positions))
