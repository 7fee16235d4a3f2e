"""RMSNorm whose output is quantized by the next layer without ever existing in 16 bits.

In a decoder layer the norm's output usually feeds only quantized projections (q/k/v after
``input_layernorm``, gate/up after ``post_attention_layernorm``), which quantize it per token at
once. ``FastRMSNorm`` (``exact=False``, ``norm_quant=True``) therefore returns a ``NormOutput``:
a tensor that has the output's shape, dtype and device but no (M, K) buffer (its data is one
element expanded with zero strides) and that remembers the norm's input, weight, eps and offset.

- A consumer that quantizes dynamically per token (``quantize_input`` of a QuantLinear,
  ``FusedQKV``, ``GatedQuantMLP``) asks it for ``(q, scale)``: one ``rms_norm_quant_per_token``
  launch instead of a norm launch that writes 16 bits and a quantization launch that reads them
  back. The result is cached per (dtype, backend), so q/k/v and gate/up share one launch.
- Shape queries (``shape``, ``size``, ``dim``, ``dtype``, ``device``, ``is_inference`` ...) answer
  without computing anything, and ``reshape``/``view``/``flatten`` that keep the last dimension
  give another ``NormOutput`` over the same pending norm.
- Anything else that touches the values (any other torch function or Tensor method, in-place ops,
  ``.float()``, indexing, printing, a static-scale consumer, an unquantized module) gets the real
  16-bit output, computed once by ``attention_ops.rms_norm`` (the op ``FastRMSNorm`` runs
  otherwise) and cached: every later read, and every view, is of that tensor, so in-place changes
  are seen as on a plain tensor. A norm whose output had to be materialized stops deferring (its
  consumer evidently needs 16 bits, e.g. Gemma-3's post-attention norm that feeds the residual
  add): the lazy path's overhead is then paid once per module, not per call. Unless a consumer
  already took fused values in that call: then it keeps deferring, so every call feeds every
  consumer the same values. Once the output exists the norm's input is released, and the raw
  storage behind a deferred output is NaN, so code that reads it past ``__torch_function__``
  (``torch.tensor(y)``, DLPack, C++ extensions) sees NaN, never plausible values.

Numerics: the fused kernel quantizes the float32 normed row, the unfused path quantizes the
16-bit rounded norm output, so a quantized value can move by one step where the 16-bit rounding
crosses a rounding boundary; ``rms_norm_quant_per_token``'s docstring (reference.py) has the
order of operations. Hence only with ``exact=False``.

Residual adds: ``FastRMSNorm.fused_add_norm`` runs ``residual + x`` inside the same fused kernel
(which writes the sum and the quantized normed rows); ``fast_layer`` uses it in pre-norm decoder
layers.

Safety: the pending norm reads its input when first asked; it records the input's version
counter and refuses (RuntimeError) if the input was changed in place meanwhile. Inference-mode
tensors have no version counter, so for them (and under autograd or tracing) the norm returns
the plain output.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from quantkit.kernels import attention_ops, ops
from quantkit.kernels.call_cache import contiguous_strides

logger = logging.getLogger(__name__)

# Per (device, dtype, shape): one element expanded to the shape, the data every NormOutput of
# that kind aliases (cached: building the expanded view costs more than the subclass object).
# The element is NaN: code that reads the raw storage past ``__torch_function__`` (``torch.tensor
# (y)``, DLPack, a C++ extension) gets NaN, never plausible zeros.
_STUBS: dict = {}


def _stub(device: torch.device, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    key = (device, dtype, shape)
    stub = _STUBS.get(key)
    if stub is None:
        if len(_STUBS) > 256:  # many prompt lengths: keep the cache small
            _STUBS.clear()
        stub = _STUBS[key] = torch.full((1,), float("nan"), dtype=dtype, device=device).expand(shape)
    return stub


class PendingRMSNorm:
    """The shared state of one deferred norm output and its reshaped views."""

    __slots__ = ("x2d", "device", "dtype", "version", "weight", "eps", "offset", "backend", "owner", "quantized",
                 "taken", "output")

    def __init__(self, x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, backend: str,
                 owner) -> None:
        self.x2d = x2d
        self.device, self.dtype = x2d.device, x2d.dtype  # x2d is released once the output exists
        self.version = x2d._version
        self.weight = weight
        self.eps = eps
        self.offset = offset
        self.backend = backend
        self.owner = owner
        self.quantized: dict = {}
        self.taken = False  # a consumer has asked for fused values (``quantized`` may be prefilled)
        self.output: torch.Tensor | None = None

    def _check_input(self) -> None:
        if self.x2d is None:
            raise RuntimeError("a deferred RMSNorm output lost its input after it was computed (a bug)")
        if self.x2d._version != self.version:
            raise RuntimeError(
                "the input of a deferred RMSNorm output was changed in place before the output was used; "
                "its value is gone. Run optimize(model, norm_quant=False) for this model")

    def quantize_per_token(self, dtype: torch.dtype, backend: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q, scale) of the normed rows from the fused kernel, or None once the 16-bit output exists."""
        if self.output is not None:
            return None
        self.taken = True
        key = (dtype, backend)
        cached = self.quantized.get(key)
        if cached is None:
            self._check_input()
            q, scale, _ = ops.rms_norm_quant_per_token(self.x2d, self.weight, self.eps, dtype, None, self.offset,
                                                       backend=backend)
            cached = self.quantized[key] = (q, scale)
            owner = self.owner
            owner.output_counts[0] += 1
            if owner.consumer_key[0] != key:
                owner.consumer_key[0] = key
        return cached

    def materialize(self) -> torch.Tensor:
        """The (M, K) 16-bit norm output, computed once."""
        if self.output is None:
            self._check_input()
            self.output, _ = attention_ops.rms_norm(self.x2d, self.weight, self.eps, offset=self.offset,
                                                    backend=self.backend)
            # The input is not needed once the output exists: a caller that keeps the output (hidden
            # states) must not also keep the pre-norm activations alive.
            self.x2d = None
            owner = self.owner
            owner.output_counts[1] += 1
            # Stop deferring only if no consumer has taken fused values in this call: otherwise the
            # first forward would feed that consumer fused values and every later one unfused ones.
            if owner.defer_output and not self.taken:
                owner.defer_output = False
                logger.info("%s: a consumer read the 16-bit norm output; this norm no longer defers it", owner)
            # The quantized copies are not needed once the output exists (consumers then quantize it).
            self.quantized = {}
        return self.output


