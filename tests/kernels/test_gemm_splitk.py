"""Split-K and swapped operands of the tiled GEMM's decode configs (gemm.py, SPLIT_K and SWAP_AB)
under the CPU interpreter.

Each output tile is computed as SPLIT_K K-slices by as many programs; the last slice to arrive
sums the partial tiles in slice order and runs the epilogue. SWAP_AB computes each tile as
(w @ a.T).T (the weight rows as the MMA's first operand); the tests run with it off and on.
Outputs are poisoned before each launch, the INT8 accumulator is compared exactly with an
integer matmul, FP8 against the reference twin, and every launch must leave the arrival counters
at zero. Interpreter cost is per program: 16 x 64 x 64 tiles and shapes of a few tiles keep each
launch to a few programs.
"""

import pytest
import torch

from quantkit.kernels import gemm, gemm_configs, gemm_tma, reference

QDTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
# K cases (64-wide K steps): 208 = 3 full steps + a masked tail of 16, in 3 slices [0,1) [1,2)
# [2,4) (the tail inside the last slice); 80 = 2 steps (tail 16) with 8 slices requested -> 2.
K_CASES = [pytest.param(208, 3, 3, id="K208_tail_S3"), pytest.param(80, 8, 2, id="K80_S8_clipped_to_2")]
M_VALUES = [1, 13, 16]
N = 70  # two 64-wide N tiles, the second 6 columns wide

# The interpreter evaluates sigmoid's exp(-x) in numpy, which warns when it saturates to inf
# (the result, 1 / (1 + inf) = 0, is the right one).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


SWAPS = [pytest.param(False, id="mma_a"), pytest.param(True, id="swap_ab")]


def _config(split_k, swap=False):
    return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 4, "SPLIT_K": split_k, "SWAP_AB": swap,
            "num_warps": 4, "num_stages": 2}


def _operands(M, K, dtype, seed, rows=N):
    gen = torch.Generator().manual_seed(seed)
    a, a_scale = reference.quantize_per_token(torch.randn(M, K, generator=gen) * 2, dtype)
    w, w_scale = reference.quantize_per_channel(torch.randn(rows, K, generator=gen), dtype)
    return a, a_scale, w, w_scale, torch.randn(N, generator=gen)


def _poisoned(M, cols, dtype):
    if dtype == torch.int32:
        return torch.full((M, cols), -123456, dtype=torch.int32)
    return torch.full((M, cols), float("nan"), dtype=dtype)


def _counters_zero():
    return all(not bool(arrivals.any()) for _, arrivals in gemm_tma._SPLIT_WORKSPACE.values())


# fp32 out: the kernel's erf/exp differ from torch's in the last bits; bf16: one rounding.
RTOL = {torch.float32: 1e-4, torch.bfloat16: 2**-8}


def _assert_close(out, ref, out_dtype):
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements"
    torch.testing.assert_close(out.float(), ref.float(), rtol=RTOL[out_dtype], atol=1e-5)


# ---------------------------------------------------------------------------------------------- plan


def test_split_k_plan_clips_to_the_k_steps():
    plan = gemm_configs.split_k_plan
    assert plan(14336, 256, 8) == 8
    assert plan(4096, 512, 16) == 8  # 8 K steps: one per slice
    assert plan(208, 64, 3) == 3 and plan(208, 64, 8) == 4  # 4 steps, the last one masked
    assert plan(80, 64, 8) == 2
    assert plan(64, 64, 4) == 1 and plan(4096, 256, 1) == 1
    assert gemm_configs.split_k_programs(13, 70, 208, _config(8)) == (4, 8)  # 1 x 2 tiles x 4 slices
    assert gemm_configs.split_k_programs(100, 4096, 4096, {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}) == (1, 64)


@pytest.mark.parametrize("bad", [0, 17, 2.0, True, None])
def test_bad_split_k_raises_naming_the_value(bad):
    with pytest.raises(ValueError, match=f"SPLIT_K={bad!r}"):
        gemm_configs.split_k_plan(4096, 256, bad)
    a, a_scale, w, w_scale, _ = _operands(4, 64, torch.int8, seed=0)
    with pytest.raises(ValueError, match=f"SPLIT_K={bad!r}"):
        gemm.scaled_mm(a, w, a_scale, w_scale, config=_config(bad))


