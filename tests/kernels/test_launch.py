"""The cached launch path (kernels/launch.py) and the cached weight TMA descriptors.

The cached path launches a compiled GPU kernel directly, which the CPU interpreter cannot do; these
tests drive it with a fake compiled kernel and check what it passes (argument order, constexpr
tail, key handling), and that everything else still goes through triton. The GPU check
(benchmarks/gemm_sweep.py --launch-check) compares the two paths bit for bit.
"""

import gc
import weakref

import pytest
import torch

from quantkit.kernels import gemm_tma, launch
from tests.kernels.fake_launch import FakeCompiled, RecordingKernel


def test_second_call_with_a_key_launches_the_compiled_kernel_directly(gpu_mode):
    kernel = RecordingKernel()
    cached = launch.CachedLaunch(kernel)
    x = object()
    cached(("k",), (7,), (x, 5), {"FLAG": True, "BLOCK": 64}, 4, 3)
    assert len(kernel.triton_calls) == 1 and not kernel.compiled.runs
    grid, args, kwargs = kernel.triton_calls[0]
    assert grid == (7,) and args == (x, 5) and kwargs == {"FLAG": True, "BLOCK": 64, "num_warps": 4, "num_stages": 3}

    cached(("k",), (9, 2), (x, 6), {"FLAG": True, "BLOCK": 64}, 4, 3)
    assert len(kernel.triton_calls) == 1
    # triton's convention: grid, stream, function, packed metadata, launch metadata, enter/exit
    # hooks, then every argument in signature order (constexprs too, by their names' order).
    (run,) = kernel.compiled.runs
    assert run[:9] == (9, 2, 1, 1234, "fn-handle", "packed", None, None, None)
    assert run[9:] == (x, 6, 64, True)

    cached(("other",), (1,), (x, 6), {"FLAG": False, "BLOCK": 64}, 4, 3)
    assert len(kernel.triton_calls) == 2


def test_triton_args_are_used_on_the_triton_path_only(gpu_mode):
    kernel = RecordingKernel()
    cached = launch.CachedLaunch(kernel)
    light, full = object(), object()
    for _ in range(2):
        cached(("k",), (1,), (light, 1), {"BLOCK": 8, "FLAG": False}, 4, 3, triton_args=lambda: (full, 1))
    assert kernel.triton_calls[0][1] == (full, 1)
    assert kernel.compiled.runs[0][9:] == (light, 1, 8, False)


def test_missing_constexpr_is_a_clear_error(gpu_mode):
    cached = launch.CachedLaunch(RecordingKernel())
    with pytest.raises(ValueError, match="missing \\['FLAG'\\]"):
        cached(("k",), (1,), (object(), 1), {"BLOCK": 8}, 4, 3)


def test_interpreter_launch_hook_and_disabled_cache_go_through_triton(gpu_mode, monkeypatch):
    kernel = RecordingKernel()
    cached = launch.CachedLaunch(kernel)
    monkeypatch.setattr(launch, "ENABLED", False)
    for _ in range(2):
        cached(("k",), (1,), (object(), 1), {"BLOCK": 8, "FLAG": False}, 4, 3)
    assert len(kernel.triton_calls) == 2 and not kernel.compiled.runs
    monkeypatch.setattr(launch, "ENABLED", True)
    hook = launch.knobs.runtime.launch_enter_hook
    assert not launch.launch_hooks_active()
    hook.add(print)  # a profiler's hook
    try:
        assert launch.launch_hooks_active()
        for _ in range(2):
            cached(("k",), (1,), (object(), 1), {"BLOCK": 8, "FLAG": False}, 4, 3)
    finally:
        hook.remove(print)
    assert len(kernel.triton_calls) == 4 and not kernel.compiled.runs


def test_int_spec_and_alignment():
    assert launch.int_spec(1) == (True, False, False)
    assert launch.int_spec(32) == (False, True, False)
    assert launch.int_spec(2**31) == (False, True, True)
    base = torch.empty(64, dtype=torch.int8)
    assert base.data_ptr() % 16 == 0
    assert launch.aligned(base, base[1:], base[16:]) == 0b010