def _plain(t):
    return t.real_tensor() if type(t) is NormOutput else t


def _new_shape(shape: torch.Size, args: tuple, kwargs: dict | None) -> tuple | None:
    """The shape a reshape/view call asks for (with -1 resolved), or None if not plain integers."""
    if kwargs:
        if set(kwargs) != {"shape"} or args:
            return None
        args = (kwargs["shape"],)
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    if not all(type(a) is int for a in args):
        return None
    numel = 1
    for size in shape:
        numel *= size
    known, unknown = 1, [i for i, a in enumerate(args) if a == -1]
    for a in args:
        if a != -1:
            if a < 0:
                return None
            known *= a
    if len(unknown) > 1:
        return None
    if unknown:
        if known == 0 or numel % known:
            return None
        args = list(args)
        args[unknown[0]] = numel // known
    elif known != numel:
        return None
    return tuple(args)


def _reshape(self, *args, **kwargs):
    shape = _new_shape(self.shape_, args, kwargs)
    if shape is None or not shape or shape[-1] != self.shape_[-1]:
        return None
    return NormOutput.create(self.pending, torch.Size(shape))


def _flatten(self, start_dim=0, end_dim=-1):
    shape = self.shape_
    ndim = len(shape)
    if ndim == 0 or type(start_dim) is not int or type(end_dim) is not int:
        return None  # named dimensions and the like: the plain output answers
    start, end = start_dim % ndim, end_dim % ndim
    if start > end:
        return None  # torch raises for this; the plain output lets it
    if end == ndim - 1 and start < end:
        return None  # would merge the last dimension
    merged = 1
    for size in shape[start:end + 1]:
        merged *= size
    return NormOutput.create(self.pending, torch.Size((*shape[:start], merged, *shape[end + 1:])))


