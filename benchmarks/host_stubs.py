"""Kernel stubs for measuring quantkit's host (Python) cost on a CPU: everything but the launch runs.

``install()`` makes the Triton backend's eager path run on CPU tensors, unchanged except at the
narrowest points where a GPU is needed:

- ``CachedLaunch``: the first call per key goes through ``kernel[grid](...)`` as always, which
  here returns a stand-in compiled kernel whose ``run`` does nothing; every later call takes
  quantkit's real cached path (key lookup, argument tuple, stream query) up to that ``run``.
  Excluded: triton's C launcher (``CompiledKernel.run``, ~20 us per launch on the H100 host).
- Kernels launched through triton's own path (RoPE, flash attention): ``kernel[grid](...)`` does
  nothing. Excluded: triton's ``JITFunction.run`` (binding, specialization, cache lookup) and the
  C launcher, ~30-50 us per launch on the H100 host (NOTES-gemm, session 3).
- Autotuners (tiled and persistent GEMM): they "pick" their first config without timing anything
  (which config is chosen does not change the host path).
- ``_check_runnable`` (the launchers' "is this a CUDA tensor" check) passes CPU tensors; the
  triton driver's current device/stream queries answer 0; ``num_sms`` answers 132 (an H100).
- The RoPE dispatcher takes CPU tensors as it takes CUDA ones (``fast_rope.on_kernel_device``).

Outputs are allocated by the launchers as usual (``torch.empty``): correctly shaped and typed,
values undefined, so a stubbed model computes nothing meaningful (nothing in an eager prefill
forward branches on values). Import this module only in a process that measures host time:
``install`` is not undone.
"""

from __future__ import annotations

import os


class _FakeCompiled:
    """Stands in for triton's CompiledKernel: the cached launch path calls ``run``."""

    function = None
    packed_metadata = None

    @staticmethod
    def run(*args) -> None:
        return None


_COMPILED = _FakeCompiled()


