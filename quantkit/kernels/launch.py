"""Lean eager launches: a @triton.jit kernel's compiled binary cached per key and launched directly.

``kernel[grid](*args, **constexprs)`` re-derives on every call what our launchers already know:
it binds the arguments and specializes each integer and pointer (alignment, == 1, % 16), hashes
the specialization into a cache key, checks the kernel's globals, builds launch metadata, and
(through ``triton.autotune`` / ``triton.heuristics``) rebuilds argument dicts and the autotune
key. Measured on an H100 host (benchmarks/NOTES-e2e.md): ~50 us per launch of the ~23-argument
GEMM, ~111 us with the autotuner, against ~10-20 us of GPU time per kernel in an eager prefill.

``CachedLaunch`` keeps the ``CompiledKernel`` that the first ``kernel[grid](...)`` call for a key
returned and launches it afterwards with triton's own argument convention (the grid, the current
stream, the function handle, the packed metadata, hooks, then every bound argument in signature
order, constexprs included: ``JITFunction.run`` and ``CompiledKernel[grid]`` on triton 3.6 and
3.9). The caller's key must determine the compiled binary: constexprs and launch options, tensor
dtypes and 16-byte alignment of every pointer, and every integer argument triton specializes
(its value, or ``int_spec`` of it for ``do_not_specialize`` ones and values that vary per call);
``CachedLaunch`` adds the current device. A key a call has never seen goes through triton
(compiling if needed). Skipped on the cached path: triton's check that module globals a kernel
read at compile time are unchanged (quantkit's kernels read only constants).

Under the interpreter (``TRITON_INTERPRET=1``, the CPU tests) ``kernel[grid]`` returns no
compiled kernel, so every call goes through triton; with a profiler's launch hook installed
(``knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``) too, so it sees every launch with
its metadata; otherwise the cached path passes no launch metadata and no hooks (triton itself
builds the metadata and calls its empty hook chains on every launch).
"""

from __future__ import annotations

import functools
import os
import statistics

import torch
from triton import knobs

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Shared memory a block may opt into on sm_90 (227 KB): the GPUs the GEMM configs are tuned for.
SHARED_MEMORY_LIMIT = 232448

# Set to False to send every launch through triton's own path (benchmarks compare the two).
ENABLED = True

# Programmatic dependent launch (PDL), on by default on sm_90+ GPUs: the GEMV, the quantization
# kernels (per-token, RMSNorm + quantization), RoPE, the KV-cache write and decode attention launch
# with triton's ``launch_pdl``, so that each may be scheduled while the kernel before it still
# runs. Each first waits for that kernel to finish (griddepcontrol.wait), then releases the next
# one (``dependent_launch``): every load and store stays ordered after the kernels before, as
# without PDL, and what overlaps is the next kernel's launch with this one's work. Decode at batch
# 1 on an H200: 1.08x per token (benchmarks/NOTES-gemm.md, session 45). QUANTKIT_PDL=0 turns it
# off, =1 asks for it (an error before sm_90); unset, it is on where the GPU has it. Each GPU of the
# process is asked at its first launch (a host may mix generations: the wait does not compile
# before sm_90).
_PDL_VALUES = ("", "0", "1")
_PDL_VALUE = os.environ.get("QUANTKIT_PDL", "")
# True / False forces PDL on / off for every GPU of the process (benchmarks toggle it); None: per
# GPU, from QUANTKIT_PDL and its compute capability (``pdl_enabled``). Always off under the
# interpreter.
PDL: bool | None = False if INTERPRETED else None
# Resolved settings by CUDA device index.
_PDL_BY_DEVICE: dict[int, bool] = {}


def _resolve_pdl(value: str, device: int | None) -> bool:
    """PDL for CUDA device ``device`` (None: the process has no CUDA GPU)."""
    if value not in _PDL_VALUES:
        raise ValueError(f"QUANTKIT_PDL={value!r}: set it to 1 (programmatic dependent launch on), 0 (off), or "
                         f"leave it unset (on where the GPU has it, sm_90+)")
    if value == "0":
        return False
    if device is None:
        if value == "1":
            raise ValueError("QUANTKIT_PDL=1 needs a CUDA GPU (sm_90 or newer) and none is available: unset "
                             "QUANTKIT_PDL")
        return False
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 9:
        return True
    if value == "1":
        raise ValueError(f"QUANTKIT_PDL=1 needs an sm_90 or newer GPU (Hopper); GPU {device} is sm_{major}{minor}: "
                         f"unset QUANTKIT_PDL")
    return False