def _size(self, dim=None):
    return self.shape_ if dim is None else self.shape_[dim]


def _numel(self):
    numel = 1
    for size in self.shape_:
        numel *= size
    return numel


def _contiguous(self, memory_format=torch.contiguous_format):
    return self if memory_format in (torch.contiguous_format, torch.preserve_format) else None


# Answered without computing the norm (None from a handler: not handled, materialize instead).
_T = torch.Tensor
_HANDLERS = {
    _T.shape.__get__: lambda self: self.shape_,
    _T.dtype.__get__: lambda self: self.pending.dtype,
    _T.device.__get__: lambda self: self.pending.device,
    _T.ndim.__get__: lambda self: len(self.shape_),
    _T.requires_grad.__get__: lambda self: False,
    _T.is_leaf.__get__: lambda self: True,
    _T.grad_fn.__get__: lambda self: None,
    _T.grad.__get__: lambda self: None,
    _T.is_cuda.__get__: lambda self: self.pending.device.type == "cuda",
    _T.is_cpu.__get__: lambda self: self.pending.device.type == "cpu",
    _T.layout.__get__: lambda self: torch.strided,
    _T.is_sparse.__get__: lambda self: False,
    _T.is_quantized.__get__: lambda self: False,
    _T.is_meta.__get__: lambda self: False,
    _T.is_nested.__get__: lambda self: False,
    _T._version.__get__: lambda self: self.data_version(),
    _T.size: _size,
    _T.dim: lambda self: len(self.shape_),
    _T.ndimension: lambda self: len(self.shape_),
    _T.numel: _numel,
    _T.nelement: _numel,
    _T.__len__: lambda self: self.shape_[0],
    _T.__hash__: lambda self: id(self),
    _T.is_inference: lambda self: False,  # never deferred in inference mode
    _T.is_floating_point: lambda self: True,
    _T.is_complex: lambda self: False,
    _T.element_size: lambda self: self.pending.dtype.itemsize,
    _T.get_device: lambda self: self.pending.device.index if self.pending.device.type != "cpu" else -1,
    _T.is_contiguous: lambda self, memory_format=torch.contiguous_format: memory_format == torch.contiguous_format,
    _T.stride: lambda self, dim=None: (contiguous_strides(self.shape_) if dim is None
                                       else contiguous_strides(self.shape_)[dim]),
    _T.contiguous: _contiguous,
    _T.reshape: _reshape,
    _T.view: _reshape,
    torch.reshape: lambda self, shape: _reshape(self, shape),
    _T.flatten: _flatten,
    torch.flatten: _flatten,
}


