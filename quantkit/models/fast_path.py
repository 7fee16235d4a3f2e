"""The end-to-end fast path of a quantized model: one mechanism, no per-model copies.

    model = quantkit.quantize(model, QuantConfig.preset("fp8"))
    model = optimize(model)                 # in place; returns the model

On a model whose Linears are already QuantLinears, ``optimize`` rewrites modules found by their
structure, never by architecture name:

- Gated MLPs (a module with ``gate_proj``/``up_proj``/``down_proj`` QuantLinears and an
  ``act_fn``; Llama, Mistral, Qwen2, Gemma-3 ...) become a ``GatedQuantMLP``: the activation is
  quantized once for both projections, and gate and up come from one stacked weight.
- RMSNorm modules become ``FastRMSNorm`` (the ``attention_ops.rms_norm`` op) where it computes
  the same function; Gemma's ``(1 + w)`` is found by probing, not by name. With exact=False
  (``norm_quant``) a norm returns a deferred output (``fast_norm.NormOutput``): the quantized
  layers that read it (q/k/v, gate/up) get their int8/fp8 input from one fused RMSNorm +
  per-token quantization launch, and the 16-bit norm output is never written; any other reader
  gets the plain 16-bit output, computed on first use (and the norm stops deferring).
- Residual adds (with deferred norms): pre-norm decoder layers, recognised by their forward's
  syntax tree (``fast_layer``), add inside the fused norm + quantization kernel.
- Mixture-of-experts layers (``models/experts.UnstackedExperts``) stack their quantized experts
  and run as two grouped GEMMs routed on the GPU (``ops.grouped_scaled_mm``): no host sync, so
  their decode step can be a CUDA graph. Not bit-identical to the per-expert plain path (the
  gated product is taken in float32 before one rounding), exact=True or not.
- Attention runs through the "quantkit" function registered with transformers'
  ``AttentionInterface`` (flash prefill, split-KV decode).
- RoPE (CUDA, 16-bit): the modeling file's ``apply_rotary_pos_emb`` is routed to one launch
  for q and k while a marked attention module runs (``fast_rope``); the kernel rounds as HF's
  eager function does, bit for bit, so both modes use it.

Exactness. ``exact=True`` (default) keeps every rewrite bit-identical to the plain QuantLinear
model, so greedy generations cannot change:
- MLP: in float32 on the torch backend, ``gated_scaled_mm`` is the plain path's math (fp32
  GEMMs, ``act(gate) * up`` in fp32, one cast) and is used when the HF activation equals the
  kernel's bit for bit. In 16 bits the plain path rounds gate and up to 16 bits *before* the
  activation, which the fused kernel does not; there the module quantizes the input once and
  runs the two GEMMs with the same kernels and shapes as the plain path (so the same autotuned
  tile configs and accumulation order) and applies the model's own ``act_fn``.
- Norms: swapped only on the torch backend and only when a probe on random rows gives equal
  bits (Llama's norm rounds to 16 bits before the weight multiply; the op does not).
``exact=False`` uses the fused gated kernel and the Triton norms everywhere (16-bit rounding
differs from the plain path at the ~1e-3 relative level), and fuses norms into the next
quantization (the fused kernel quantizes the float32 normed value, not its 16-bit rounding).

q/k/v: transformers' attention modules call the three projections separately on the same hidden
states; ``FusedQKV`` stacks their weights and (exact=False) serves all three from one activation
quantization and one GEMM, recognising the repeated input by identity (see its docstring). That
saves two quantizations and four launches per layer; exact mode keeps three GEMMs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.kernels import attention_ops, ops
from quantkit.kernels.reference import ACTIVATIONS
from quantkit.models.fast_attention import register_quantkit_attention
from quantkit.models.fast_layer import fuse_residual_adds
from quantkit.models.fast_norm import ORIGINAL_NORM, FastRMSNorm, NormOutput, plain_tensor
from quantkit.models.experts import UnstackedExperts
from quantkit.models.fast_rope import enable_fused_rope
from quantkit.nn import QuantLinear
from quantkit.nn.linear import QuantizedBuffers, inference_only, quantize_input

logger = logging.getLogger(__name__)

_TORCH_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": torch.relu,
}


@dataclass
class OptimizeReport:
    fused_mlps: list[str] = field(default_factory=list)
    fused_qkv: list[str] = field(default_factory=list)
    exact_gated_kernel_mlps: list[str] = field(default_factory=list)
    swapped_norms: list[str] = field(default_factory=list)
    kept_norms: list[str] = field(default_factory=list)
    deferred_norms: list[str] = field(default_factory=list)
    fused_residual_layers: list[str] = field(default_factory=list)
    fused_rope: list[str] = field(default_factory=list)
    grouped_experts: list[str] = field(default_factory=list)
    attention: str | None = None

    def __str__(self) -> str:
        return (
            f"fused {len(self.fused_mlps)} gated MLPs ({len(self.exact_gated_kernel_mlps)} on the gated kernel), "
            f"{len(self.fused_qkv)} q/k/v projections, "
            f"swapped {len(self.swapped_norms)} RMSNorms (kept {len(self.kept_norms)}; "
            f"{len(self.deferred_norms)} defer their output to a fused norm + quantization), "
            f"residual adds fused into the norms of {len(self.fused_residual_layers)} decoder layers, "
            f"one-launch RoPE in {len(self.fused_rope)} attention modules, "
            f"grouped experts in {len(self.grouped_experts)} MoE layers, attention={self.attention}"
        )


def _probe(shape, dtype, device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 3.0).to(device=device, dtype=dtype)


def kernel_activation_of(act_fn: nn.Module) -> tuple[str, bool] | None:
    """Which of the kernel's activations ``act_fn`` computes: (name, bit-identical in fp32) or None.

    Decided by evaluating it on random values (HF has several classes per activation, e.g. a
    hand-written tanh GELU and ``F.gelu(approximate="tanh")``): equal bits first, then closeness.
    """
    x = _probe((4096,), torch.float32, "cpu")
    with torch.no_grad():
        try:
            y = act_fn(x)
        except (TypeError, RuntimeError):
            return None
        for name, fn in _TORCH_ACTIVATIONS.items():
            if torch.equal(y, fn(x)):
                return name, True
        for name, fn in _TORCH_ACTIVATIONS.items():
            if torch.allclose(y, fn(x), rtol=1e-5, atol=1e-6):
                return name, False
    return None


def _register_input_scale(module: nn.Module, source: QuantLinear) -> None:
    """The fused module's static ``input_scale`` as a buffer (None for dynamic inputs), like
    QuantLinear's: ``.to(device)`` and ``state_dict`` carry it with the weights."""
    if source.static_input:
        module.register_buffer("input_scale", source.input_scale.clone())
    else:
        module.input_scale = None


