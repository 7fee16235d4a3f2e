"""Test doubles for the GPU launch path (``launch.CachedLaunch``) on a CPU: a compiled kernel
that records its direct launches, a @triton.jit stand-in that records triton-path launches, and a
driver with a fixed device and stream. The GPU checks (benchmarks/gemm_launch.py) compare the two
paths bit for bit on real kernels."""


class FakeCompiled:
    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class RecordingKernel:
    """Stands in for a @triton.jit function: records triton-path launches, returns a compiled kernel."""

    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]
    __name__ = "fake_kernel"

    def __init__(self):
        self.compiled = FakeCompiled()
        self.triton_calls = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return self.compiled

        return launch_


class FakeDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234