@pytest.mark.parametrize("n", [1, 2, 3, 16, 17, 1000, 4096, 14336])
def test_host_cdiv_and_next_power_of_2_equal_tritons(n):
    import triton

    assert launch.next_power_of_2(n) == triton.next_power_of_2(n)
    for d in (1, 3, 16, 128):
        assert launch.cdiv(n, d) == triton.cdiv(n, d)


def test_weight_descriptor_is_cached_per_layout_and_holds_no_reference():
    w = torch.zeros(64, 32, dtype=torch.int8)
    first = gemm_tma.weight_descriptor(w, 64, 32)
    assert gemm_tma.weight_descriptor(w, 64, 32) is first
    assert first.base.data_ptr() == w.data_ptr() and first.shape == [64, 32] and first.strides == [32, 1]
    # Another box, or the same storage viewed with another shape, is another descriptor.
    assert gemm_tma.weight_descriptor(w, 32, 32) is not first
    other = w.view(32, 64)
    assert gemm_tma.weight_descriptor(other, 64, 32).shape == [32, 64]
    ref = weakref.ref(w)
    del w, other
    gc.collect()
    assert ref() is None, "the descriptor cache must not keep a replaced weight alive"


# ---------------------------------------------------------------------------------------------- GEMM launchers
# The GEMM launchers on the GPU path, driven with a counting fake kernel: for every config of
# every autotune set (persistent, persistent gated, tiled), INT8 and FP8, one launch goes through
# triton (compile or cache load) and every later launch with the same key is a direct launch.


class _CountingKernel:
    def __init__(self):
        self.triton_calls = 0
        self.compiled = FakeCompiled()

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.triton_calls += 1
            return self.compiled

        return launch_


@pytest.fixture
def gemm_gpu_mode(gpu_mode, monkeypatch):
    from quantkit.kernels import gemm

    monkeypatch.setattr(gemm, "INTERPRETED", False)
    monkeypatch.setattr(gemm_tma, "num_sms", lambda device_index: 132)
    for module, name in ((gemm_tma, "_TUNED"), (gemm_tma, "_PLANS"), (gemm, "_TUNED_TILED"), (gemm, "_TILED_PLANS")):
        monkeypatch.setattr(module, name, {})
    kernels = {}
    for module, name in ((gemm_tma, "_PERSISTENT"), (gemm, "_TILED")):
        cached = launch.CachedLaunch(getattr(module, name).kernel)
        cached.kernel = kernels[name] = _CountingKernel()
        monkeypatch.setattr(module, name, cached)
    return kernels


def _quantized(M, N, K, dtype):
    from quantkit.kernels import reference

    a, a_scale = reference.quantize_per_token(torch.randn(M, K), dtype)
    w, w_scale = reference.quantize_per_channel(torch.randn(N, K), dtype)
    return a, a_scale, w, w_scale


