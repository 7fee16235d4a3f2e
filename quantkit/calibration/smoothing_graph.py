"""Reading a model's module graph for SmoothQuant: which producer feeds which Linears, exactly.

See ``smoothquant``'s module docstring for the method (storage identity for norm -> Linear,
channel-factor probes for Linear -> Linear, and an exactness check of every candidate fold).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from quantkit.calibration.calibrate import backbone, check_blocks, hidden_state, input_device, storage_key

# Relative change of the probe output above which a candidate rescaling is not an identity.
# Float32 rounding through a few layers stays around 1e-6; a broken identity changes it by O(1).
EXACTNESS_TOL = 1e-3
# A consumer channel is "multiplied by one factor" when its least-squares ratio explains the
# perturbed input to this relative residual.
RATIO_RESIDUAL_TOL = 1e-4


# --- running the model -----------------------------------------------------------------------


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(leaf, p) for p in patterns)


# --- the module graph --------------------------------------------------------------------------


@dataclass
class SmoothGroup:
    """One exact rescaling: ``producer``'s output channels divided by s, consumers' columns times s.

    kind "norm": producer is an affine norm ``n(x) * (offset + weight) + bias``.
    kind "linear": producer is a Linear; ``channel_maps[i][c]`` is the producer output channel
    that consumer i's input channel c comes from.
    """

    kind: str
    producer: str
    consumers: list[str]
    offset: float = 0.0
    channel_maps: list[torch.Tensor] = field(default_factory=list)


def _norm_candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Leaf modules holding only a 1-D ``weight`` (and optionally a same-size ``bias``)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) or any(True for _ in module.children()):
            continue
        params = dict(module.named_parameters(recurse=False))
        weight = params.get("weight")
        if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"}:
            continue
        if "bias" in params and params["bias"].shape != weight.shape:
            continue
        found[name] = module
    return found


def _shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters reachable under more than one name (tied embeddings / heads)."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}


@torch.no_grad()
def _norm_offset(norm: nn.Module, x: torch.Tensor) -> float | None:
    """c in ``out = n(x) * (c + weight) + bias``, read by evaluating the norm with weight 0 and 1.

    Returns None when the output is not affine in the weight that way.
    """
    weight = norm.weight
    bias = getattr(norm, "bias", None)
    saved_w, saved_b = weight.detach().clone(), None if bias is None else bias.detach().clone()
    try:
        if bias is not None:
            bias.zero_()
        outs = []
        for value in (0.0, 1.0, 2.0):
            weight.fill_(value)
            outs.append(norm(x.to(weight.device)).double())
    finally:
        weight.copy_(saved_w)
        if bias is not None:
            bias.copy_(saved_b)
    normalized = outs[1] - outs[0]
    denom = normalized.pow(2).sum()
    if denom == 0:
        return None
    offset = float((outs[0] * normalized).sum() / denom)
    # Affine in the weight: the step from 1 to 2 equals the step from 0 to 1, and out(0) = c * n(x).
    scale = normalized.abs().amax()
    if (outs[2] - outs[1] - normalized).abs().amax() > 1e-4 * scale:
        return None
    if (outs[0] - offset * normalized).abs().amax() > 1e-4 * max(scale, outs[0].abs().amax()):
        return None
    return round(offset, 4) if abs(offset - round(offset)) < 1e-4 else offset


def _channel_map(base: torch.Tensor, perturbed: torch.Tensor, log_factors: torch.Tensor) -> torch.Tensor | None:
    """Producer channel per consumer input channel, or None if the consumer is not channel-wise linear."""
    x = base.reshape(-1, base.shape[-1]).double()
    y = perturbed.reshape(-1, perturbed.shape[-1]).double()
    power = x.pow(2).sum(0)
    if bool((power == 0).any()):
        return None  # a dead channel says nothing about where it comes from
    ratio = (x * y).sum(0) / power
    if bool((ratio <= 0).any()):
        return None
    residual = (y - ratio * x).pow(2).sum(0).sqrt() / y.pow(2).sum(0).sqrt().clamp_min(1e-300)
    if bool((residual > RATIO_RESIDUAL_TOL).any()):
        return None
    sorted_log, order = torch.sort(log_factors.to(x.device).double())
    log_ratio = ratio.log()
    pos = torch.searchsorted(sorted_log, log_ratio).clamp(1, len(sorted_log) - 1)
    left, right = sorted_log[pos - 1], sorted_log[pos]
    nearest = torch.where((log_ratio - left).abs() <= (right - log_ratio).abs(), pos - 1, pos)
    spacing = float((sorted_log[1:] - sorted_log[:-1]).min()) if len(sorted_log) > 1 else 1.0
    if bool(((log_ratio - sorted_log[nearest]).abs() > spacing / 3).any()):
        return None
    return order[nearest].cpu()


class _ProbeDone(Exception):
    """Raised by a probe hook once the rest of the forward cannot tell anything more."""


class _Prober:
    """Runs the backbone on a few probe tokens with temporary hooks.

    A hook may raise ``_ProbeDone`` to cut the forward short; ``run`` then returns None.
    """

    def __init__(self, model: nn.Module, probe_ids: torch.Tensor):
        self.body = backbone(model)
        self.ids = probe_ids.to(input_device(model))

    @torch.no_grad()
    def run(self, pre_hooks=(), hooks=()) -> torch.Tensor | None:
        handles = [m.register_forward_pre_hook(fn) for m, fn in pre_hooks]
        handles += [m.register_forward_hook(fn) for m, fn in hooks]
        try:
            return hidden_state(self.body(input_ids=self.ids, use_cache=False)).detach().double()
        except _ProbeDone:
            return None
        finally:
            for h in handles:
                h.remove()


def _relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp_min(1e-300))


@torch.no_grad()
def find_smoothing_groups(
    model: nn.Module,
    probe_ids: torch.Tensor,
    exclude: tuple[str, ...] = ("lm_head",),
    linear_pairs: bool = True,
    seed: int = 0,
) -> tuple[list[SmoothGroup], list[dict]]:
    """The exact rescalings this model admits, read from probe forwards (see the module docstring).

    probe_ids: (1, T) token ids (a few dozen tokens suffice). Returns (groups, skipped), where
    skipped lists ``{"module", "reason"}`` for candidates that were not exact or not allowed.
    """
    check_blocks(probe_ids)
    modules = dict(model.named_modules())
    linears = {n: m for n, m in modules.items() if isinstance(m, nn.Linear)}
    norms = _norm_candidates(model)
    shared = _shared_parameters(model)
    prober = _Prober(model, probe_ids)
    generator = torch.Generator().manual_seed(seed)
    skipped: list[dict] = []

    # 1. Who feeds whom, by storage identity. Tensors stay referenced until the end of the pass,
    #    so a freed tensor's address cannot be reused by another one.
    norm_out: dict[tuple, list[str]] = {}
    norm_in: dict[str, torch.Tensor] = {}
    lin_in: dict[str, list[torch.Tensor]] = {n: [] for n in linears}
    calls: dict[str, int] = {}
    keep_alive: list[torch.Tensor] = []

    def norm_hook(name):
        def hook(_m, args, out):
            calls[name] = calls.get(name, 0) + 1
            if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                keep_alive.append(out)
                norm_out.setdefault(storage_key(out), []).append(name)
                norm_in[name] = args[0].detach().clone()
        return hook

    def lin_hook(name):
        def hook(_m, args):
            lin_in[name].append(args[0])
        return hook

    base_hidden = prober.run(
        pre_hooks=[(m, lin_hook(n)) for n, m in linears.items()],
        hooks=[(m, norm_hook(n)) for n, m in norms.items()],
    )
    if not bool(torch.isfinite(base_hidden).all()):
        # NaN would pass every exactness check below (NaN > tol is False) and crash the norm fit.
        raise ValueError("the model's hidden states hold NaN or inf on the calibration text before any smoothing; "
                         "check the model's weights and dtype (fp16 overflows in some models: use bfloat16 or float32)")
    fed_by: dict[str, list[str]] = {}
    for lname, inputs in lin_in.items():
        if len(inputs) != 1:
            continue
        for nname in norm_out.get(storage_key(inputs[0]), []):
            fed_by.setdefault(nname, []).append(lname)
    baseline_inputs = {n: v[0].detach().clone() for n, v in lin_in.items() if len(v) == 1}
    del keep_alive, lin_in, norm_out

    def usable_consumers(producer: str, consumers: list[str]) -> str | None:
        for c in consumers:
            if _matches(c, exclude):
                return f"feeds excluded layer {c}"
            if id(linears[c].weight) in shared:
                return f"feeds {c}, whose weight is tied to another module"
        return None

    candidates: list[SmoothGroup] = []
    for nname, consumers in fed_by.items():
        if calls.get(nname, 0) != 1:
            skipped.append({"module": nname, "reason": "norm runs more than once per forward"})
            continue
        reason = usable_consumers(nname, consumers)
        if reason is None and any(id(p) in shared for p in norms[nname].parameters()):
            reason = "norm weight is shared with another module"
        offset = None if reason else _norm_offset(norms[nname], norm_in[nname])
        if reason is None and offset is None:
            reason = "output is not n(x) * (c + weight) + bias"
        if reason:
            skipped.append({"module": nname, "reason": reason})
            continue
        candidates.append(SmoothGroup("norm", nname, sorted(consumers), offset=offset))

    # 2. Linear -> Linear paths that are channel-wise linear, each consumer scaled by one producer.
    scaled_consumers = {c for group in candidates for c in group.consumers}
    if linear_pairs:
        for aname, producer in linears.items():
            if aname not in baseline_inputs or _matches(aname, exclude) or id(producer.weight) in shared:
                continue
            n_out = producer.out_features
            log_factors = torch.linspace(-1.0, 1.0, n_out, dtype=torch.float64)[torch.randperm(n_out, generator=generator)]
            factors = log_factors.exp()
            seen: dict[str, torch.Tensor] = {}

            def scale_output(_m, _args, out, factors=factors):
                return out * factors.to(out.device, out.dtype)

            def record(name):
                def hook(_m, args):
                    seen[name] = args[0].detach().clone()
                return hook

            def stop_at_norm(name):
                # Once the perturbation reaches a norm's input, everything after it depends on the
                # producer through that normalization, which is not channel-wise linear: the rest
                # of the forward cannot reveal another consumer, so the probe ends there. (A path
                # that would bypass it is only missed, never wrongly accepted: step 3 checks.)
                def hook(_m, args):
                    if not torch.equal(args[0], norm_in[name]):
                        raise _ProbeDone
                return hook

            prober.run(
                pre_hooks=[(m, record(n)) for n, m in linears.items() if n in baseline_inputs and n != aname]
                + [(norms[n], stop_at_norm(n)) for n in norm_in if calls.get(n) == 1],
                hooks=[(producer, scale_output)],
            )
            consumers, maps, dead = [], [], []
            for bname, x in seen.items():
                base = baseline_inputs[bname]
                if base.shape != x.shape or torch.equal(base, x):
                    continue
                mapping = _channel_map(base, x, log_factors)
                if mapping is not None:
                    consumers.append(bname)
                    maps.append(mapping)
                elif bool((base.reshape(-1, base.shape[-1]).pow(2).sum(0) == 0).any()):
                    dead.append(bname)
            if not consumers:
                if dead:  # e.g. a ReLU MLP: the probe cannot tell where a channel that stays 0 comes from
                    skipped.append({"module": aname, "reason": f"input channels of {dead[0]} stay zero on the probe "
                                                               "tokens, so its channel map is unknown"})
                continue
            claimed = next((c for c in consumers if c in scaled_consumers), None)
            if claimed is not None:
                # Two producers feeding one consumer (gate and up of a ReLU MLP) would each divide
                # its input by their own scale: the consumer would get both.
                skipped.append({"module": aname, "reason": f"feeds {claimed}, whose input another rescaling scales"})
                continue
            reason = usable_consumers(aname, consumers)
            if reason:
                skipped.append({"module": aname, "reason": reason})
                continue
            candidates.append(SmoothGroup("linear", aname, consumers, channel_maps=maps))
            scaled_consumers.update(consumers)

    # 3. Fold random scales into the candidates and check the output does not move: all at once
    #    first (one forward; independent random scales cannot cancel each other's error), and
    #    group by group only if that fails, to find and skip the culprits.
    def folded_change(batch: list[SmoothGroup]) -> float:
        saved = [item for g in batch for item in _snapshot(g, modules)]
        for g in batch:
            _fold(g, modules, torch.exp(torch.empty(_group_size(g, modules), dtype=torch.float64).uniform_(-1.0, 1.0, generator=generator)))
        change = _relative_change(base_hidden, prober.run())
        _restore(saved)
        return change

    if not candidates or folded_change(candidates) <= EXACTNESS_TOL:
        return candidates, skipped
    groups = []
    for group in candidates:
        change = folded_change([group])
        if not change <= EXACTNESS_TOL:  # NaN is not exact
            skipped.append({"module": group.producer, "reason": f"rescaling is not exact (output changed by {change:.2e})"})
        else:
            groups.append(group)
    return groups, skipped


def _group_size(group: SmoothGroup, modules: dict[str, nn.Module]) -> int:
    producer = modules[group.producer]
    return producer.weight.shape[0]


def _snapshot(group: SmoothGroup, modules: dict[str, nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    params = []
    for name in [group.producer, *group.consumers]:
        params += [p for p in modules[name].parameters(recurse=False)]
    return [(p, p.detach().clone()) for p in params]


def _restore(saved) -> None:
    for param, value in saved:
        param.data.copy_(value)


@torch.no_grad()
def _fold(group: SmoothGroup, modules: dict[str, nn.Module], scales: torch.Tensor,
          stored_dtypes: dict | None = None) -> None:
    """Divide the producer's output channels by ``scales`` and multiply the consumers' columns by them.

    The arithmetic runs in float64 and is rounded once to each parameter's dtype. A norm's gains
    are rounded first, to the dtype the weight will be stored in (``stored_dtypes``: parameter ->
    dtype, for a model upcast while it is smoothed), and the consumers take the scale that rounding
    left (old gain / new gain): in a 16-bit Gemma norm, ``(1 + w) / s - 1`` lies near -1, where
    bf16 keeps few bits of the gain.
    """
    producer = modules[group.producer]
    s = scales.double()
    if group.kind == "norm":
        w = producer.weight
        s = s.to(w.device)
        old_gain = w.double() + group.offset
        stored = (old_gain / s - group.offset).to((stored_dtypes or {}).get(w, w.dtype)).to(w.dtype)
        gain = stored.double() + group.offset
        # A gain that rounded to zero (or across it) would lose its channel: keep that one unscaled.
        # (A zero gain always lands here: it rounds to zero, or to a value whose sign is not zero.)
        lost = (gain == 0) | (torch.sign(gain) != torch.sign(old_gain))
        stored = torch.where(lost, w, stored)
        applied = torch.where(lost, torch.ones_like(s), old_gain / gain)
        w.copy_(stored)
        bias = getattr(producer, "bias", None)
        if bias is not None:
            bias.copy_((bias.double() / applied.to(bias.device)).to(bias.dtype))
        column_scales = [applied] * len(group.consumers)
    else:
        w = producer.weight
        w.copy_((w.double() / s.to(w.device)[:, None]).to(w.dtype))
        if producer.bias is not None:
            producer.bias.copy_((producer.bias.double() / s.to(w.device)).to(producer.bias.dtype))
        column_scales = [s[m.to(s.device)] for m in group.channel_maps]
    for name, cs in zip(group.consumers, column_scales):
        cw = modules[name].weight
        cw.copy_((cw.double() * cs.to(cw.device)[None, :]).to(cw.dtype))
