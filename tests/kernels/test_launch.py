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


class _FakeCompiled:
    def __init__(self):
        self.runs = []
        self.function = "fn-handle"
        self.packed_metadata = "packed"

    def run(self, *args):
        self.runs.append(args)


class _FakeKernel:
    """Stands in for a @triton.jit function: records triton-path launches, returns a compiled kernel."""

    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]
    __name__ = "fake_kernel"

    def __init__(self):
        self.compiled = _FakeCompiled()
        self.triton_calls = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return self.compiled

        return launch_


class _FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def gpu_mode(monkeypatch):
    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_driver", lambda: _FakeDriver())


def test_second_call_with_a_key_launches_the_compiled_kernel_directly(gpu_mode):
    kernel = _FakeKernel()
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
    kernel = _FakeKernel()
    cached = launch.CachedLaunch(kernel)
    light, full = object(), object()
    for _ in range(2):
        cached(("k",), (1,), (light, 1), {"BLOCK": 8, "FLAG": False}, 4, 3, triton_args=lambda: (full, 1))
    assert kernel.triton_calls[0][1] == (full, 1)
    assert kernel.compiled.runs[0][9:] == (light, 1, 8, False)


def test_missing_constexpr_is_a_clear_error(gpu_mode):
    cached = launch.CachedLaunch(_FakeKernel())
    with pytest.raises(ValueError, match="missing \\['FLAG'\\]"):
        cached(("k",), (1,), (object(), 1), {"BLOCK": 8}, 4, 3)


def test_interpreter_launch_hook_and_disabled_cache_go_through_triton(gpu_mode, monkeypatch):
    kernel = _FakeKernel()
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