def _launches(kernel, fn, calls=3):
    before_triton, before_direct = kernel.triton_calls, len(kernel.compiled.runs)
    for _ in range(calls):
        fn()
    return kernel.triton_calls - before_triton, len(kernel.compiled.runs) - before_direct


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_every_autotune_config_launches_directly_after_the_first_call(gemm_gpu_mode, dtype):
    from quantkit.kernels import gemm
    from quantkit.kernels.launch import config_dict

    M, N, K = 2048, 512, 256
    flags = (dtype == torch.int8, True, True, False, 0, False)
    a, sa, w, sw = _quantized(M, N, K, dtype)
    _, _, w2, sw2 = _quantized(M, 2 * N, K, dtype)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    persistent = gemm_gpu_mode["_PERSISTENT"]
    for gated, configs, weight, scale in ((False, gemm_tma.PERSISTENT_CONFIGS, w, sw),
                                          (True, gemm_tma.GATED_CONFIGS, w2, sw2)):
        for c in configs:
            assert _launches(persistent, lambda: gemm_tma.launch_persistent(
                a, weight, out, sa, scale, None, flags, 2048, True, False, config=config_dict(c), gated=gated)
            ) == (1, 2), (gated, c)
    tiled = gemm_gpu_mode["_TILED"]
    seen = set()
    for c in gemm.ALL_CONFIGS:  # the split-K configs too
        cfg = config_dict(c)
        new = str(cfg) not in seen
        seen.add(str(cfg))
        assert _launches(tiled, lambda: gemm._launch_tiled(
            a[:100], w, torch.empty(100, N, dtype=torch.bfloat16), sa[:100], sw, None, flags, False, True, cfg)
        ) == (int(new), 3 - int(new)), c


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_tuned_plain_calls_launch_directly(gemm_gpu_mode, dtype):
    """The eager path: a tuning key's autotuned config (planted here, as the autotuner leaves it)
    -> launch plan -> one triton launch, then direct launches, for each config of the set."""
    from quantkit.kernels import gemm
    from quantkit.kernels.launch import config_dict

    M, N, K = 2048, 512, 256
    a, sa, w, sw = _quantized(M, N, K, dtype)
    persistent = gemm_gpu_mode["_PERSISTENT"]
    for c in gemm_tma.PERSISTENT_CONFIGS:
        gemm_tma._TUNED.clear()
        gemm_tma._PLANS.clear()
        gemm_tma._PERSISTENT.compiled.clear()
        flags = (dtype == torch.int8, True, True, False, 0, False)
        tune_key = (N, K, gemm.m_bucket(M), flags, False, torch.bfloat16, False, dtype != torch.int8, dtype,
                    torch.float32)
        gemm_tma._TUNED[tune_key] = config_dict(c)
        # gemm.scaled_mm after its validation (which wants CUDA tensors outside the interpreter).
        assert _launches(persistent, lambda: gemm._launch(a, w, sa, sw, None, torch.empty(M, N, dtype=torch.bfloat16),
                                                          "none", gated=False, raw_acc=False)) == (1, 2), c
        assert list(gemm_tma._PLANS) == [tune_key]


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_split_tail_plan_is_part_of_the_launch_key(gemm_gpu_mode, dtype):
    """Two M of one autotune bucket, one with a split tail and one without: each gets its own
    compiled variant (TAIL_SPLITS is a constexpr), and the split one gets the workspace."""
    from quantkit.kernels.launch import config_dict

    N, K = 16384, 256
    config = config_dict(gemm_tma._cfg(128, 256, 128, 8, 4, split=4, tail_split=2))
    flags = (dtype == torch.int8, True, True, False, 0, False)
    persistent = gemm_gpu_mode["_PERSISTENT"]
    seen = {}
    for M in (2048, 1025):  # 1024 tiles = 7 waves + 100 on 132 SMs (no split); 576 = 4 waves + 48 (2 slices)
        splits = gemm_tma.tail_split_plan(M, N, K, 128, 256, 128, 132, 2)
        a, sa, w, sw = _quantized(M, N, K, dtype)
        out = torch.empty(M, N, dtype=torch.bfloat16)
        assert _launches(persistent, lambda: gemm_tma.launch_persistent(
            a, w, out, sa, sw, None, flags, 2048, True, False, config=config)) == (1, 2), M
        args = persistent.compiled.runs[-1][9:]  # after grid, stream, function, metadata, hooks
        seen[M] = (splits, args)
    assert seen[2048][0] == 1 and seen[1025][0] == 2
    partials, arrivals = gemm_tma._SPLIT_WORKSPACE[("cpu", None)]
    assert partials.numel() >= 132 * 128 * 256 and not arrivals.any()
    # Passed to both (unused without a split): one pointer signature for the autotuner and the plans.
    # (The workspace grew for the split launch: the first launch got the smaller, retired one.)
    partials_dtype = torch.int32 if dtype == torch.int8 else torch.float32
    for M, (_, args) in seen.items():
        assert (args[6].dtype, args[7].dtype) == (partials_dtype, torch.int32), M
    assert seen[1025][1][7] is arrivals