def test_every_slice_gets_at_least_one_k_step_and_all_steps_are_covered():
    # The kernel's slice bounds: [s * k_tiles // S, (s + 1) * k_tiles // S) with S from the plan.
    for k_tiles in range(1, 41):
        for requested in range(1, gemm_configs.MAX_SPLIT_K + 1):
            splits = gemm_configs.split_k_plan(64 * k_tiles, 64, requested)
            bounds = [(s * k_tiles // splits, (s + 1) * k_tiles // splits) for s in range(splits)]
            assert all(end > begin for begin, end in bounds), (k_tiles, requested)
            assert [k for b, e in bounds for k in range(b, e)] == list(range(k_tiles))


def test_split_configs_join_the_pool_by_m(monkeypatch):
    """The decode split set up to M = 16, the medium ones (swapped to 32, 64-row to 64), the
    128-row ones above that up to 256 (the 4-way one to 128), not gated and for outputs narrower
    than WIDE_SPLIT_MAX_N; none with the switch off."""
    configs = gemm._scaled_mm_autotuned.configs
    split = gemm_configs.SMALL_M_SPLIT_K_CONFIGS
    assert all(c in configs for c in split) and all(c.kwargs["SPLIT_K"] > 1 for c in split)
    assert gemm_configs.SMALL_M_SPLIT_K is True
    limit = gemm_configs.SPLIT_K_MAX_M
    # A power of two: the autotune key buckets M by powers of two, so one bucket never spans it.
    assert gemm_configs.m_bucket(limit) == limit
    assert limit == 64  # every decode size (M <= 16) since session 36, the medium ones since 38
    for M in (1, 3, 9, 16):
        assert gemm_configs._prune_configs(configs, {"M": M}) == gemm_configs.SMALL_M_CONFIGS + split
    assert gemm_configs._prune_configs(configs, {"M": 1, "GATED": True}) == gemm_configs.SMALL_M_CONFIGS + split
    medium, swapped = gemm_configs.MEDIUM_M_CONFIGS, gemm_configs.MEDIUM_M_SWAP_CONFIGS
    medium_split = gemm_configs.MEDIUM_M_SPLIT_K_CONFIGS
    for M in (17, 24, 32):  # the swapped 32-token ones, unsplit and split, and the 64-row split one
        assert gemm_configs._prune_configs(configs, {"M": M}) == medium + swapped + medium_split
    for M in (33, limit):
        assert gemm_configs._prune_configs(configs, {"M": M}) == medium + medium_split
    wide = gemm_configs.WIDE_M_SPLIT_K_CONFIGS
    assert wide and all(c in configs and c.kwargs["BLOCK_M"] == 128 and c.kwargs["SPLIT_K"] > 1 for c in wide)
    two_way = [c for c in wide if c.kwargs["SPLIT_K"] == 2]
    narrow, too_wide = gemm_configs.WIDE_SPLIT_MAX_N - 1, gemm_configs.WIDE_SPLIT_MAX_N
    for M, expected in ((limit + 1, wide), (128, wide), (129, two_way), (gemm_configs.MEDIUM_LARGE_MAX_M, two_way)):
        for args in ({"M": M}, {"M": M, "N": narrow}):
            pool = gemm_configs._prune_configs(configs, args)
            assert [c for c in pool if "SPLIT_K" in c.kwargs] == expected
        for args in ({"M": M, "GATED": True}, {"M": M, "N": too_wide}):
            assert not any("SPLIT_K" in c.kwargs for c in gemm_configs._prune_configs(configs, args))
    assert not any("SPLIT_K" in c.kwargs
                   for c in gemm_configs._prune_configs(configs, {"M": gemm_configs.MEDIUM_LARGE_MAX_M + 1}))
    monkeypatch.setattr(gemm_configs, "SMALL_M_SPLIT_K", False)
    assert gemm_configs._prune_configs(configs, {"M": 1}) == gemm_configs.SMALL_M_CONFIGS
    unsplit = [c for c in medium + swapped if "SPLIT_K" not in c.kwargs]
    assert gemm_configs._prune_configs(configs, {"M": 24}) == unsplit
    assert gemm_configs._prune_configs(configs, {"M": 64}) == medium
    assert gemm_configs._prune_configs(configs, {"M": 128}) == medium


def test_pool_families_follow_the_tuning_buckets():
    """Each autotune bucket of M (powers of two) gets one family: medium up to 128, medium + large
    for 129..256 (session 40), large above; gated calls keep tiles of at most 128 x 128."""
    configs = gemm._scaled_mm_autotuned.configs
    medium, large = gemm_configs.MEDIUM_M_CONFIGS, gemm_configs.LARGE_M_CONFIGS
    limit = gemm_configs.MEDIUM_LARGE_MAX_M
    assert gemm_configs.m_bucket(limit) == limit and gemm_configs.m_bucket(129) == limit
    wide = gemm_configs.WIDE_M_SPLIT_K_CONFIGS
    two_way = [c for c in wide if c.kwargs["SPLIT_K"] == 2]
    for M in (65, 100, 128):
        assert gemm_configs._prune_configs(configs, {"M": M}) == medium + wide
        assert gemm_configs._prune_configs(configs, {"M": M, "GATED": True}) == [
            c for c in medium if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128
            and gemm_configs.pipeline_shared_memory(c, True) <= gemm_configs.SHARED_MEMORY_LIMIT]
    signature = gemm_configs._signature
    both = medium + [c for c in large if signature(c) not in {signature(m) for m in medium}]
    assert len(both) == len({signature(c) for c in both}) > len(medium)  # each config timed once
    for M in (129, 192, 255, limit):
        assert gemm_configs._prune_configs(configs, {"M": M}) == both + two_way
        gated = gemm_configs._prune_configs(configs, {"M": M, "GATED": True})
        assert gated == [c for c in both if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128
                         and gemm_configs.pipeline_shared_memory(c, True) <= gemm_configs.SHARED_MEMORY_LIMIT]
        assert any(c in gated for c in medium) and any(c in gated for c in large)
    for M in (limit + 1, 512, 4096):
        assert gemm_configs._prune_configs(configs, {"M": M}) == large


def test_pools_leave_out_configs_over_the_shared_memory_limit():
    """The gated 64x128x256 s3 tile needs 3 x 80 KB of pipeline buffers on wgmma, over sm_90's
    227 KB, and never compiled (sessions 36-40): no pool times it gated; plain it fits and stays.
    16-row tiles keep one buffer less (mma.sync): the gated 16x128x256 s4 compiles and stays."""
    limit = gemm_configs.SHARED_MEMORY_LIMIT
    wide = next(c for c in gemm_configs.MEDIUM_M_CONFIGS if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"],
                                                             c.kwargs["BLOCK_K"], c.num_stages) == (64, 128, 256, 3))
    assert gemm_configs.pipeline_shared_memory(wide, gated=True) == 245760 > limit
    assert gemm_configs.pipeline_shared_memory(wide) == 147456
    decode = next(c for c in gemm_configs.SMALL_M_CONFIGS if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) == (128, 256))
    assert gemm_configs.pipeline_shared_memory(decode, gated=True) == 3 * 256 * (16 + 2 * 128) <= limit
    for M in (1, 16, 24, 64, 128, 192, 256, 512, 4096):
        for gated in (False, True):
            pool = gemm_configs.pool_configs(M, gated, split_k=True)
            assert pool and all(gemm_configs.pipeline_shared_memory(c, gated) <= limit for c in pool)
        assert (wide in gemm_configs.pool_configs(M)) == (wide in gemm_configs.MEDIUM_M_CONFIGS and 16 < M <= 256)
        assert wide not in gemm_configs.pool_configs(M, gated=True)
    assert decode in gemm_configs.pool_configs(1, gated=True)