_ONE_GPU: bool | None = None  # whether the process sees exactly one CUDA GPU; set by the first current_gpu()


def current_gpu() -> int:
    """The current CUDA device's index, for the per-launch paths (call only where CUDA is available).
    A process that sees one GPU always has GPU 0 current, and there it is answered without asking:
    ``torch.cuda.current_device()`` took 0.3-0.7 µs a call on the H200 hosts measured, asked twice
    per launch (the device guard and ``pdl_enabled``; ``benchmarks/launch_guard_cost.py``)."""
    global _ONE_GPU
    if _ONE_GPU is None:
        _ONE_GPU = torch.cuda.device_count() == 1
    return 0 if _ONE_GPU else torch.cuda.current_device()


def pdl_enabled() -> bool:
    """Whether launches on the current GPU use PDL: ``PDL`` where set, else resolved from
    QUANTKIT_PDL and the GPU's compute capability by its first launch that asks (a bad value is a
    ValueError there)."""
    if PDL is not None:
        return PDL
    if not _PDL_BY_DEVICE and not torch.cuda.is_available():
        return _resolve_pdl(_PDL_VALUE, None)
    device = current_gpu()
    enabled = _PDL_BY_DEVICE.get(device)
    if enabled is None:
        enabled = _PDL_BY_DEVICE[device] = _resolve_pdl(_PDL_VALUE, device)
    return enabled


def pdl_name() -> str:
    """"on" or "off" on the current GPU, for result files (without CUDA, "off")."""
    if PDL is None and not _PDL_BY_DEVICE and not torch.cuda.is_available():
        return "off"
    return "on" if pdl_enabled() else "off"


def pdl_options(pdl: bool, options: dict | None = None) -> dict | None:
    """``options`` with triton's ``launch_pdl`` added when ``pdl`` (``pdl_enabled()``): a kernel's
    PDL constexpr (its wait) and its early launch must always travel together."""
    if not pdl:
        return options
    return {**(options or {}), "launch_pdl": True}


def int_spec(value: int) -> tuple[bool, bool, bool]:
    """What triton's specialization of an integer argument depends on: == 1, % 16 == 0, needs int64."""
    return value == 1, value % 16 == 0, not -(2**31) <= value < 2**31


def aligned(*tensors) -> int:
    """Bit i set when pointer i is not 16-byte aligned (triton specializes pointers on it)."""
    bits = 0
    for i, t in enumerate(tensors):
        if t.data_ptr() % 16:
            bits |= 1 << i
    return bits


# Plain-Python twins of triton.cdiv / triton.next_power_of_2 for the launchers: triton's are
# ``constexpr_function`` wrappers (usable inside kernels) that cost microseconds per host call.
def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n, for n >= 1."""
    return 1 << (n - 1).bit_length()


def _hook_active(hook) -> bool:
    # triton >= 3.4 keeps an always-present HookChain (a list of callables) in knobs; earlier
    # versions a plain callable or None.
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


def launch_hooks_active() -> bool:
    """True while a profiler (or anything else) hooks kernel launches: then triton's path runs."""
    return _hook_active(knobs.runtime.launch_enter_hook) or _hook_active(knobs.runtime.launch_exit_hook)


def _driver():
    from triton.runtime import driver

    return driver.active


