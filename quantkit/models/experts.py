"""Mixture-of-experts blocks with one ``nn.Linear`` per expert and projection, so that quantkit
quantizes, calibrates, saves and loads experts as it does every other Linear.

transformers 5 stacks a mixture of experts' matrices when it loads a checkpoint: one expert
module holds ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) for all E experts. The
source checkpoint, and vLLM, keep one matrix per expert and projection
(``experts.3.gate_proj.weight``, Mixtral's ``experts.3.w1.weight``), and that is the layout a
quantized checkpoint needs: one ``weight_scale`` per expert matrix.

``unstack_experts`` rewrites a stacked experts module into ``UnstackedExperts``: children ``0`` ..
``E-1``, each an ``ExpertMLP`` whose Linears are named as the source checkpoint names them and hold
exactly the rows of the stacked tensors that transformers had joined. The names and rows come from
transformers' own reverse conversion (what ``save_pretrained`` runs), traced on tensors of indices,
so quantkit does not restate any model's layout. The routing is transformers' eager loop: each
expert runs on the tokens routed to it, and its output, times the routing weight, is added to the
token's row.

Taken: gated experts in the concatenated [gate; up] layout with the default gate (``act(gate) *
up``), and ungated ones (``act(up)``), without biases, transposition, a post-expert norm or expert
parallelism, whose checkpoint keeps one matrix per expert: Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek and
the like. Others stay stacked, in 16 bits, as the conversion report says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.kernels import ops
from quantkit.nn import QuantLinear
from quantkit.nn.linear import inference_only

try:  # transformers' load-time weight conversions (5.23 has them; a GPU image's older one may not)
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.integrations.moe import _default_apply_gate
except ImportError:
    revert_weight_conversion = _default_apply_gate = None

logger = logging.getLogger(__name__)

# The stacked parameters of transformers' experts modules (``use_experts_implementation``).
_GATE_UP, _UP, _DOWN = "gate_up_proj", "up_proj", "down_proj"


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``, or ``down(act(up(x)))`` without a gate. Its
    Linears carry the source checkpoint's names (``gate_proj``, or Mixtral's ``w1``), and answer to
    ``gate_proj`` / ``up_proj`` / ``down_proj`` as well, the names quantkit's gated-MLP fusion
    (``optimize``) and fused-group checks look for."""

    def __init__(self, linears: dict[str, nn.Linear], roles: dict[str, str], act_fn: nn.Module) -> None:
        super().__init__()
        for name, linear in linears.items():
            self.add_module(name, linear)
        self.act_fn = act_fn
        self._roles = dict(roles)  # role (gate_proj, up_proj, down_proj) -> child name

    def __getattr__(self, name: str):
        roles = self.__dict__.get("_roles", {})
        if name in roles:
            return self._modules[roles[name]]
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(x)
        hidden = self.act_fn(self.gate_proj(x)) * up if "gate_proj" in self._roles else self.act_fn(up)
        return self.down_proj(hidden)