class _FakeJIT:
    """Stands in for a @triton.jit function: ``kernel[grid](*args, **kwargs)`` launches nothing."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.arg_names = kernel.arg_names
        self.__name__ = getattr(kernel, "__name__", "kernel")

    @staticmethod
    def _launch(*args, **kwargs):
        return _COMPILED

    def __getitem__(self, grid):
        return self._launch


class _FakeAutotuner:
    """Stands in for a triton.autotune wrapper: "picks" ``best_config`` without launching."""

    def __init__(self, best_config) -> None:
        self.best_config = best_config
        self.configs = [best_config]

    @staticmethod
    def _launch(*args, **kwargs):
        return None

    def __getitem__(self, grid):
        return self._launch


class _FakeDriver:
    @staticmethod
    def get_current_device() -> int:
        return 0

    @staticmethod
    def get_current_stream(device: int) -> int:
        return 0


_DRIVER = _FakeDriver()
_INSTALLED = False


class _Outputs:
    """Preallocated outputs of the ops-level stubs, one per (shape, dtype): a stub costs a dict
    lookup, not an allocation."""

    def __init__(self) -> None:
        self.tensors: dict = {}

    def get(self, shape: tuple, dtype, device):
        key = (shape, dtype)
        out = self.tensors.get(key)
        if out is None:
            import torch

            out = self.tensors[key] = torch.empty(shape, dtype=dtype, device=device)
        return out


# Stub levels above the launch: level -> [(module, attribute, stub, original)].
LEVELS = ("launch", "ops", "gemm", "gemm-check")
_LEVEL_STUBS: dict = {}
_current_level = "launch"


def set_level(level: str) -> None:
    """Which stubs are in place (cheap when unchanged, so a forward can set it on every call):

    - ``launch``: only the launch itself (``install``);
    - ``ops``: also the entry points the modules call (``ops.*``, ``attention_ops.*``) return
      preallocated outputs: what is left is the modules' and HF's Python, so the difference to
      ``launch`` is the launchers' Python;
    - ``gemm``: ``gemm.scaled_mm`` / ``gated_scaled_mm`` (what ``triton_ops`` calls) return
      preallocated outputs: the difference to ``launch`` is the GEMM launchers' Python;
    - ``gemm-check``: ``gemm.check_scaled_mm_args`` answers (M, N, K) from the shapes without
      validating: the difference to ``launch`` is the GEMM validation's share.
    """
    global _current_level
    if level == _current_level:
        return
    if level not in LEVELS:
        raise ValueError(f"stub level {level!r} is not one of {LEVELS}")
    if not _LEVEL_STUBS:
        _make_level_stubs()
    for name, stubs in _LEVEL_STUBS.items():
        for module, attribute, stub, original in stubs:
            setattr(module, attribute, stub if name == level else original)
    _current_level = level


def _make_level_stubs() -> None:
    import torch

    from quantkit.kernels import attention_ops, gemm, ops

    outputs = _Outputs()
    f32 = torch.float32

    def scaled_mm(a, w, a_scale, w_scale, bias=None, activation="none", out_dtype=torch.bfloat16, backend="torch"):
        return outputs.get((a.shape[0], w.shape[0]), out_dtype, a.device)

    def gated_scaled_mm(a, w, a_scale, w_scale, activation="silu", out_dtype=torch.bfloat16, backend="torch"):
        return outputs.get((a.shape[0], w.shape[0] // 2), out_dtype, a.device)

    def quantize_per_token(x, dtype, backend="torch"):
        return outputs.get(tuple(x.shape), dtype, x.device), outputs.get((x.shape[0],), f32, x.device)

    def quantize_per_tensor(x, scale, dtype, backend="torch"):
        return outputs.get(tuple(x.shape), dtype, x.device)

    def rms_norm_quant_per_token(x, weight, eps, dtype, residual=None, offset=0.0, backend="torch"):
        return (outputs.get(tuple(x.shape), dtype, x.device), outputs.get((x.shape[0],), f32, x.device),
                None if residual is None else outputs.get(tuple(x.shape), x.dtype, x.device))

    def flash_attention(q, k, v, scale, window=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                        backend="torch"):
        return outputs.get(tuple(q.shape), q.dtype, q.device)

    def apply_rope(q, k, cos, sin, backend="torch"):
        return outputs.get(tuple(q.shape), q.dtype, q.device), outputs.get(tuple(k.shape), k.dtype, k.device)

    def rms_norm(x, weight, eps, residual=None, offset=0.0, backend="torch"):
        return (outputs.get(tuple(x.shape), x.dtype, x.device),
                None if residual is None else outputs.get(tuple(x.shape), x.dtype, x.device))

    def check_scaled_mm_args(a, w, a_scale, w_scale, bias, activation, out_dtype, gated=False):
        return a.shape[0], w.shape[0] // 2 if gated else w.shape[0], a.shape[1]

    ops_stubs = [(ops, name, stub) for name, stub in (
        ("scaled_mm", scaled_mm), ("gated_scaled_mm", gated_scaled_mm), ("quantize_per_token", quantize_per_token),
        ("quantize_per_tensor", quantize_per_tensor), ("rms_norm_quant_per_token", rms_norm_quant_per_token))]
    ops_stubs += [(attention_ops, name, stub) for name, stub in (
        ("flash_attention", flash_attention), ("apply_rope", apply_rope), ("rms_norm", rms_norm))]
    gemm_launchers = [(gemm, "scaled_mm", lambda a, w, a_scale, w_scale, bias=None, activation="none",
                       out_dtype=torch.bfloat16: scaled_mm(a, w, a_scale, w_scale, bias, activation, out_dtype)),
                      (gemm, "gated_scaled_mm", lambda a, w, a_scale, w_scale, activation="silu",
                       out_dtype=torch.bfloat16: gated_scaled_mm(a, w, a_scale, w_scale, activation, out_dtype))]
    for level, stubs in (("ops", ops_stubs), ("gemm", gemm_launchers),
                         ("gemm-check", [(gemm, "check_scaled_mm_args", check_scaled_mm_args)])):
        _LEVEL_STUBS[level] = [(module, name, stub, getattr(module, name)) for module, name, stub in stubs]


def install() -> None:
    """Install the stubs (idempotent). Raises when the kernels were defined for the interpreter."""
    global _INSTALLED
    if _INSTALLED:
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("host stubs measure the GPU launch path: unset TRITON_INTERPRET before importing quantkit")
    from quantkit.kernels import attention, attention_decode, gemm, gemm_tma, launch, norm, quant, rope
    from quantkit.models import fast_rope

    launch._driver = lambda: _DRIVER
    for module in (gemm, gemm_tma, quant, norm, attention_decode, attention, rope):
        for value in list(vars(module).values()):
            if isinstance(value, launch.CachedLaunch) and not isinstance(value.kernel, _FakeJIT):
                value.kernel = _FakeJIT(value.kernel)
                value.compiled.clear()
    rope._rope_kernel = _FakeJIT(rope._rope_kernel)
    attention._flash_prefill_kernel = _FakeJIT(attention._flash_prefill_kernel)
    gemm._scaled_mm_autotuned = _FakeAutotuner(gemm.LARGE_M_CONFIGS[0])
    gemm_tma._autotuned = lambda gated=False: _FakeAutotuner(
        (gemm_tma.GATED_CONFIGS if gated else gemm_tma.PERSISTENT_CONFIGS)[0])
    gemm_tma._autotune_and_launch = lambda *args, **kwargs: None
    gemm_tma.num_sms = lambda device_index: 132
    gemm._check_runnable = lambda a: None
    quant._check_runnable = lambda x: None
    fast_rope.on_kernel_device = lambda q: True
    _INSTALLED = True