def test_split_round_times_what_the_pool_admits_at_each_m(monkeypatch):
    """The split-K round (bench.gemm_splitk) times, at each of its M, the split configs the pool
    admits there, whatever the switch says now, and its M reach the top of each split range."""
    from quantkit.bench import gemm_splitk
    from quantkit.kernels.launch import config_dict

    def dicts(configs):
        return [config_dict(c) for c in configs]

    medium_split = gemm_configs.MEDIUM_M_SPLIT_K_CONFIGS
    swapped_split = [c for c in gemm_configs.MEDIUM_M_SWAP_CONFIGS if c.kwargs.get("SPLIT_K", 1) > 1]
    for switch in (True, False):
        monkeypatch.setattr(gemm_configs, "SMALL_M_SPLIT_K", switch)
        assert gemm_splitk.split_candidates(1) == dicts(gemm_configs.SMALL_M_SPLIT_K_CONFIGS)
        assert gemm_splitk.split_candidates(16, gated=True) == dicts(gemm_configs.SMALL_M_SPLIT_K_CONFIGS)
        assert gemm_splitk.split_candidates(32) == dicts(swapped_split + medium_split)
        assert gemm_splitk.split_candidates(64) == dicts(medium_split)
        wide = gemm_configs.WIDE_M_SPLIT_K_CONFIGS
        assert gemm_splitk.split_candidates(gemm_configs.SPLIT_K_MAX_M + 1) == dicts(wide)
        assert gemm_splitk.split_candidates(gemm_configs.MEDIUM_LARGE_MAX_M) == dicts(
            [c for c in wide if c.kwargs["SPLIT_K"] == 2])
        assert gemm_splitk.split_candidates(128, gated=True) == []
        assert gemm_splitk.split_candidates(gemm_configs.MEDIUM_LARGE_MAX_M + 1) == []
        assert gemm_configs.SMALL_M_SPLIT_K is switch  # restored
    assert len(swapped_split) == 2 and len(medium_split) == 1
    tops = {16, gemm_configs.SWAP_AB_MAX_M, gemm_configs.SPLIT_K_MAX_M}
    assert tops <= set(gemm_splitk.SPLIT_K_MS)


