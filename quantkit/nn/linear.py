"""QuantLinear: an nn.Linear whose weight is stored in 8 bits and whose input is quantized too.

Buffers are named and shaped as the compressed-tensors checkpoint stores them, so the module's
state_dict *is* the checkpoint: ``weight`` (N, K) int8 / float8_e4m3fn, ``weight_scale`` (N, 1)
fp32, ``input_scale`` (1,) fp32 for static activations, ``bias`` (N,) in the model dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from quantkit.kernels import ops
from quantkit.kernels.gemm_checks import K_ALIGNMENT
from quantkit.kernels.reference import ACTIVATIONS, qmax_of, quantize_per_channel, scale_from_amax

logger = logging.getLogger(__name__)


def quantize_input(module: nn.Module, x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a (M, K) input as ``module`` says: its static input_scale, or per token.

    A tensor subclass whose values are not computed yet may offer ``deferred_quantize_per_token
    (dtype, backend)`` -> (q, scale) or None, and ``real_tensor()`` (the values as a plain
    tensor): the deferred RMSNorm output of ``models/fast_norm.py`` does, and its norm is then
    fused with the per-token quantization. Static scales use the real values.
    """
    if type(x2d) is not torch.Tensor and hasattr(x2d, "deferred_quantize_per_token"):
        if not module.static_input:
            fused = x2d.deferred_quantize_per_token(module.quant_dtype, module.backend)
            if fused is not None:
                return fused
        x2d = x2d.real_tensor()
    if x2d.stride(-1) != 1:  # a transposed or strided view: the kernels read rows of unit stride
        x2d = x2d.contiguous()
    if module.static_input:
        return ops.quantize_per_tensor(x2d, module.input_scale, module.quant_dtype, backend=module.backend), module.input_scale
    return ops.quantize_per_token(x2d, module.quant_dtype, backend=module.backend)


LAYER_BACKENDS = ("triton", "torch")


def layer_backend(backend: str, in_features: int) -> str:
    """The backend a layer of ``in_features`` inputs runs on: the model's, except the torch
    reference for Triton layers whose K the kernels cannot take (not a multiple of 16)."""
    if backend == "triton" and in_features % K_ALIGNMENT:
        if in_features not in _WARNED_WIDTHS:
            _WARNED_WIDTHS.add(in_features)
            logger.warning("layers with in_features=%d (not a multiple of %d) run on the torch reference, not the "
                           "Triton kernels", in_features, K_ALIGNMENT)
        return "torch"
    return backend


_WARNED_WIDTHS: set = set()