class GatedQuantMLP(QuantizedBuffers):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with one activation quantization and a stacked weight.

    Buffers: ``weight`` (2 * I, K) [gate; up], ``weight_scale`` (2 * I, 1) fp32, ``input_scale``
    (1,) for static activations (gate and up share their input, hence one calibrated scale).
    """

    def __init__(self, gate: QuantLinear, up: QuantLinear, down: nn.Module, act_fn: nn.Module,
                 activation: str, activation_is_exact: bool, exact: bool) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
        self.in_features = gate.in_features
        self.intermediate_size = gate.out_features
        self.quant_dtype = gate.quant_dtype
        self.backend = gate.backend
        self.static_input = gate.static_input
        self.activation = activation
        self.activation_is_exact = activation_is_exact
        self.exact = exact
        self.act_fn = act_fn
        self.down_proj = down
        self.register_buffer("weight", torch.cat([gate.weight, up.weight], dim=0))
        self.register_buffer("weight_scale", torch.cat([gate.weight_scale, up.weight_scale], dim=0))
        # A buffer, like QuantLinear's: .to(device) / state_dict must carry it with the weight.
        _register_input_scale(self, gate)

    def uses_gated_kernel(self, dtype: torch.dtype) -> bool:
        if not self.exact:
            return True
        # Only there is the fused kernel the plain path's own arithmetic (see the module docstring).
        return dtype == torch.float32 and self.backend == "torch" and self.activation_is_exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = shape_and_dtype(x)
        leading = shape[:-1]
        q, a_scale = quantize_rows(self, x)
        # Buffers and submodules straight from their dicts: nn.Module.__getattr__ costs ~2 us a
        # lookup on the eager hot path (benchmarks/NOTES-e2e.md, session 6).
        weight = self._buffers["weight"]
        w_scale = self._buffers["weight_scale"].view(-1)
        size = self.intermediate_size
        if self.uses_gated_kernel(dtype):
            hidden = ops.gated_scaled_mm(q, weight, a_scale, w_scale, self.activation, dtype, backend=self.backend)
        else:
            # Same arithmetic as the plain path's ``act(gate) * up``; the raw gate is dropped as
            # soon as it is activated and the product is taken in place (bit-identical to ``*``),
            # so at most two (M, I) tensors are alive; the plain expression holds three.
            hidden = self.act_fn(ops.scaled_mm(q, weight[:size], a_scale, w_scale[:size], None, "none",
                                               dtype, backend=self.backend))
            up = ops.scaled_mm(q, weight[size:], a_scale, w_scale[size:], None, "none", dtype,
                               backend=self.backend)
            del q
            hidden = hidden.mul_(up)
            del up
        return inference_only(x, self._modules["down_proj"](hidden.reshape(*leading, size)))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, intermediate_size={self.intermediate_size}, "
                f"weight={self.quant_dtype}, activation={self.activation}, exact={self.exact}, backend={self.backend}")


class FusedQKV(QuantizedBuffers):
    """The stacked [q; k; v] weights of one attention block, one quantization and one GEMM for all three.

    transformers' attention modules call ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden
    states; the three become ``QKVProjection`` views of this module. With ``exact=False`` the
    first of them (in any order) quantizes the input once and runs one GEMM over the stacked
    weight; the others take their columns of that output while the same input tensor (same
    object, same version counter) comes back, and the stash is dropped once all three took
    theirs. Exact mode (and tracing) runs each projection as the plain QuantLinear does, on its
    rows of the stacked weight: same kernels, shapes and autotune keys, so the same bits.
    The value projection's output is copied to a contiguous tensor: it lives through attention,
    and a view would keep the whole (M, q + k + v) output alive.
    """

    def __init__(self, projections: list[QuantLinear], copy_output: list[bool], exact: bool) -> None:
        super().__init__()
        first = projections[0]
        self.in_features = first.in_features
        self.quant_dtype = first.quant_dtype
        self.backend = first.backend
        self.static_input = first.static_input
        self.exact = exact
        self.sizes = [p.out_features for p in projections]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.copy_output = list(copy_output)
        self.register_buffer("weight", torch.cat([p.weight for p in projections], dim=0))
        self.register_buffer("weight_scale", torch.cat([p.weight_scale for p in projections], dim=0))
        if first.bias is not None:
            self.register_buffer("bias", torch.cat([p.bias for p in projections], dim=0))
        else:
            self.bias = None
        _register_input_scale(self, first)
        # [input, its version, the GEMM output viewed as (*leading, q + k + v), bit i: projection
        # i took its part]: a new list per GEMM, marked in place by each projection.
        self._stash = [None, None, None, 0]
        self._all_taken = (1 << len(self.sizes)) - 1

    def _gemm(self, x: torch.Tensor, start: int, stop: int, out_dtype: torch.dtype) -> torch.Tensor:
        q, a_scale = quantize_rows(self, x)
        # From the dicts, not nn.Module.__getattr__ (~2 us a lookup; see GatedQuantMLP.forward).
        buffers = self._buffers
        weight, w_scale, bias = buffers["weight"], buffers["weight_scale"].view(-1), buffers.get("bias")
        if not (start == 0 and stop == weight.shape[0]):
            weight, w_scale = weight[start:stop], w_scale[start:stop]
            bias = None if bias is None else bias[start:stop]
        return ops.scaled_mm(q, weight, a_scale, w_scale, bias, "none", out_dtype, backend=self.backend)

    def project(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self.exact or torch.compiler.is_compiling():
            shape, dtype = shape_and_dtype(x)
            start, size = self.offsets[index], self.sizes[index]
            return self._gemm(x, start, start + size, dtype).reshape(*shape[:-1], size)
        # Inference-mode tensors keep no version counter (and cannot be changed outside
        # inference mode): for them the identity of the object is the check.
        if type(x) is NormOutput:
            version = x.data_version()
        else:
            version = None if x.is_inference() else x._version
        stash = self._stash
        if stash[0] is not x or stash[1] != version or stash[3] >> index & 1:
            shape, dtype = shape_and_dtype(x)
            out = self._gemm(x, 0, self.offsets[-1] + self.sizes[-1], dtype)
            # A new list per GEMM (stored past nn.Module.__setattr__, ~3 us): a caller holding the
            # old one, e.g. another thread running the same model, keeps its own output.
            stash = self.__dict__["_stash"] = [x, version, out.view(*shape[:-1], out.shape[1]), 0]
        stash[3] |= 1 << index
        part = stash[2].narrow(-1, self.offsets[index], self.sizes[index])
        if stash[3] == self._all_taken:
            stash[0] = stash[2] = None
        return part.contiguous() if self.copy_output[index] else part

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}, in_features={self.in_features}, weight={self.quant_dtype}, exact={self.exact}"


class QKVProjection(nn.Module):
    """``q_proj`` / ``k_proj`` / ``v_proj`` of a ``FusedQKV`` (which is registered on the attention module)."""

    def __init__(self, fused: FusedQKV, index: int) -> None:
        super().__init__()
        # A plain attribute, not a submodule: the fused module is registered once, on the attention module.
        object.__setattr__(self, "fused", fused)
        self.index = index
        self.in_features = fused.in_features
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return inference_only(x, self.fused.project(x, self.index))

    def extra_repr(self) -> str:
        return f"index={self.index}, out_features={self.out_features}"


QKV_NAMES = ("q_proj", "k_proj", "v_proj")


def shape_and_dtype(x: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    # A deferred norm output answers from plain attributes (no __torch_function__ round trip).
    if type(x) is NormOutput:
        return x.shape_, x.pending.dtype
    return x.shape, x.dtype


def quantize_rows(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_input`` of x's rows (..., in_features); a deferred norm output is quantized by
    the fused norm + quantization kernel (dynamic per-token modules) or materialized (static)."""
    if type(x) is NormOutput:
        if not module.static_input and x.shape_[-1] == module.in_features:
            fused = x.pending.quantize_per_token(module.quant_dtype, module.backend)
            if fused is not None:
                return fused
        x = x.real_tensor()
    return quantize_input(module, x.reshape(-1, module.in_features))