def test_split_verdict_ignores_points_where_both_picks_are_one_config():
    from quantkit.bench import gemm_splitk

    def point(M, off, on, ms_off, ms_on):
        base = {"kind": "plain", "N": 4096, "K": 4096, "M": M, "dtype": "fp8"}
        return [{**base, "op": "auto", "pick": off, "ms_flush": ms_off},
                {**base, "op": "auto_split_on", "pick": on, "ms_flush": ms_on},
                {**base, "op": "split a", "ms_flush": ms_on * 1.3}]

    gain = point(1, "a", "b S4", 0.0120, 0.0100)           # 1.20x where the split pick differs
    same = point(16, "c", "c", 0.0100, 0.0105)             # one config, 0.95x: noise
    summary = gemm_splitk.summarize(gain + same, ["flush"])
    assert summary["turn_on"] and [p["flush"]["on_vs_off"] for p in summary["points"]] == pytest.approx([1.2, 1 / 1.05])
    loss = point(32, "d", "d S2", 0.0100, 0.0105)          # a different pick 5 % slower: off
    assert not gemm_splitk.summarize(gain + same + loss, ["flush"])["turn_on"]
    assert not gemm_splitk.summarize(same, ["flush"])["turn_on"]  # no point where the picks differ


def test_gpu_check_lists_cover_the_pools():
    """The GPU checks' config lists are written out by hand (bench.gemm_splitk): every split config
    of ALL_CONFIGS is in the split checks, every swapped or split config in the promoted ones, and
    the standard run's shares of each (separate check processes) together cover its list once."""
    from quantkit.bench import gemm as bench_gemm
    from quantkit.bench import gemm_splitk
    from quantkit.kernels.launch import config_dict

    def names(configs):
        return [gemm_splitk.config_name(c) for c in configs]

    # The split checks cover every family's split configs: 16-, 32-, 64- and 128-row tiles.
    assert {c["BLOCK_M"] for c in gemm_splitk.pool_split_configs()} == {16, 32, 64, 128}
    special = [config_dict(c) for c in gemm.ALL_CONFIGS if c.kwargs.get("SPLIT_K", 1) > 1 or c.kwargs.get("SWAP_AB")]
    promoted = names(gemm_splitk.promoted_configs())
    assert set(names(special)) <= set(promoted) and len(set(promoted)) == len(promoted)
    for parts, configs in ((bench_gemm.PROMOTED_PARTS, gemm_splitk.promoted_configs()),
                           (bench_gemm.SPLIT_K_PARTS, gemm_splitk.pool_split_configs())):
        n = len(parts)
        assert n > 1 and set(parts) <= set(bench_gemm.CHECK_PARTS)
        assert sorted(name for i in range(n) for name in names(configs[i::n])) == sorted(names(configs))