class CachedLaunch:
    """Launch ``kernel`` (a ``@triton.jit`` function) through a per-key cache of compiled kernels."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict = {}
        self._arg_names = list(kernel.arg_names)
        self._stream_of = None
        self._current_device = None

    def _constexpr_tail(self, n_args: int, constexprs: dict) -> tuple:
        names = self._arg_names[n_args:]
        missing = [name for name in names if name not in constexprs]
        if missing:
            raise ValueError(f"{self.kernel.__name__}: pass every argument after the first {n_args} by name; "
                             f"missing {missing}")
        return tuple(constexprs[name] for name in names)

    def __call__(self, key, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int,
                 triton_args=None, options: dict | None = None) -> None:
        """Launch on ``grid`` (a 1-3 tuple). ``args`` are the positional runtime arguments, in
        signature order, ``constexprs`` every later argument by name. ``triton_args`` (a
        callable returning a tuple like ``args``) builds the arguments for triton's own path
        when they must differ from the cached path's, e.g. validated ``TensorDescriptor``s
        where the cached path passes lighter objects with the same fields. ``options``: further
        compile options for triton's path (e.g. ``enable_fp_fusion``); like num_warps and
        num_stages they are part of the compiled binary, so the key must determine them."""
        if not ENABLED or INTERPRETED or key is None:
            self.kernel[grid](*(triton_args() if triton_args else args), **constexprs, num_warps=num_warps,
                              num_stages=num_stages, **(options or {}))
            return
        if self._stream_of is None:
            drv = _driver()
            self._stream_of = drv.get_current_stream
            self._current_device = drv.get_current_device
        device = self._current_device()
        entry = self.compiled.get((device, key))
        if entry is not None and not launch_hooks_active():
            compiled, tail = entry
            grid_1 = grid[1] if len(grid) > 1 else 1
            grid_2 = grid[2] if len(grid) > 2 else 1
            # launch metadata, enter hook, exit hook: none (launch_hooks_active() is False).
            compiled.run(grid[0], grid_1, grid_2, self._stream_of(device), compiled.function,
                         compiled.packed_metadata, None, None, None, *args, *tail)
            return
        compiled = self.kernel[grid](*(triton_args() if triton_args else args), **constexprs, num_warps=num_warps,
                                     num_stages=num_stages, **(options or {}))
        if hasattr(compiled, "packed_metadata"):
            self.compiled[(device, key)] = (compiled, self._constexpr_tail(len(args), constexprs))


def on_its_gpu(launcher):
    """Decorator for the public launchers: run ``launcher`` with the GPU of its first argument (a
    tensor) current.

    triton launches on the current GPU and its current stream, and a model may sit on another GPU
    than the current one (``quantkit.load(path, device="cuda:1")``, a model dispatched over two
    GPUs): its kernels would run on the wrong GPU, on a stream not ordered after the one that wrote
    their inputs. Where the tensor is on the current GPU (or the CPU, under the interpreter) this
    costs a device-index comparison and a Python frame per call; anything but a tensor goes
    through untouched, for the launcher's own check to refuse."""

    @functools.wraps(launcher)
    def run(x, *args, **kwargs):
        index = x.get_device() if isinstance(x, torch.Tensor) else -1
        if index < 0 or index == current_gpu():
            return launcher(x, *args, **kwargs)
        with torch.cuda.device(index):
            return launcher(x, *args, **kwargs)

    return run


def check_runnable(t: torch.Tensor, name: str) -> None:
    """The Triton launchers' device check: CUDA tensors, or any tensor under the interpreter."""
    if t.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"the Triton kernels need CUDA tensors ({name} is on {t.device}); use backend='torch' on CPU "
            "or set TRITON_INTERPRET=1 before importing quantkit"
        )


def config_dict(config) -> dict:
    """A ``triton.Config`` as the explicit-config dict our launchers take (kwargs + warps/stages)."""
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


_SIDE_STREAMS: dict = {}


def side_stream(device=None) -> "torch.cuda.Stream":
    """One side stream per CUDA device for warm-ups before graph captures, shared by every caller:
    each new stream from torch's pool gets its own cuBLAS workspace (32 MiB on Hopper, e.g. for a
    bf16 lm_head) that stays allocated, so a fresh stream per capture grows the process's memory
    with every one (a stream per generate() call once reached 1 GiB)."""
    index = None if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[index]


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """``fn()`` captured in a CUDA graph, after one warm-up call on a side stream (lazily made
    workspaces, cuBLAS handles and compiled kernels then exist before the capture)."""
    side = side_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def median_replay_ms(graph, replays: int) -> float:
    """Median GPU time (ms) of ``replays`` replays of a captured CUDA graph, after one warm-up."""
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[len(samples) // 2]


def rotated_medians(ops: dict, timer, rounds: int) -> tuple[dict, dict]:
    """Median time per op over ``rounds`` rounds, the op order rotated by one each round, and every
    round's time per op. ``timer(op)`` times one op. A GEMM timed right after a heavy one inherits
    its clock / power state (on an H100 the first op after cuBLAS read 5-10 % slow at >= 0.6 ms, and
    the power cap moves every FP8 kernel's clock), so no op keeps one position. Used by the
    benchmarks and by gemm_gluon's tuner."""
    names = list(ops)
    samples = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(timer(ops[name]))
    return {name: statistics.median(values) for name, values in samples.items()}, samples


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (grid sizing of persistent and split kernels)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