def _qkv_fusable(module: nn.Module) -> bool:
    parts = [getattr(module, name, None) for name in QKV_NAMES]
    if not all(isinstance(p, QuantLinear) for p in parts):
        return False
    first = parts[0]
    same = all(p.in_features == first.in_features and p.quant_dtype == first.quant_dtype
               and p.backend == first.backend and p.static_input == first.static_input
               and p.activation == "none" and (p.bias is None) == (first.bias is None) for p in parts)
    if same and first.static_input:
        same = all(torch.equal(p.input_scale, first.input_scale) for p in parts)
    return same


def _is_gated_mlp(module: nn.Module) -> bool:
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    return all(isinstance(p, nn.Module) for p in parts) and isinstance(getattr(module, "act_fn", None), nn.Module)


def _fusable(gate: nn.Module, up: nn.Module) -> str | None:
    """None when gate and up can share one quantized input and one stacked GEMM; else why not."""
    if not (isinstance(gate, QuantLinear) and isinstance(up, QuantLinear)):
        return "gate_proj/up_proj are not both QuantLinear (quantize the model first)"
    if gate.bias is not None or up.bias is not None:
        return "biased gate/up projections (the gated kernel has no bias)"
    same = (gate.in_features == up.in_features and gate.out_features == up.out_features
            and gate.quant_dtype == up.quant_dtype and gate.backend == up.backend
            and gate.static_input == up.static_input and gate.activation == up.activation == "none")
    if not same:
        return "gate_proj and up_proj differ in shape, dtype, backend or input mode"
    if gate.static_input and not torch.equal(gate.input_scale, up.input_scale):
        return "gate_proj and up_proj have different static input scales"
    return None