# ---------------------------------------------------------------------------------------------- kernel


@pytest.mark.parametrize("swap", SWAPS)
@pytest.mark.parametrize("K,split_k,splits", K_CASES)
@pytest.mark.parametrize("M", M_VALUES)
def test_split_k_int8_accumulator_is_exact(M, K, split_k, splits, swap):
    assert gemm_configs.split_k_plan(K, 64, split_k) == splits
    a, _, w, _, _ = _operands(M, K, torch.int8, seed=M + K)
    acc = gemm.int8_matmul_accumulator(a, w, config=_config(split_k, swap), out=_poisoned(M, N, torch.int32))
    assert torch.equal(acc, reference.int8_matmul_exact(a, w))
    assert _counters_zero(), "the last slice of each tile resets its arrival counter"


@pytest.mark.parametrize("swap", SWAPS)
@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_split_k_every_epilogue(dtype, has_bias, activation, swap):
    M, K = 13, 208
    a, a_scale, w, w_scale, bias = _operands(M, K, dtype, seed=3)
    b = bias if has_bias else None
    out = gemm.scaled_mm(a, w, a_scale, w_scale, b, activation, torch.float32, config=_config(3, swap),
                         out=_poisoned(M, N, torch.float32))
    _assert_close(out, reference.scaled_mm(a, w, a_scale, w_scale, b, activation, torch.float32), torch.float32)
    assert _counters_zero()


@pytest.mark.parametrize("swap", SWAPS)
@pytest.mark.parametrize("K,split_k,splits", K_CASES)
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_split_k_out_dtypes_scalar_scales_and_repeat(dtype, M, K, split_k, splits, swap):
    a, a_scale, w, w_scale, bias = _operands(M, K, dtype, seed=7 * M + K)
    for out_dtype in (torch.bfloat16, torch.float32):
        outs = [gemm.scaled_mm(a, w, a_scale, w_scale, bias, "gelu_tanh", out_dtype, config=_config(split_k, swap),
                               out=_poisoned(M, N, out_dtype)) for _ in range(2)]
        ref = reference.scaled_mm(a, w, a_scale, w_scale, bias, "gelu_tanh", out_dtype)
        _assert_close(outs[0], ref, out_dtype)
        assert torch.equal(outs[0], outs[1]), "the slices are summed in slice order: the same bits every launch"
        assert _counters_zero()
    # Scalar (per-tensor) scales take the epilogue's other branch.
    sa, sw = a_scale.amax().reshape(1), w_scale[:1].clone()
    out = gemm.scaled_mm(a, w, sa, sw, None, "relu", torch.float32, config=_config(split_k, swap),
                         out=_poisoned(M, N, torch.float32))
    _assert_close(out, reference.scaled_mm(a, w, sa, sw, None, "relu", torch.float32), torch.float32)


@pytest.mark.parametrize("M", M_VALUES)
def test_split_k_int8_matches_the_unsplit_kernel_bit_for_bit(M):
    # Exact int32 sums and the same epilogue arithmetic: split and unsplit, swapped or not, agree
    # to the bit, and with a bf16 output and no activation, so does the reference.
    K = 208
    a, a_scale, w, w_scale, bias = _operands(M, K, torch.int8, seed=2 * M)
    outs = [gemm.scaled_mm(a, w, a_scale, w_scale, bias, "none", torch.bfloat16, config=_config(s, swap),
                           out=_poisoned(M, N, torch.bfloat16)) for s in (1, 3) for swap in (False, True)]
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    assert torch.equal(outs[0], reference.scaled_mm(a, w, a_scale, w_scale, bias, "none", torch.bfloat16))