class _InferenceOnly(torch.autograd.Function):
    """Passes a quantized layer's output through; its backward refuses. The rounding has no
    useful gradient, and the kernels do not record one: without this, gradients through a
    quantized model came out wrong on the torch backend (through the per-token scale only) and
    missing on Triton (detached outputs), with no error."""

    @staticmethod
    def forward(ctx, x, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("quantkit's quantized layers have no backward (their rounding has no useful gradient); "
                           "run the model under torch.no_grad() or torch.inference_mode(), or fine-tune the 16-bit "
                           "model and quantize it afterwards")


def inference_only(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` of a quantized layer whose input is ``x``: as is, unless autograd records ``x``'s
    history, where a backward through it raises instead of returning a wrong gradient."""
    # A deferred norm output (a tensor subclass answering for x) never carries autograd history:
    # the norm defers only when it does not, and asking would materialize it.
    # Not while torch.compile traces: dynamo would trace the raising backward and refuse the graph
    # (or break it at every layer); the compiled custom ops have no backward of their own either.
    if (torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not hasattr(type(x), "deferred_quantize_per_token") and x.requires_grad):
        return _InferenceOnly.apply(x, out)
    return out


class QuantizedBuffers(nn.Module):
    """Base of the modules that hold a quantized ``weight`` (``quant_dtype``), fp32 ``weight_scale``
    and, for static activations, an fp32 ``input_scale``: their dtypes are the format, so a model's
    ``.half()`` / ``.to(dtype)`` moves them but never casts them, and ``load_state_dict`` refuses
    other dtypes instead of converting them."""

    # Buffers whose dtype is the format.
    _FORMAT_BUFFERS = ("weight", "weight_scale", "input_scale")

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) casts every floating buffer, float8 weights and fp32 scales included,
        # which would break the kernels' contract; only the bias follows the model's dtype.
        order = list(self._buffers)
        kept = {name: self._buffers.pop(name) for name in self._FORMAT_BUFFERS if self._buffers.get(name) is not None}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, buffer in kept.items():
                probe = fn(torch.empty(0, dtype=buffer.dtype, device=buffer.device))
                # A function that would change this dtype (.half(), .float(), .to(dtype)) only moves
                # the buffer; anything else (a device move, to_empty, share_memory_) applies as it
                # would to any buffer.
                self._buffers[name] = fn(buffer) if probe.dtype == buffer.dtype else buffer.to(probe.device)
            for name in order:  # back in the state_dict's order
                self._buffers[name] = self._buffers.pop(name)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        wrong = [f"{prefix}{name} is {state_dict[prefix + name].dtype}, but this {type(self).__name__} holds {dtype} "
                 "(a state_dict of another scheme?)"
                 for name, dtype in (("weight", self.quant_dtype), ("weight_scale", torch.float32),
                                     ("input_scale", torch.float32))
                 if prefix + name in state_dict and state_dict[prefix + name].dtype != dtype]
        if wrong:
            error_msgs.extend(wrong)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class QuantLinear(QuantizedBuffers):
    """y = act(dequant(quant(x) @ W_q^T) + b) in one kernel call."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        quant_dtype: torch.dtype,
        static_input: bool,
        dtype: torch.dtype = torch.float32,
        backend: str = "torch",
        activation: str = "none",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
        qmax_of(quant_dtype)  # validates the dtype
        if backend not in LAYER_BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {LAYER_BACKENDS} (resolve 'auto' for the device "
                             "with quantkit.kernels.ops.resolve_backend)")
        if backend == "triton" and in_features % K_ALIGNMENT:
            raise ValueError(f"in_features={in_features} is not a multiple of {K_ALIGNMENT}, which the Triton kernels "
                             "need; use backend='torch' for this layer (layer_backend picks it)")
        if backend == "triton":
            ops.load_triton_kernels()  # before a first forward that torch.compile may trace
        self.in_features = in_features
        self.out_features = out_features
        self.quant_dtype = quant_dtype
        self.static_input = static_input
        self.backend = backend
        self.activation = activation
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=quant_dtype, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        if static_input:
            self.register_buffer("input_scale", torch.ones(1, dtype=torch.float32, device=device))
        else:
            self.input_scale = None
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        quant_dtype: torch.dtype,
        input_amax: torch.Tensor | None = None,
        weight_amax: torch.Tensor | None = None,
        quantized_weight: tuple[torch.Tensor, torch.Tensor] | None = None,
        backend: str = "torch",
    ) -> "QuantLinear":
        """Quantize ``linear`` once.

        input_amax: the calibrated clipping value of the input (static activations), else None.
        weight_amax: per-channel clipping values (N,) from a clipping search, else the row absmax.
        quantized_weight: an already quantized (q (N, K), scale (N,)) pair, e.g. from GPTQ.
        """
        weight = linear.weight.detach()
        module = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            quant_dtype,
            static_input=input_amax is not None,
            dtype=weight.dtype,
            backend=backend,
            device=weight.device,
        )
        if quantized_weight is not None:
            q, scale = quantized_weight
            if tuple(q.shape) != tuple(weight.shape) or q.dtype != quant_dtype or scale.numel() != weight.shape[0]:
                raise ValueError(f"quantized_weight must be (q {tuple(weight.shape)} {quant_dtype}, scale of "
                                 f"{weight.shape[0]}); got q {tuple(q.shape)} {q.dtype}, scale of {scale.numel()}")
        else:
            q, scale = quantize_per_channel(weight, quant_dtype, weight_amax)
        module.weight.copy_(q)
        module.weight_scale.copy_(scale.reshape(-1, 1))
        if input_amax is not None:
            module.input_scale.copy_(scale_from_amax(torch.as_tensor(input_amax), quant_dtype).reshape(1))
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features (shape {tuple(x.shape)}); this layer takes "
                             f"in_features={self.in_features}")
        leading = x.shape[:-1]
        q, a_scale = quantize_input(self, x.reshape(-1, self.in_features))
        # Buffers straight from ``_buffers``: nn.Module.__getattr__ costs ~2 us per buffer, on
        # the eager hot path (benchmarks/NOTES-e2e.md, session 6). No bias: none registered.
        buffers = self._buffers
        out = ops.scaled_mm(
            q,
            buffers["weight"],
            a_scale,
            buffers["weight_scale"].view(-1),
            buffers.get("bias"),
            self.activation,
            x.dtype,
            backend=self.backend,
        )
        return inference_only(x, out.reshape(*leading, self.out_features))

    def extra_repr(self) -> str:
        mode = "static" if self.static_input else "dynamic per-token"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight={self.quant_dtype}, input={mode}, backend={self.backend}"
            + (f", activation={self.activation}" if self.activation != "none" else "")
        )