class NormOutput(torch.Tensor):
    """A deferred RMSNorm output (see the module docstring); behaves as the 16-bit output."""

    # Plain Python attributes (reading them does not go through __torch_function__).
    pending: PendingRMSNorm
    shape_: torch.Size

    @staticmethod
    def create(pending: PendingRMSNorm, shape: torch.Size) -> "NormOutput":
        out = _stub(pending.device, pending.dtype, shape).as_subclass(NormOutput)
        out.pending = pending
        out.shape_ = shape
        return out

    def real_tensor(self) -> torch.Tensor:
        """The 16-bit norm output in this tensor's shape (computed on first use, then cached)."""
        real = self.__dict__.get("real_")
        if real is None:
            real = self.real_ = self.pending.materialize().view(self.shape_)
        return real

    def data_version(self) -> int:
        """What ``_version`` answers: 0 until the output exists, then its version counter."""
        return 0 if self.pending.output is None else self.real_tensor()._version

    def deferred_quantize_per_token(self, dtype: torch.dtype, backend: str):
        """(q (M, K), scale (M,)) of the rows (the ``quantize_input`` protocol), or None: then
        quantize ``real_tensor()``. Only 2-D views (M, K) are quantized this way."""
        if len(self.shape_) != 2:
            return None
        return self.pending.quantize_per_token(dtype, backend)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        handler = _HANDLERS.get(func)
        if handler is not None and args and type(args[0]) is NormOutput:
            result = handler(*args, **(kwargs or {}))
            if result is not None or func in _NONE_IS_AN_ANSWER:
                return result
        args, kwargs = tree_map_only(NormOutput, NormOutput.real_tensor, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None):
        return repr(self.real_tensor())


_NONE_IS_AN_ANSWER = {_T.grad_fn.__get__, _T.grad.__get__}