@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("M", [100, 150])
def test_split_k_128_row_tiles(M, split_k):
    """The 128-row split tiles of 64 < M <= 256 (gemm_configs.WIDE_M_SPLIT_K_CONFIGS' shape, smaller
    K steps): one partial row tile at M = 100, two at 150 (the second 22 rows of 128), K = 208 in
    four steps with a masked tail. INT8 exact, FP8 within tolerance and the same bits twice."""
    config = {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": split_k, "num_warps": 4,
              "num_stages": 2}
    K = 208
    a, a_scale, w, w_scale, bias = _operands(M, K, torch.int8, seed=M + split_k)
    acc = gemm.int8_matmul_accumulator(a, w, config=config, out=_poisoned(M, N, torch.int32))
    assert torch.equal(acc, reference.int8_matmul_exact(a, w))
    assert _counters_zero()
    a, a_scale, w, w_scale, bias = _operands(M, K, torch.float8_e4m3fn, seed=M + split_k)
    outs = [gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu", torch.float32, config=config,
                           out=_poisoned(M, N, torch.float32)) for _ in range(2)]
    _assert_close(outs[0], reference.scaled_mm(a, w, a_scale, w_scale, bias, "silu", torch.float32), torch.float32)
    assert torch.equal(outs[0], outs[1]) and _counters_zero()


@pytest.mark.parametrize("swap", SWAPS)
@pytest.mark.parametrize("K,split_k,splits", K_CASES)
@pytest.mark.parametrize("M", [1, 13])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_split_k_gated(dtype, M, K, split_k, splits, swap):
    a, a_scale, w, w_scale, _ = _operands(M, K, dtype, seed=5 * M + K, rows=2 * N)
    out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32, config=_config(split_k, swap),
                               out=_poisoned(M, N, torch.float32))
    _assert_close(out, reference.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32), torch.float32)
    assert _counters_zero()
    unsplit = gemm.gated_scaled_mm(a, w, a_scale, w_scale, "silu", torch.float32, config=_config(1))
    if dtype == torch.int8:
        assert torch.equal(out, unsplit)
    else:
        # Another fp32 summation order over K: a few ulps of the accumulator.
        torch.testing.assert_close(out, unsplit, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("swap", SWAPS)
def test_split_k_gated_bf16_out_and_gelu(swap):
    M, K = 16, 208
    a, a_scale, w, w_scale, _ = _operands(M, K, torch.float8_e4m3fn, seed=9, rows=2 * N)
    out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, "gelu", torch.bfloat16, config=_config(4, swap),
                               out=_poisoned(M, N, torch.bfloat16))
    _assert_close(out, reference.gated_scaled_mm(a, w, a_scale, w_scale, "gelu", torch.bfloat16), torch.bfloat16)
    assert _counters_zero()


@pytest.mark.parametrize("last_slice", [0, 1])
def test_whichever_slice_arrives_last_combines_in_slice_order(last_slice):
    """The interpreter runs the slices of a tile in order, so slice S-1 always arrives last. A
    counter preloaded with S-1-s makes slice s the last arriver instead, while the slices after
    it still hold their partials of an identical first launch in their slots: the combine must
    take them in slice order and give the same bits."""
    M, K, S = 13, 208, 3
    a, a_scale, w, w_scale, bias = _operands(M, K, torch.float8_e4m3fn, seed=21)
    first = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu", torch.float32, config=_config(S))
    _, arrivals = gemm_tma._SPLIT_WORKSPACE[("cpu", None)]
    arrivals[:2] = S - 1 - last_slice  # both output tiles
    again = gemm.scaled_mm(a, w, a_scale, w_scale, bias, "silu", torch.float32, config=_config(S),
                           out=_poisoned(M, N, torch.float32))
    assert torch.equal(first, again)
    # Slice `last_slice` reset its tile's counter; the later slices counted from zero again.
    assert arrivals[:2].tolist() == [S - 1 - last_slice] * 2
    arrivals.zero_()