@dataclass
class _Grouped:
    """The experts' quantized weights stacked for the grouped kernel: ``w13`` (E, 2I, H) [gate; up]
    and ``w2`` (E, H, I), their scales (E, 2I) / (E, H), the static input scales (or None)."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    in13: torch.Tensor | None
    in2: torch.Tensor | None
    activation: str
    quant_dtype: torch.dtype
    backend: str
    # (layer, weight pointer, weight_scale pointer, input_scale) of the first and last experts'
    # layers as stacking left them: a forward that finds one changed restacks.
    anchors: tuple = ()
    # TMA can take both stacked weights (ops.moe_slot_order's path at prefill sizes).
    slot_order: bool = False


class UnstackedExperts(nn.Module):
    """transformers' experts module, one ``ExpertMLP`` per expert (children ``0`` .. ``E-1``), called
    as the stacked one is: ``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k))``.

    Quantized experts run one after another, each on the tokens routed to it, with one host sync
    per layer; after ``stack(activation)`` (``optimize`` calls it) they run as two grouped GEMMs
    routed on the GPU (``ops.grouped_scaled_mm``), the experts' buffers then being views of the
    stacked weights (no second copy)."""

    def __init__(self, experts: list[ExpertMLP], stacked_type: str) -> None:
        super().__init__()
        self.num_experts = len(experts)
        self.stacked_type = stacked_type
        for index, expert in enumerate(experts):
            self.add_module(str(index), expert)
        self.__dict__["_grouped"] = None  # not a submodule or buffer: the experts' buffers are its views

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]

    @torch.no_grad()
    def stack(self, activation: str) -> str | None:
        """Stack the quantized experts for the grouped kernel, running ``activation`` (a kernel
        activation equal to the experts' ``act_fn``); None when done, else why not."""
        experts = [self[index] for index in range(self.num_experts)]
        if not all(isinstance(e, ExpertMLP) and "gate_proj" in e._roles for e in experts):
            return "the experts are not all gated MLPs"
        layers = [(e.gate_proj, e.up_proj, e.down_proj) for e in experts]
        first = layers[0][0]
        same = ("quant_dtype", "static_input", "backend")
        if not all(isinstance(m, QuantLinear) and m.bias is None and m.activation == "none"
                   and all(getattr(m, a) == getattr(first, a) for a in same) for trio in layers for m in trio):
            return "the experts are not all quantized alike (one dtype, input mode and backend, no bias)"
        in13 = in2 = None
        if first.static_input:
            in13, in2 = first.input_scale.clone(), layers[0][2].input_scale.clone()
            if not all(torch.equal(g.input_scale, in13) and torch.equal(u.input_scale, in13)
                       and torch.equal(d.input_scale, in2) for g, u, d in layers):
                return "the experts' static input scales differ (one GEMM takes one)"
        inter, hidden = first.out_features, first.in_features
        device = first.weight.device
        w13 = torch.empty(self.num_experts, 2 * inter, hidden, dtype=first.quant_dtype, device=device)
        w2 = torch.empty(self.num_experts, hidden, inter, dtype=first.quant_dtype, device=device)
        s13 = torch.empty(self.num_experts, 2 * inter, dtype=torch.float32, device=device)
        s2 = torch.empty(self.num_experts, hidden, dtype=torch.float32, device=device)
        for index, (gate, up, down) in enumerate(layers):
            views = ((gate, w13[index, :inter], s13[index, :inter]), (up, w13[index, inter:], s13[index, inter:]),
                     (down, w2[index], s2[index]))
            for layer, weight, scale in views:
                weight.copy_(layer.weight)
                scale.copy_(layer.weight_scale.view(-1))
                layer._buffers["weight"] = weight
                layer._buffers["weight_scale"] = scale.unsqueeze(1)
            if in13 is not None:  # equal values: one tensor each, so that the anchors can check identity
                gate._buffers["input_scale"] = up._buffers["input_scale"] = in13
                down._buffers["input_scale"] = in2
        anchors = tuple((layer, layer._buffers["weight"].data_ptr(), layer._buffers["weight_scale"].data_ptr(),
                         layer._buffers.get("input_scale")) for trio in (layers[0], layers[-1]) for layer in trio)
        self.__dict__["_grouped"] = _Grouped(w13, s13, w2, s2, in13, in2, activation, first.quant_dtype,
                                             first.backend, anchors, ops.tma_ready(w13) and ops.tma_ready(w2))
        return None

    def _stacked(self) -> _Grouped | None:
        """The stacked weights, restacked if the experts' buffers were replaced (``.to(device)``, a
        load): the first and last experts' weights, scales and static input scales must still be
        the ones stacking bound. Not checked while torch.compile traces (pointers are not traceable)."""
        grouped = self.__dict__["_grouped"]
        if grouped is None or torch.compiler.is_compiling():
            return grouped
        if not all(layer._buffers["weight"].data_ptr() == weight and layer._buffers["weight_scale"].data_ptr() == scale
                   and layer._buffers.get("input_scale") is input_scale
                   for layer, weight, scale, input_scale in grouped.anchors):
            self.stack(grouped.activation)
            grouped = self.__dict__["_grouped"]
        return grouped

    def _grouped_forward(self, grouped: _Grouped, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, slots = top_k_index.shape
        experts = top_k_index.reshape(-1).contiguous()

        def quantize(x, static_scale):
            if static_scale is None:
                return ops.quantize_per_token(x, grouped.quant_dtype, backend=grouped.backend)
            return ops.quantize_per_tensor(x, static_scale, grouped.quant_dtype, backend=grouped.backend), static_scale

        # One plan for both GEMMs; its blocks from fewer pairs an expert where the Gluon kernel
        # runs the slot-order GEMMs (2-byte outputs).
        gluon_slots = grouped.slot_order and hidden_states.dtype in (torch.bfloat16, torch.float16)
        plan = ops.moe_route_plan(experts, self.num_experts, gluon_slots, backend=grouped.backend)
        q, scale = quantize(hidden_states.contiguous(), grouped.in13)
        if grouped.slot_order and ops.moe_slot_order(plan):
            # Prefill sizes: the rows in the plan's slot order from the first GEMM's input to the
            # second's output (whole expert blocks, both operands by TMA), then each token's k
            # rows, times their routing weights, summed in float32.
            backend = grouped.backend
            a13, s13 = ops.moe_gather_slots(q, scale, plan, slots, self.num_experts, backend=backend)
            hidden = ops.grouped_slot_mm(a13, grouped.w13, s13, grouped.s13, plan, grouped.activation, True,
                                         hidden_states.dtype, backend=backend)
            q, scale = quantize(hidden, grouped.in2)
            if grouped.in2 is not None:  # a static input scale: the slot-order GEMM takes one per row
                scale = scale.reshape(1).expand(q.shape[0]).contiguous()
            out = ops.grouped_slot_mm(q, grouped.w2, scale, grouped.s2, plan, "none", False, hidden_states.dtype,
                                      backend=backend)
            return inference_only(hidden_states, ops.moe_combine(out, plan.slots, tokens, slots,
                                                                 top_k_weights.reshape(-1).contiguous(),
                                                                 backend=backend))
        hidden = ops.grouped_scaled_mm(q, grouped.w13, scale, grouped.s13, experts, slots, grouped.activation,
                                       True, hidden_states.dtype, plan=plan, backend=grouped.backend)
        q, scale = quantize(hidden, grouped.in2)
        # Each pair's output times its routing weight in the epilogue (rounded to the model's
        # dtype), then a token's k rows summed by torch (accumulating in float32).
        out = ops.grouped_scaled_mm(q, grouped.w2, scale, grouped.s2, experts, 1, "none", False,
                                    hidden_states.dtype, top_k_weights.reshape(-1).float().contiguous(), plan=plan,
                                    backend=grouped.backend)
        return inference_only(hidden_states, out.view(tokens, slots, -1).sum(dim=1))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        grouped = self._stacked()
        if grouped is not None:
            return self._grouped_forward(grouped, hidden_states, top_k_index, top_k_weights)
        # The (token, slot) pairs sorted by expert: each expert's tokens are one slice, and one
        # host sync (the counts) serves the whole layer. Indices past the last expert (expert
        # parallelism's sentinel) sort last and run nowhere, as in transformers' eager loop.
        # Each pair's weighted output lands in its own row, and a token's k rows are summed in
        # float32: deterministic, where index_add_ on CUDA adds a token's rows in any order.
        tokens, slots = top_k_index.shape
        experts = top_k_index.flatten()
        order = torch.argsort(experts, stable=True)
        weights = top_k_weights.flatten()[order, None].float()
        counts = torch.bincount(experts, minlength=self.num_experts)[: self.num_experts].tolist()
        routed = hidden_states.new_zeros(tokens * slots, hidden_states.shape[-1], dtype=torch.float32)
        start = 0
        for index, count in enumerate(counts):
            if count:
                pairs = order[start:start + count]
                routed[pairs] = self[index](hidden_states[pairs // slots]) * weights[start:start + count]
                start += count
        return routed.view(tokens, slots, -1).sum(dim=1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, from {self.stacked_type}"


def stacked_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module for each stacked experts module of ``model`` that ``unstack_experts`` takes."""
    if revert_weight_conversion is None:
        return {}
    return {name: module for name, module in model.named_modules() if _layout_supported(module)}


def _layout_supported(module: nn.Module) -> bool:
    has_gate = getattr(module, "has_gate", None)
    stacked = (_GATE_UP if has_gate else _UP, _DOWN)
    return (has_gate is not None and all(isinstance(module._parameters.get(p), nn.Parameter) and
                                         module._parameters[p].dim() == 3 for p in stacked)
            and not getattr(module, "has_bias", True) and not getattr(module, "is_transposed", True)
            and not getattr(module, "has_post_expert_norm", False) and not getattr(module, "_is_expert_parallel", False)
            and getattr(module, "is_concatenated", True) and isinstance(getattr(module, "act_fn", None), nn.Module)
            and (not has_gate or getattr(type(module), "_apply_gate", None) is _default_apply_gate))


def expert_linear_names(model: nn.Module, name: str, module: nn.Module) -> list[list[tuple[str, str]]] | None:
    """Per expert, [(role, Linear name relative to the expert)] as the source checkpoint names them,
    or None where transformers' reverse conversion does not give one matrix per expert and
    projection in the plain layout (the module then stays stacked)."""
    has_gate = module.has_gate
    stacked = [_GATE_UP, _DOWN] if has_gate else [_UP, _DOWN]
    experts = module._parameters[stacked[0]].shape[0]
    # Each stacked row tagged with a unique value (parameter, expert, row), one column wide: the
    # reverse conversion's output names say where each row went.
    offsets, tags, start = {}, {}, 0
    for param in stacked:
        rows = module._parameters[param].shape[1]
        offsets[param] = (start, rows)
        tags[f"{name}.{param}"] = torch.arange(start, start + experts * rows, dtype=torch.float64).view(experts, rows, 1)
        start += experts * rows
    try:
        unstacked = revert_weight_conversion(model, tags)
    except Exception as exc:  # a converter that needs real shapes: keep the module stacked
        logger.info("%s: transformers' reverse conversion failed on traced indices (%s); experts stay stacked", name, exc)
        return None
    per_expert: list[list[tuple[str, str]]] = [[] for _ in range(experts)]
    sources = {}
    for key, tensor in unstacked.items():
        if tensor.dim() != 2 or tensor.shape[1] != 1 or not key.endswith(".weight"):
            return None
        first = int(tensor[0, 0])
        param = next(p for p, (begin, rows) in offsets.items() if begin <= first < begin + experts * rows)
        begin, rows = offsets[param]
        expert, row = divmod(first - begin, rows)
        parts = key.removesuffix(".weight").split(".")
        if str(expert) not in parts:
            return None
        at = len(parts) - 1 - parts[::-1].index(str(expert))
        linear = ".".join(parts[at + 1:])
        expected = torch.arange(first, first + tensor.shape[0], dtype=torch.float64)
        if not linear or not torch.equal(tensor[:, 0], expected):
            return None  # rows not contiguous in order (an interleaved layout): not the plain one
        if param == _DOWN:
            role = "down_proj" if row == 0 and tensor.shape[0] == rows else None
        elif param == _UP:
            role = "up_proj" if row == 0 and tensor.shape[0] == rows else None
        else:
            half = rows // 2
            role = {0: "gate_proj", half: "up_proj"}.get(row) if tensor.shape[0] == half and rows % 2 == 0 else None
        if role is None:
            return None
        per_expert[expert].append((role, linear))
        sources[f"{name}.{expert}.{linear}.weight"] = key
    wanted = {"gate_proj", "up_proj", "down_proj"} if has_gate else {"up_proj", "down_proj"}
    if any(sorted(role for role, _ in parts) != sorted(wanted) or len({n for _, n in parts}) != len(parts)
           for parts in per_expert):
        return None
    # The Linears' own names, reverted as save() reverts them, must give the source names back.
    reverted = revert_weight_conversion(model, {key: torch.empty(1, 1, device="meta") for key in sources})
    if sorted(reverted) != sorted(sources.values()):
        return None
    return per_expert


def unstack(module: nn.Module, names: list[list[tuple[str, str]]]) -> UnstackedExperts:
    """The ``UnstackedExperts`` of a stacked experts module, holding copies of its rows (on its
    device, meta included)."""
    def linear(matrix: torch.Tensor) -> nn.Linear:
        layer = nn.Linear(matrix.shape[1], matrix.shape[0], bias=False, device="meta", dtype=matrix.dtype)
        layer.weight = nn.Parameter(matrix.detach().clone(), requires_grad=matrix.requires_grad)
        return layer

    first = module._parameters[_GATE_UP if module.has_gate else _UP]
    down = module._parameters[_DOWN]
    half = first.shape[1] // 2
    experts = []
    order = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
    for index, parts in enumerate(names):
        parts = sorted(parts, key=lambda part: order[part[0]])
        rows = {"gate_proj": first[index, :half], "up_proj": first[index, half:] if module.has_gate else first[index],
                "down_proj": down[index]}
        experts.append(ExpertMLP({child: linear(rows[role]) for role, child in parts},
                                 {role: child for role, child in parts}, module.act_fn))
    return UnstackedExperts(experts, type(module).__name__)


def unstack_experts(model: nn.Module, keep=None) -> list[str]:
    """Rewrite, in place, each stacked experts module that ``stacked_experts`` finds into an
    ``UnstackedExperts`` with the same weights; ``keep(name) -> bool`` given a per-expert Linear's
    full name, leaves a module stacked when it would keep all of them (nothing of it to quantize).
    Returns the names of the modules rewritten."""
    done = []
    # By name, one module at a time: holding them all would keep every original alive until the
    # last is unstacked, twice the experts' memory.
    for name in list(stacked_experts(model)):
        module = model.get_submodule(name)
        names = expert_linear_names(model, name, module)
        if names is None:
            logger.info("%s (%s): its checkpoint layout is not one matrix per expert; experts stay stacked",
                        name, type(module).__name__)
            continue
        full = [f"{name}.{index}.{child}" for index, parts in enumerate(names) for _, child in parts]
        if keep is not None and all(keep(n) for n in full):
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, unstack(module, names))
        del module
        done.append(name)
    return done


def expert_modules(model: nn.Module) -> dict[str, UnstackedExperts]:
    """Name -> UnstackedExperts module of ``model``."""
    return {name: module for name, module in model.named_modules() if isinstance(module, UnstackedExperts)}


def expert_linears(model: nn.Module) -> set[str]:
    """Full names of the experts' Linears (or QuantLinears) of ``model``."""
    return {f"{name}.{index}.{child}" for name, module in expert_modules(model).items()
            for index in range(module.num_experts) for child, _ in module[index].named_children()
            if child != "act_fn"}


def input_scale_groups(model: nn.Module) -> list[list[str]]:
    """Per experts module, the Linears that read the experts' input (gate and up of every expert),
    and those that read their hidden state (down): vLLM runs each set as one fused GEMM with one
    static input scale, the largest of the set's (it warns when they differ), so quantkit
    calibrates one per set. An expert that no calibration token reached gets it too."""
    groups = []
    for name, module in expert_modules(model).items():
        first, second = [], []
        for index in range(module.num_experts):
            roles = module[index]._roles
            first += [f"{name}.{index}.{roles[r]}" for r in ("gate_proj", "up_proj") if r in roles]
            second.append(f"{name}.{index}.{roles['down_proj']}")
        groups += [first, second]
    return groups


def routes_on_host(model: nn.Module) -> bool:
    """True if ``model`` has unstacked experts that run one by one: their routing picks the experts
    on the host (as transformers' eager loop does), which a CUDA graph cannot capture. Stacked ones
    (``optimize``) on the Triton backend route on the GPU; the torch reference syncs per expert."""
    return any(isinstance(module, UnstackedExperts)
               and (module.__dict__["_grouped"] is None or module.__dict__["_grouped"].backend != "triton")
               for module in model.modules())