def test_autotuner_path_sizes_the_split_workspace_and_grid(gemm_gpu_mode):
    """The autotuner's first call per key: every config of a set with a split config gets a
    workspace big enough for it and a grid from the same plan the cached launches use."""
    M, N, K = 1024, 6144, 4096  # 128x256 tiles: 1 wave + 60 on 132 SMs
    a, sa, w, sw = _quantized(M, N, K, torch.int8)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    configs = [gemm_tma._cfg(128, 256, 128, 8, 4, split=4, tail_split=4), gemm_tma._cfg(128, 128, 128, 4, 3, ctas=2)]
    calls = []

    class FakeTuner:
        def __init__(self):
            self.configs = configs
            self.best_config = configs[0]

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                calls.append((grid, args, kwargs))
            return run

    flags = (True, True, True, False, 0, False)
    gemm_tma._autotune_and_launch(FakeTuner(), a, w, out, sa, sw, sa, M, N, K, 1024, 132,
                                  dict(zip(gemm_tma.FLAG_NAMES, flags), NUM_SMS=132))
    (grid, args, kwargs), = calls
    partials, arrivals = args[6], args[7]
    assert partials.dtype == torch.int32 and partials.numel() >= 132 * 128 * 256 and arrivals.numel() >= 132
    assert not arrivals.any()
    meta = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "CTAS_PER_SM": 1, "TAIL_SPLIT": 4}
    assert grid(meta) == (132,)  # 192 tiles: programs 0..119 also take the 60 tail tiles' 2 slices
    assert gemm_tma._tail_splits({"M": M, "N": N, "K": K, "NUM_SMS": 132, **meta}) == 2
    assert grid({**meta, "BLOCK_N": 128, "CTAS_PER_SM": 2, "TAIL_SPLIT": 1}) == (264,)


def test_tiled_split_k_launch_grid_workspace_and_key(gemm_gpu_mode):
    """A split config launches tiles x slices programs with the workspace (one slot per program,
    gate and up partials when gated); the slice count is a constexpr of its own compiled variant."""
    from quantkit.kernels import gemm
    from quantkit.kernels.launch import config_dict

    tiled = gemm_gpu_mode["_TILED"]
    M, N, K = 1, 4096, 14336
    a, sa, w, sw = _quantized(M, N, K, torch.int8)
    flags = (True, True, True, False, 0, False)
    unsplit = config_dict(gemm.SMALL_M_CONFIGS[2])  # 16x64x256
    split = config_dict(gemm.SMALL_M_SPLIT_K_CONFIGS[3])  # 16x64x256, SPLIT_K 8
    assert {k: v for k, v in split.items() if k != "SPLIT_K"} == unsplit
    # The swapped decode configs: the same tiles, SWAP_AB=True reaches the kernel as a constexpr.
    swapped = config_dict(gemm.SMALL_M_CONFIGS[-1])  # 16x64x256, swapped
    swapped_split = config_dict(gemm.SMALL_M_SPLIT_K_CONFIGS[-2])  # 16x64x256, SPLIT_K 4, swapped
    assert swapped == {**unsplit, "SWAP_AB": True} and swapped_split == {**split, "SPLIT_K": 4, "SWAP_AB": True}
    for gated, weight, scale in ((False, w, sw), (True, torch.cat([w, w]), torch.cat([sw, sw]))):
        for cfg, programs in ((unsplit, 64), (split, 64 * 8), (swapped, 64), (swapped_split, 64 * 4)):
            out = torch.empty(M, N, dtype=torch.bfloat16)
            assert _launches(tiled, lambda: gemm._launch_tiled(a, weight, out, sa, scale, None, flags, gated, False,
                                                               cfg)) == (1, 2), (gated, cfg)
            run = tiled.compiled.runs[-1]
            assert run[:3] == (programs, 1, 1)
            partials, arrivals, constexpr_split, swap_ab = run[9 + 6], run[9 + 7], run[-2], run[-1]
            assert constexpr_split == cfg.get("SPLIT_K", 1) and swap_ab is cfg.get("SWAP_AB", False)
            assert partials.dtype == torch.int32 and arrivals.dtype == torch.int32
            if cfg.get("SPLIT_K", 1) > 1:
                slot = (2 if gated else 1) * 16 * 64
                assert partials.numel() >= programs * slot and arrivals.numel() >= programs
    # A K too short for 8 slices: the plan's count (2) reaches the kernel and the grid.
    a2, sa2, w2, sw2 = _quantized(M, N, 512, torch.int8)
    assert _launches(tiled, lambda: gemm._launch_tiled(a2, w2, torch.empty(M, N, dtype=torch.bfloat16), sa2, sw2,
                                                       None, flags, False, False, split)) == (1, 2)
    run = tiled.compiled.runs[-1]
    assert run[0] == 64 * 2 and run[-2] == 2