@pytest.mark.parametrize("index,requested,swap", [(3, 8, False), (-2, 4, True)], ids=["S8", "S4_swap_ab"])
def test_autotuner_path_clips_split_k_through_the_heuristic(monkeypatch, index, requested, swap):
    """triton's own Autotuner + Heuristics (one config: several do not run under the interpreter)
    around the kernel, as on the GPU's first call of a decode key: the config asks for 8 (4)
    slices, K = 1040 has 5 steps of 256, so the heuristic passes 5 (4), the grid launches 2 tiles
    x that many slices and the workspace fits; the cached plan of the next call clips the same way
    and keeps the config's SWAP_AB."""
    import triton

    config = gemm_configs.SMALL_M_SPLIT_K_CONFIGS[index]  # 16x64x256, SPLIT_K 8 / 4 swapped
    assert config.kwargs["SPLIT_K"] == requested and config.kwargs.get("SWAP_AB", False) is swap
    tuner = triton.autotune(configs=[config], key=["N", "K"])(
        triton.heuristics(gemm_configs.HEURISTICS)(gemm._scaled_mm_kernel))
    monkeypatch.setattr(gemm, "_scaled_mm_autotuned", tuner)
    monkeypatch.setattr(gemm, "INTERPRETED", False)  # the launcher's GPU path; the kernel still interprets
    monkeypatch.setattr(gemm, "_TUNED_TILED", {})
    monkeypatch.setattr(gemm, "_TILED_PLANS", {})
    monkeypatch.setattr(gemm_configs, "SMALL_M_SPLIT_K", True)
    M, K = 7, 1040  # M <= SPLIT_K_MAX_M: the pool (and so the workspace) has split configs
    a, _, w, _, _ = _operands(M, K, torch.int8, seed=4)
    ones = torch.ones(1)
    flags = (True, False, False, False, 0, True)  # INT8, scalar scales, no bias, no activation, raw accumulator
    for _ in range(2):  # the autotuner's launch, then the cached plan's
        out = gemm._launch_tiled(a, w, _poisoned(M, N, torch.int32), ones, ones, None, flags, False, False, None)
        assert torch.equal(out, reference.int8_matmul_exact(a, w))
        assert _counters_zero()
    (tuned,) = gemm._TUNED_TILED.values()
    (plan,) = gemm._TILED_PLANS.values()
    assert tuned["SPLIT_K"] == requested and plan[2]["SPLIT_K"] == min(requested, 5)
    assert plan[2]["SWAP_AB"] is swap


# ---------------------------------------------------------------------------------------------- swapped operands


def test_swap_ab_configs_are_decode_configs(monkeypatch):
    """SWAP_AB puts the tokens on the MMA's N side: only in the pools up to M = 32, with a 16-row
    token tile for M <= 16 and a 32-row one above, both unsplit and split (so the autotuner can
    pick either)."""
    configs = gemm._scaled_mm_autotuned.configs
    swapped = [c for c in configs if c.kwargs.get("SWAP_AB")]
    assert gemm_configs.SWAP_AB_MAX_M == gemm_configs.m_bucket(gemm_configs.SWAP_AB_MAX_M) == 32
    for M, block_m in ((16, 16), (32, 32)):
        pool = gemm_configs._prune_configs(configs, {"M": M})
        ours = [c for c in swapped if c.kwargs["BLOCK_M"] == block_m]
        assert ours and [c for c in pool if c.kwargs.get("SWAP_AB")] == ours
        assert {c.kwargs.get("SPLIT_K", 1) > 1 for c in ours} == {False, True}
    assert {c.kwargs["BLOCK_M"] for c in swapped} == {16, 32}
    for M in (33, 128, 129, 4096):
        assert not any(c.kwargs.get("SWAP_AB") for c in gemm_configs._prune_configs(configs, {"M": M}))
    assert gemm_configs.HEURISTICS["SWAP_AB"]({"BLOCK_K": 64}) is False
    assert gemm_configs.HEURISTICS["SWAP_AB"]({"BLOCK_K": 64, "SWAP_AB": True}) is True
    decode, medium = (gemm_configs._prune_configs(configs, {"M": M}) for M in (16, 24))
    monkeypatch.setattr(gemm_configs, "SMALL_M_SWAP_AB", False)  # the switch takes them out, nothing else
    assert gemm_configs._prune_configs(configs, {"M": 16}) == [c for c in decode if c not in swapped]
    assert gemm_configs._prune_configs(configs, {"M": 24}) == (gemm_configs.MEDIUM_M_CONFIGS
                                                               + gemm_configs.MEDIUM_M_SPLIT_K_CONFIGS)
    assert [c for c in medium if c.kwargs.get("SWAP_AB")] == gemm_configs.MEDIUM_M_SWAP_CONFIGS