def _norm_epsilon(module: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _rms_norm_offset(module: nn.Module, backend: str, exact: bool) -> float | None:
    """The offset (0 or Gemma's 1) under which the op reproduces ``module``, or None."""
    weight = getattr(module, "weight", None)
    eps = _norm_epsilon(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return None
    if exact and backend != "torch":
        return None
    probe = _probe((64, weight.shape[0]), weight.dtype, weight.device, seed=1)
    with torch.no_grad():
        want = module(probe)
        for offset in (0.0, 1.0):
            got, _ = attention_ops.rms_norm(probe, weight.detach(), eps, offset=offset, backend=backend)
            if torch.equal(got, want):
                return offset
            if not exact and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                return offset
    return None


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def _float_dtype(model: nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


def _model_backend(model: nn.Module) -> str:
    for module in model.modules():
        if isinstance(module, QuantLinear):
            return module.backend
    raise ValueError("optimize() needs a quantized model (no QuantLinear found); run quantkit.quantize first")


def _per_token_input_widths(model: nn.Module) -> set[int]:
    """in_features of the modules that quantize their input dynamically per token."""
    return {m.in_features for m in model.modules()
            if isinstance(m, (QuantLinear, FusedQKV, GatedQuantMLP)) and not m.static_input}


def _can_defer(width: int, backend: str, per_token_widths: set[int]) -> bool:
    # Only norms whose width some per-token consumer takes can feed one; the Triton kernel keeps
    # a row in registers up to MAX_SINGLE_PASS_K.
    if width not in per_token_widths:
        return False
    if backend == "triton":
        from quantkit.kernels.quant import MAX_SINGLE_PASS_K

        return width <= MAX_SINGLE_PASS_K
    return True


@torch.no_grad()
def optimize(model: nn.Module, exact: bool = True, attention: bool = True, norms: bool = True,
             qkv: bool = True, rope: bool = True, norm_quant: bool | None = None,
             residual_add: bool | None = None) -> nn.Module:
    """Rewrite a quantized model in place for end-to-end inference and return it.

    exact: keep greedy outputs bit-identical to the plain QuantLinear model running quantkit's
    attention (see module docs; against the same model on SDPA, attention's own rounding differs),
    except a mixture of experts' grouped experts, which round ``act(gate) * up`` once.
    Bit-equality is verified in the model's dtype at this call: after a cast, call optimize() again.
    attention / norms: switch attention to the "quantkit" function / swap RMSNorm modules.
    qkv: stack q/k/v projections into a ``FusedQKV`` (one quantization + one GEMM when exact=False).
    rope: rotate q and k in one launch on CUDA (``fast_rope``; bit-equal to HF's eager RoPE, so
    exact mode uses it too).
    norm_quant: swapped norms defer their output so that per-token quantized consumers get it from
    the fused RMSNorm + quantization kernel (``fast_norm``); default and only possible with
    exact=False (the fused kernel quantizes the fp32 normed value, not its 16-bit rounding).
    residual_add: pre-norm decoder layers (Llama, Mistral, Qwen2/3) run their residual adds inside
    the fused norm + quantization kernel (``fast_layer``); default and only possible with norm_quant.
    The report is attached as ``model.quantkit_fast_path``.
    """
    if norm_quant is None:
        norm_quant = not exact
    if norm_quant and exact:
        raise ValueError("norm_quant=True needs exact=False: the fused norm + quantization kernel quantizes the "
                         "float32 normed value, which the plain path rounds to 16 bits first")
    if residual_add is None:
        residual_add = norm_quant and norms
    if residual_add and not (norm_quant and norms):
        raise ValueError("residual_add=True needs norms=True and norm_quant=True (exact=False): the add runs "
                         "inside the fused norm + quantization kernel")
    backend = _model_backend(model)
    report = OptimizeReport()
    for name, module in model.named_modules():
        if isinstance(module, GatedQuantMLP):
            # Already fused (optimize called again): only the exactness choice changes.
            module.exact = exact
            report.fused_mlps.append(name)
    for name, module in list(model.named_modules()):
        if isinstance(module, UnstackedExperts):
            act = kernel_activation_of(module[0].act_fn)
            reason = module.stack(act[0]) if act is not None else f"activation {type(module[0].act_fn).__name__}"
            if reason is None:
                report.grouped_experts.append(name)
            else:
                logger.info("experts %s not grouped: %s", name, reason)
    grouped = tuple(f"{name}." for name in report.grouped_experts)
    for name, module in list(model.named_modules()):
        if not _is_gated_mlp(module) or name.startswith(grouped):
            continue
        reason = _fusable(module.gate_proj, module.up_proj)
        act = kernel_activation_of(module.act_fn)
        if reason is None and act is None:
            reason = f"activation {type(module.act_fn).__name__} is none of the kernel's {ACTIVATIONS}"
        if reason is not None:
            logger.info("gated MLP %s not fused: %s", name, reason)
            continue
        fused = GatedQuantMLP(module.gate_proj, module.up_proj, module.down_proj, module.act_fn,
                              act[0], act[1], exact)
        _set_submodule(model, name, fused)
        report.fused_mlps.append(name)
    for name, module in model.named_modules():
        if isinstance(module, GatedQuantMLP) and module.uses_gated_kernel(_float_dtype(model)):
            report.exact_gated_kernel_mlps.append(name)
        if isinstance(module, FusedQKV):
            module.exact = exact
            report.fused_qkv.append(name.rpartition(".")[0])
    if qkv:
        for name, module in list(model.named_modules()):
            if not _qkv_fusable(module):
                continue
            fused = FusedQKV([getattr(module, n) for n in QKV_NAMES], [n == "v_proj" for n in QKV_NAMES], exact)
            module.qkv_fused = fused
            for index, proj_name in enumerate(QKV_NAMES):
                setattr(module, proj_name, QKVProjection(fused, index))
            report.fused_qkv.append(name)
    widths = _per_token_input_widths(model)
    # Only norms inside a layer stack defer: a norm outside one (the final norm) makes the model's
    # output, e.g. a base model's last_hidden_state, which must reach the caller as a plain tensor.
    in_layers = tuple(f"{stack_name}.{index}." if stack_name else f"{index}."
                      for stack_name, stack in model.named_modules() if isinstance(stack, nn.ModuleList)
                      for index in range(len(stack)))
    for name, module in list(model.named_modules()):
        if isinstance(module, FastRMSNorm):
            # Swapped by an earlier optimize(): this call decides again, as on a fresh model. A norm
            # swapped under exact=False (close, not bit-equal) goes back to its original under
            # exact=True, and every one goes back under norms=False.
            original = module.__dict__.get(ORIGINAL_NORM)
            if original is not None:
                # The swapped module's weight is the live one: moved, cast or loaded since the swap.
                original.weight.data = module.weight.data
            if original is not None and not (norms and _rms_norm_offset(original, backend, exact) is not None):
                _set_submodule(model, name, original)
                if norms:
                    report.kept_norms.append(name)
                continue
            if not norms:  # swapped before originals were kept: stays, but never defers
                module.defer_output = False
                continue
            fast = module
            fast.exact_dtype = module.weight.dtype if exact and original is not None else None
        elif norms and type(module).__name__.endswith("RMSNorm"):
            offset = _rms_norm_offset(module, backend, exact)
            if offset is None:
                report.kept_norms.append(name)
                continue
            fast = FastRMSNorm(module.weight, _norm_epsilon(module), offset, backend,
                               exact_dtype=module.weight.dtype if exact else None)
            # In __dict__, not as a submodule: the original's weight must not appear twice in state_dict.
            fast.__dict__[ORIGINAL_NORM] = module
            _set_submodule(model, name, fast)
        else:
            continue
        report.swapped_norms.append(name)
        fast.defer_output = (norm_quant and name.startswith(in_layers)
                             and _can_defer(fast.weight.shape[0], backend, widths))
        if fast.defer_output:
            report.deferred_norms.append(name)
    report.fused_residual_layers = fuse_residual_adds(model, residual_add)
    if rope:
        report.fused_rope = enable_fused_rope(model)
    if attention:
        device = next(model.parameters()).device
        name = register_quantkit_attention(backend=backend, device=device, model=model)
        model.set_attn_implementation(name)
        report.attention = name
    if not report.fused_mlps and not report.grouped_experts:
        logger.warning("optimize(): no gated MLP was fused")
    model.quantkit_fast_path = report
    logger.info("%s", report)
    return model
