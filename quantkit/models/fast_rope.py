"""RoPE in one launch for the fast path, without forking any modeling code.

transformers' attention modules (Llama, Mistral, Qwen2, Gemma-3, ...) rotate q and k by calling
the module-level function ``apply_rotary_pos_emb(q, k, cos, sin)`` of their modeling file: about
ten elementwise kernels per layer in eager PyTorch (two products, ``rotate_half``'s slices,
negation and concatenation, one sum, for q and again for k). transformers has no extension point
for it, so ``enable_fused_rope`` swaps that function, in the modeling modules the model's
attention layers come from, for a dispatcher:

- inside a forward of an attention module that ``enable_fused_rope`` marked (a thread-local
  depth counter set by forward hooks), on CUDA 16-bit tensors the kernel takes, it runs
  ``attention_ops.apply_rope``: one launch for q and k. It rounds as the eager function does
  (bit-equal on an H100 in bf16, fp16 and fp32: ``benchmarks/results/rope_check_s4_h100.json``),
  so ``optimize`` enables it in exact mode too;
- everywhere else (other models of the same architecture in the process, CPU tensors, float32,
  shapes or layouts the kernel does not take, extra arguments) it calls the original function.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import torch
from torch import nn

from quantkit.kernels import attention_ops
from quantkit.kernels.call_cache import SignatureCache
from quantkit.kernels.reference_attention import check_rope_inputs

_FUNCTION = "apply_rotary_pos_emb"
_ACTIVE = threading.local()
_DTYPES = (torch.float16, torch.bfloat16)


def _active() -> bool:
    # Under torch.compile the original function is traced (the compiler fuses it on its own).
    return not torch.compiler.is_compiling() and getattr(_ACTIVE, "depth", 0) > 0


def on_kernel_device(q: torch.Tensor) -> bool:
    """Whether the kernel runs on q's device (CUDA; ``benchmarks/host_stubs.py`` widens it to time
    the launch path's Python on a CPU)."""
    return q.is_cuda


# Whether the kernel takes a call, by its signature (launch.SignatureCache): every layer of a
# forward asks with the same shapes, and the full check costs ~10 us of Python per call.
_TAKES = SignatureCache()


def _kernel_takes(q, k, cos, sin) -> bool:
    if not isinstance(q, torch.Tensor) or not on_kernel_device(q) or q.dtype not in _DTYPES:
        return False
    for t in (k, cos, sin):
        if not isinstance(t, torch.Tensor) or t.dtype != q.dtype:
            return False
    signature = (q.shape, q.stride(), k.shape, k.stride(), cos.shape, cos.stride(), sin.shape, sin.stride(),
                 q.dtype, q.device, k.device, cos.device, sin.device)
    takes = _TAKES.get(signature)
    if takes is None:
        try:
            check_rope_inputs(q, k, cos, sin)
            takes = True
        except ValueError:
            takes = False
        _TAKES.add(signature, takes)
    return takes


def _dispatcher(original: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", 1)
        if _active() and not args and set(kwargs) <= {"unsqueeze_dim"} and unsqueeze_dim == 1 \
                and _kernel_takes(q, k, cos, sin):
            return attention_ops.apply_rope(q, k, cos, sin, backend="triton")
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.quantkit_original = original
    return apply_rotary_pos_emb


def _enter(_module, _args) -> None:
    if not torch.compiler.is_compiling():
        _ACTIVE.depth = getattr(_ACTIVE, "depth", 0) + 1


def _leave(_module, _args, _output) -> None:
    if not torch.compiler.is_compiling():
        _ACTIVE.depth = max(0, getattr(_ACTIVE, "depth", 0) - 1)


def is_rope_attention(module: nn.Module) -> bool:
    """An attention module whose modeling file rotates q/k through ``apply_rotary_pos_emb``."""
    source = sys.modules.get(type(module).__module__)
    return (hasattr(module, "q_proj") and hasattr(module, "k_proj") and source is not None
            and callable(getattr(source, _FUNCTION, None)))


def enable_fused_rope(model: nn.Module) -> list[str]:
    """Route the RoPE of ``model``'s attention modules through the one-launch kernel; returns their names.

    Idempotent: a module already marked, or a modeling module already swapped, is left as is.
    """
    names = []
    for name, module in model.named_modules():
        if not is_rope_attention(module):
            continue
        source = sys.modules[type(module).__module__]
        current = getattr(source, _FUNCTION)
        if not hasattr(current, "quantkit_original"):
            setattr(source, _FUNCTION, _dispatcher(current))
        if not getattr(module, "quantkit_fused_rope", False):
            module.register_forward_pre_hook(_enter)
            module.register_forward_hook(_leave, always_call=True)
            module.quantkit_fused_rope = True
        names.append(name)
    return names