def test_swap_ab_fuzz_random_shapes_tiles_and_flags():
    """60 seeded random calls (mostly decode sizes, some of several row tiles) through swapped
    configs of random tiles and splits, every dtype, scale kind, bias, activation, gating and output
    dtype, against the reference; INT8 raw accumulators exactly."""
    import random

    rng = random.Random(37)
    for case in range(60):
        dtype = rng.choice([torch.int8, torch.float8_e4m3fn])
        # Mostly decode sizes; every fifth case several row tiles (explicit configs take any M).
        M = rng.choice([20, 40]) if case % 5 == 4 else rng.choice([1, 2, 5, 9, 13, 16])
        n = rng.choice([1, 17, 40, 70, 96])
        K = 16 * rng.randint(1, 14)
        config = {"BLOCK_M": rng.choice([16, 32]), "BLOCK_N": rng.choice([16, 32, 64]),
                  "BLOCK_K": rng.choice([32, 64, 128]),
                  "GROUP_M": rng.choice([1, 4]), "SPLIT_K": rng.choice([1, 1, 2, 3, 5]), "SWAP_AB": True,
                  "num_warps": 4, "num_stages": 2}
        gated = rng.random() < 0.25
        activation = rng.choice(reference.ACTIVATIONS)
        out_dtype = rng.choice([torch.float32, torch.bfloat16])
        gen = torch.Generator().manual_seed(case)
        a, a_scale = reference.quantize_per_token(torch.randn(M, K, generator=gen) * 2, dtype)
        w, w_scale = reference.quantize_per_channel(torch.randn(2 * n if gated else n, K, generator=gen), dtype)
        if rng.random() < 0.3:
            a_scale = a_scale.amax().reshape(1)
        bias = torch.randn(n, generator=gen) if not gated and rng.random() < 0.5 else None
        ctx = f"case {case}: {dtype} M={M} N={n} K={K} {config} gated={gated} {activation} {out_dtype}"
        if dtype == torch.int8 and not gated and rng.random() < 0.3:
            acc = gemm.int8_matmul_accumulator(a, w, config=config, out=_poisoned(M, n, torch.int32))
            assert torch.equal(acc, reference.int8_matmul_exact(a, w)), ctx
            continue
        if gated:
            out = gemm.gated_scaled_mm(a, w, a_scale, w_scale, activation, out_dtype, config=config,
                                       out=_poisoned(M, n, out_dtype))
            ref = reference.gated_scaled_mm(a, w, a_scale, w_scale, activation, torch.float32)
        else:
            out = gemm.scaled_mm(a, w, a_scale, w_scale, bias, activation, out_dtype, config=config,
                                 out=_poisoned(M, n, out_dtype))
            ref = reference.scaled_mm(a, w, a_scale, w_scale, bias, activation, torch.float32)
        # ref in fp32: the kernel's one extra rounding is to out_dtype.
        assert not out.isnan().any(), ctx
        torch.testing.assert_close(out.float(), ref.float(), rtol=RTOL[out_dtype], atol=1e-5,
                                   msg=lambda m: f"{ctx}\n{m}")
        assert _counters_zero(), ctx