def plain_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, or the materialized output of a deferred norm."""
    return _plain(x)


def defer_rms_norm(owner, x: torch.Tensor, weight: torch.Tensor) -> NormOutput:
    """A ``NormOutput`` for ``owner``'s norm of ``x`` (checks are the caller's: see FastRMSNorm)."""
    pending = PendingRMSNorm(x.reshape(-1, x.shape[-1]), weight, owner.eps, owner.offset, owner.backend, owner)
    return NormOutput.create(pending, x.shape)


def _defers(norm: "FastRMSNorm", x: torch.Tensor) -> bool:
    """Whether ``norm`` may return a deferred output for ``x`` (else the plain output)."""
    # The weight from the dict, not nn.Module.__getattr__ (~2 us a lookup on this hot path).
    width = norm._parameters["weight"].shape[0]
    # is_compiling first: dynamo refuses the inference-mode queries while tracing (fullgraph=True).
    return (norm.defer_output and not torch.compiler.is_compiling() and type(x) is torch.Tensor
            and x.shape[-1] == width and x.numel() and not (x.requires_grad and torch.is_grad_enabled())
            and not torch.is_inference_mode_enabled() and not x.is_inference())


# The RMSNorm module a FastRMSNorm replaced (in its __dict__, so its weight is not in state_dict twice).
ORIGINAL_NORM = "quantkit_original_norm"
_WARNED_CASTS: set = set()  # (verified dtype, input dtype) pairs warned about, once a process


class FastRMSNorm(nn.Module):
    """``x / rms(x) * (offset + weight)`` through ``attention_ops.rms_norm`` (fp32 statistics, one cast).

    With ``defer_output`` (set by ``optimize(exact=False, norm_quant=True)``) the output is a
    ``NormOutput``: a per-token quantized consumer gets it from the fused norm + quantization
    kernel and the 16-bit output is never written (module docs). Not under autograd (an input
    that requires grad), inference mode (no version counter to check the input against) or
    torch.compile tracing: there it returns the plain output. ``fused_calls`` /
    ``materialized_calls`` count deferred outputs quantized by the fused kernel / read in 16 bits;
    the first of the latter turns ``defer_output`` off.

    Residual adds (``fast_layer``): ``fused_add_norm(x, residual)`` runs ``residual + x`` inside
    the fused kernel for the (dtype, backend) its consumer asked for last (``consumer_key``), and
    ``prepare`` hands such a result to this norm's next call on the very tensor it returned.
    """

    def __init__(self, weight: torch.Tensor, eps: float, offset: float, backend: str,
                 defer_output: bool = False, exact_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = float(eps)
        self.offset = float(offset)
        self.backend = backend
        self.defer_output = defer_output
        # optimize(exact=True) verified bit-equality with the replaced norm in this dtype only.
        self.exact_dtype = exact_dtype
        # Lists, so the hot path changes them without nn.Module.__setattr__ (~1 us):
        # [fused, materialized] counts; the (dtype, backend) the last fused consumer asked for;
        # a prepared (sum, its version, deferred output) for the next call.
        self.output_counts = [0, 0]
        self.consumer_key: list = [None]
        self.prepared: list = [None]

    @property
    def fused_calls(self) -> int:
        """Deferred outputs quantized by the fused norm + quantization kernel (one per launch)."""
        return self.output_counts[0]

    @property
    def materialized_calls(self) -> int:
        """Deferred outputs whose 16-bit values were computed after all."""
        return self.output_counts[1]

    def _replaced_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The original module's output: exact mode in a dtype other than the one verified (the
        model was cast after optimize(exact=True)). optimize() again verifies the new dtype."""
        original = self.__dict__[ORIGINAL_NORM]
        original.weight.data = self.weight.data  # the live weight: moved, cast or loaded since the swap
        if (self.exact_dtype, x.dtype) not in _WARNED_CASTS:
            _WARNED_CASTS.add((self.exact_dtype, x.dtype))
            logger.warning("a norm verified bit-exact in %s by optimize(exact=True) got %s input: it runs the "
                           "model's own norm; call optimize() again after changing the model's dtype",
                           self.exact_dtype, x.dtype)
        return original(x)

    def _weight_for(self, x: torch.Tensor) -> torch.Tensor:
        # From the dict, not nn.Module.__getattr__ (~2 us a lookup; see GatedQuantMLP.forward).
        weight = self._parameters["weight"]
        return weight if weight.dtype == x.dtype else weight.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact_dtype is not None and x.dtype != self.exact_dtype:
            return self._replaced_norm(x)
        prepared = self.prepared[0]
        if prepared is not None:
            self.prepared[0] = None
            summed, version, normed = prepared
            if x is summed and x._version == version:
                return normed
        weight = self._weight_for(x)
        if _defers(self, x):
            return defer_rms_norm(self, x, weight)
        x = plain_tensor(x)
        out, _ = attention_ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, self.eps, offset=self.offset,
                                        backend=self.backend)
        return out.reshape(x.shape)

    def fused_add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[NormOutput, torch.Tensor] | None:
        """(this norm's deferred output of ``residual + x``, ``residual + x``) from one fused add +
        RMSNorm + per-token quantization launch, or None (then add and norm as usual): before a
        consumer has asked for fused values (its dtype and backend are not known yet), and
        wherever this norm would not defer. The sum is bit-equal to ``residual + x`` (fp32 add,
        one rounding) and the quantized rows to those of the deferred norm of that sum."""
        key = self.consumer_key[0]
        if (key is None or not _defers(self, x) or type(residual) is not torch.Tensor
                or residual.shape != x.shape or residual.dtype != x.dtype or residual.is_inference()
                or (residual.requires_grad and torch.is_grad_enabled())
                # A model split over devices: the next layer's norm may live on another one.
                or x.device != self._parameters["weight"].device or residual.device != x.device):
            return None
        width = x.shape[-1]
        weight = self._weight_for(x)
        q, scale, summed = ops.rms_norm_quant_per_token(x.reshape(-1, width), weight, self.eps, key[0],
                                                        residual.reshape(-1, width), self.offset, backend=key[1])
        pending = PendingRMSNorm(summed, weight, self.eps, self.offset, self.backend, self)
        pending.quantized[key] = (q, scale)
        self.output_counts[0] += 1
        return NormOutput.create(pending, x.shape), summed.view(x.shape)

    def prepare(self, summed: torch.Tensor, normed: NormOutput) -> None:
        """Make the next call on ``summed`` (the same tensor, unchanged) return ``normed``."""
        self.prepared[0] = (summed, summed._version, normed)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]}, eps={self.eps}, offset={self.offset}, backend={self.backend}, "
                f"defer_output={self.defer_output}")