def _fresh_split_workspace(monkeypatch):
    """The split workspace is one growing buffer per device: start from none, so a size assertion
    sees what this launch asked for, not what an earlier test left."""
    for name in ("_SPLIT_WORKSPACE", "_NO_SPLIT_ARGS"):
        monkeypatch.setattr(gemm_tma, name, {})
    monkeypatch.setattr(gemm_tma, "_RETIRED_WORKSPACES", [])


def test_tiled_autotuner_path_sizes_the_split_workspace(gemm_gpu_mode, monkeypatch):
    """With SMALL_M_SPLIT_K on, the autotuner's first call for a decode key gets a workspace for
    the largest split config of its pool and a grid of tiles x slices; off, no split workspace."""
    from quantkit.kernels import gemm, gemm_configs

    _fresh_split_workspace(monkeypatch)
    calls = []

    class FakeTuner:
        configs = gemm.ALL_CONFIGS
        best_config = gemm.SMALL_M_SPLIT_K_CONFIGS[0]

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(gemm, "_scaled_mm_autotuned", FakeTuner())
    monkeypatch.setattr(gemm_configs, "SMALL_M_SPLIT_K", True)
    M, N, K = 1, 4096, 14336
    a, sa, w, sw = _quantized(M, N, K, torch.float8_e4m3fn)
    flags = (False, True, True, False, 0, False)
    gemm._launch_tiled(a, w, torch.empty(M, N, dtype=torch.bfloat16), sa, sw, None, flags, False, True, None)
    (grid, args, kwargs), = calls
    partials, arrivals = args[6], args[7]
    # Largest need of the pool: 16x32x512 with 8 slices = 1024 programs of 512 elements.
    assert partials.dtype == torch.float32 and partials.numel() >= 1024 * 16 * 32 and arrivals.numel() >= 1024
    assert grid({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 8}) == (512,)
    assert grid({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256}) == (64,)
    assert gemm._TUNED_TILED and list(gemm._TUNED_TILED.values())[0]["SPLIT_K"] == 4


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("M,best,programs,elements", [
    # 17 <= M <= 32: the swapped 32x64x256 S4 has the most programs (64 N tiles x 4), and it and
    # the 64x64x256 S2 need the most partial elements (256 x 32 x 64 = 128 x 64 x 64).
    (24, -1, 256, 256 * 32 * 64),
    # 33 <= M <= 64: only the 64-row 2-way split config.
    (48, 0, 128, 128 * 64 * 64),
])
def test_tiled_autotuner_path_sizes_the_medium_split_workspace(gemm_gpu_mode, monkeypatch, M, best, programs,
                                                               elements, gated):
    """The medium pools' split configs (session 38) get a workspace sized for the largest of them
    at the tuning key's M (gated: two partial tiles per program), as the decode pool's do."""
    from quantkit.kernels import gemm, gemm_configs

    _fresh_split_workspace(monkeypatch)
    requests, calls = [], []
    ask = gemm_tma._workspace_args
    monkeypatch.setattr(gemm_tma, "_workspace_args",
                        lambda a, slots, tile_elems: requests.append((slots, tile_elems)) or ask(a, slots, tile_elems))
    pick = (gemm_configs.MEDIUM_M_SWAP_CONFIGS if best < 0 else gemm_configs.MEDIUM_M_SPLIT_K_CONFIGS)[best]

    class FakeTuner:
        configs = gemm.ALL_CONFIGS
        best_config = pick

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(gemm, "_scaled_mm_autotuned", FakeTuner())
    N, K = 4096, 14336
    a, sa, w, sw = _quantized(M, 2 * N if gated else N, K, torch.int8)
    flags = (True, True, True, False, 2 if gated else 0, False)
    out = torch.empty(M, N, dtype=torch.bfloat16)
    gemm._launch_tiled(a, w, out, sa, sw, None, flags, gated, False, None)
    (grid, args, kwargs), = calls
    (slots, tile_elems), = requests
    copies = 2 if gated else 1
    assert slots == programs and slots * tile_elems == copies * elements
    assert args[6].dtype == torch.int32 and args[6].numel() >= copies * elements
    assert grid(pick.all_kwargs()) == (launch.cdiv(M, pick.kwargs["BLOCK_M"]) * (N // 64) * pick.kwargs["SPLIT_K"],)


def test_autotune_timer_uses_graph_replay_and_falls_back_to_do_bench(monkeypatch):
    import triton.testing

    eager = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: eager.append(kw) or [7.0, 7.0, 7.0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(gemm_tma, "_graph_bench_ms", lambda fn: 0.025)
    # The autotuner asks for quantiles (0.5, 0.2, 0.8) and compares the lists.
    assert gemm_tma._autotune_bench(lambda: None, quantiles=(0.5, 0.2, 0.8)) == [0.025] * 3
    assert gemm_tma._autotune_bench(lambda: None) == 0.025 and not eager

    def refused(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(gemm_tma, "_graph_bench_ms", refused)
    assert gemm_tma._autotune_bench(lambda: None, quantiles=(0.5, 0.2, 0.8)) == [7.0] * 3
    assert len(eager) == 1
    # Inside the caller's capture every timer would break it: a clear error instead.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(gemm_tma, "_graph_bench_ms", lambda fn: pytest.fail("no capture inside a capture"))
    with pytest.raises(RuntimeError, match="warm-up call"):
        gemm_tma._autotune_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))
    assert len(eager) == 1


class _OnGpu1(torch.Tensor):
    """A CPU tensor that reports GPU 1: what a model on cuda:1 hands a launcher."""

    def get_device(self):
        return 1


def _devices_entered(monkeypatch, current: int) -> list:
    entered = []

    class _Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append(-self.index)

    monkeypatch.setattr(launch, "current_gpu", lambda: current)
    monkeypatch.setattr(torch.cuda, "device", _Device)
    return entered


def test_a_launcher_runs_with_its_tensors_gpu_current(monkeypatch):
    entered = _devices_entered(monkeypatch, current=0)
    seen = []

    @launch.on_its_gpu
    def launcher(x, y, scale=1.0):
        """doc"""
        seen.append((list(entered), y, scale))
        return y * scale

    x = torch.randn(3).as_subclass(_OnGpu1)
    assert launcher(x, 2, scale=3.0) == 6.0
    assert seen == [([1], 2, 3.0)] and entered == [1, -1]  # inside cuda:1's context, left after
    assert launcher.__doc__ == "doc" and launcher.__name__ == "launcher"


def test_a_launcher_on_the_current_gpu_or_the_cpu_enters_nothing(monkeypatch):
    entered = _devices_entered(monkeypatch, current=1)

    @launch.on_its_gpu
    def launcher(x):
        return "ran"

    assert launcher(torch.randn(2).as_subclass(_OnGpu1)) == "ran" and entered == []
    monkeypatch.setattr(launch, "current_gpu", lambda: pytest.fail("a CPU tensor asks for no GPU"))
    assert launcher(torch.randn(2)) == "ran" and entered == []
    assert launcher("not a tensor") == "ran"  # left for the launcher's own check to refuse


@pytest.mark.parametrize("count,current,expected", [(1, None, 0), (2, 1, 1), (4, 0, 0)])
def test_the_current_gpu_is_asked_only_where_the_process_sees_more_than_one(monkeypatch, count, current, expected):
    monkeypatch.setattr(launch, "_ONE_GPU", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append(current) or current)
    assert [launch.current_gpu(), launch.current_gpu()] == [expected, expected]
    assert asked == ([] if count == 1 else [current, current])  # settled once, asked on every call


def test_every_public_launcher_runs_on_its_tensors_gpu():
    from quantkit.kernels import attention, attention_decode, gemm, kv_cache, moe, norm, quant, rope

    launchers = [gemm.scaled_mm, gemm.gated_scaled_mm, moe.plan_for, moe.grouped_scaled_mm, moe.gather_slots,
                 moe.grouped_slot_mm, moe.combine, quant.quantize_per_token, quant.quantize_per_tensor,
                 quant.rms_norm_quant_per_token, attention.flash_attention, attention.decode_attention,
                 attention_decode.decode_attention, rope.apply_rope, kv_cache.write_kv_cache, norm.rms_norm,
                 norm.layer_norm]
    assert [f.__name__ for f in launchers if f.__code__ is not launch.on_its_gpu(lambda x: x).__code__] == []
