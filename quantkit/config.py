"""What to quantize and how: one frozen, validated dataclass that round-trips to the checkpoint.

``QuantConfig.preset("fp8")`` reads like the CLI flag ``--scheme fp8``. The checkpoint form is the
compressed-tensors ``quantization_config`` that transformers and vLLM load.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

WEIGHT_TYPES = ("int8", "fp8")
ACTIVATION_MODES = ("dynamic", "static")
ACTIVATION_OBSERVERS = ("absmax", "percentile", "mse")
WEIGHT_OBSERVERS = ("absmax", "percentile", "mse")
BACKENDS = ("auto", "triton", "torch")

# scheme name -> (weight type, activation mode)
PRESETS: dict[str, tuple[str, str]] = {
    "int8": ("int8", "dynamic"),
    "int8-static": ("int8", "static"),
    "fp8": ("fp8", "dynamic"),
    "fp8-static": ("fp8", "static"),
}

# Calibration recipes by name. "accurate" is the combination measured best per scheme on held-out
# text (README "Calibration recipes", benchmarks/results/calibration_sweep.md). The values depend on
# the scheme only, never on the model: SmoothQuant moves more of the range into the weights for
# INT8 (uniform grid) than for FP8 (floating grid, whose relative error barely depends on range).
RECIPES: dict[str, dict[str, dict[str, Any]]] = {
    "plain": {scheme: {} for scheme in PRESETS},
    "accurate": {
        "int8": {"smoothquant_alpha": 0.75, "gptq": True, "keep_sensitive": 4},
        "fp8": {"smoothquant_alpha": 0.5, "gptq": True, "keep_sensitive": 8},
        "int8-static": {"smoothquant_alpha": 0.75, "activation_observer": "mse", "gptq": True, "keep_sensitive": 4},
        "fp8-static": {"smoothquant_alpha": 0.5, "gptq": True, "keep_sensitive": 4},
    },
}


class UnknownSchemeError(ValueError):
    """A scheme name or a checkpoint's quantization_config that this version cannot handle."""


# Parts of a compressed-tensors quantization_config that change the model's arithmetic beyond
# W8A8 Linears (rotations, KV-cache quantization): a checkpoint that sets one is refused, not run
# without it. (A group's output_activations is checked with the group.)
_UNSUPPORTED_PARTS = ("transform_config", "kv_cache_scheme")


@dataclass(frozen=True)
class QuantConfig:
    """A W8A8 recipe.

    Weights are always symmetric per output channel. Activations are quantized per token at run
    time (``dynamic``) or with one per-tensor scale measured during calibration (``static``).
    ``ignore`` holds glob patterns over module names (``"lm_head"``, ``"*.mlp.down_proj"``) that
    stay in 16 bits.
    """

    weight_type: str = "int8"
    activations: str = "dynamic"
    ignore: tuple[str, ...] = ("lm_head",)
    activation_observer: str = "absmax"
    percentile: float = 99.99
    weight_observer: str = "absmax"
    smoothquant_alpha: float | None = None
    gptq: bool = False
    gptq_sequential: bool = False
    keep_sensitive: int = 0
    backend: str = "auto"
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.weight_type not in WEIGHT_TYPES:
            raise UnknownSchemeError(f"weight_type={self.weight_type!r} is not one of {WEIGHT_TYPES}")
        if self.activations not in ACTIVATION_MODES:
            raise ValueError(f"activations={self.activations!r} is not one of {ACTIVATION_MODES}")
        if self.activation_observer not in ACTIVATION_OBSERVERS:
            raise ValueError(
                f"activation_observer={self.activation_observer!r} is not one of {ACTIVATION_OBSERVERS}"
            )
        if self.weight_observer not in WEIGHT_OBSERVERS:
            raise ValueError(f"weight_observer={self.weight_observer!r} is not one of {WEIGHT_OBSERVERS}")
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile={self.percentile} must be in (0, 100]")
        if self.smoothquant_alpha is not None and not 0.0 <= self.smoothquant_alpha <= 1.0:
            raise ValueError(f"smoothquant_alpha={self.smoothquant_alpha} must be in [0, 1]")
        if self.gptq_sequential and not self.gptq:
            raise ValueError("gptq_sequential=True needs gptq=True (it says how GPTQ gathers its statistics)")
        if self.keep_sensitive < 0:
            raise ValueError(f"keep_sensitive={self.keep_sensitive} must be >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}")
        ignore = self.ignore
        if isinstance(ignore, str):
            ignore = (ignore,)
        elif isinstance(ignore, (set, frozenset)):
            ignore = sorted(ignore, key=str)  # one order, so equal configs write equal checkpoints
        try:
            ignore = tuple(ignore)
        except TypeError:
            ignore = None
        if ignore is None or not all(isinstance(p, str) for p in ignore):
            raise ValueError(f"ignore={self.ignore!r} must be a tuple of module-name patterns "
                             "(('lm_head',) is the default; () quantizes every Linear)")
        object.__setattr__(self, "ignore", ignore)

    @classmethod
    def preset(cls, scheme: str, recipe: str = "plain", **overrides: Any) -> "QuantConfig":
        """The named scheme (``int8``, ``int8-static``, ``fp8``, ``fp8-static``) calibrated by ``recipe``.

        recipe: ``"plain"`` (no calibration algorithm beyond what the scheme needs) or
        ``"accurate"`` (``RECIPES["accurate"][scheme]``); ``overrides`` win over the recipe's values.
        """
        if scheme not in PRESETS:
            raise UnknownSchemeError(f"unknown scheme {scheme!r}; choose one of {', '.join(PRESETS)}")
        if recipe not in RECIPES:
            raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        weight_type, activations = PRESETS[scheme]
        values = {**RECIPES[recipe][scheme], **overrides}
        if not values.get("gptq") and "gptq_sequential" not in overrides:
            values.pop("gptq_sequential", None)  # the recipe's GPTQ detail goes with its GPTQ (--no-gptq)
        return cls(weight_type=weight_type, activations=activations, name=scheme, **values)

    def replace(self, **changes: Any) -> "QuantConfig":
        return dataclasses.replace(self, **changes)

    @property
    def is_static(self) -> bool:
        return self.activations == "static"

    @property
    def needs_calibration(self) -> bool:
        """Whether quantizing with this recipe runs calibration data through the model."""
        return self.is_static or self.smoothquant_alpha is not None or self.gptq or self.keep_sensitive > 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.int8 if self.weight_type == "int8" else torch.float8_e4m3fn

    def is_ignored(self, module_name: str) -> bool:
        """True if ``module_name`` matches an ignore pattern: exactly, as a glob, by its last part, or
        (compressed-tensors' form, e.g. ``re:.*lm_head``) as a regular expression matched from its start."""
        leaf = module_name.rsplit(".", 1)[-1]
        return any(re.match(p[3:], module_name) is not None if p.startswith("re:")
                   else fnmatch.fnmatchcase(module_name, p) or fnmatch.fnmatchcase(leaf, p) for p in self.ignore)

    # --- the checkpoint's compressed-tensors quantization_config -------------------------------

    def to_quantization_config(self, ignore: list[str] | None = None) -> dict[str, Any]:
        """The ``quantization_config`` entry of config.json (compressed-tensors layout).

        ``ignore``: the names of the Linear modules left in 16 bits, as ``save`` lists them from the
        model. compressed-tensors matches exact names (or ``re:`` expressions), not quantkit's globs
        and last-part names, so a checkpoint must list them; default: the config's own patterns.
        """
        kind = "int" if self.weight_type == "int8" else "float"
        if self.is_static:
            input_activations = {"num_bits": 8, "type": kind, "strategy": "tensor", "dynamic": False, "symmetric": True}
        else:
            input_activations = {"num_bits": 8, "type": kind, "strategy": "token", "dynamic": True, "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "int-quantized" if kind == "int" else "float-quantized",
            "quantization_status": "compressed",
            "ignore": list(self.ignore) if ignore is None else list(ignore),
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True, "dynamic": False},
                    "input_activations": input_activations,
                }
            },
            # quantkit's own record of the recipe; other loaders ignore unknown keys.
            "quantkit": {
                "scheme": self.name,
                "activation_observer": self.activation_observer,
                "percentile": self.percentile,
                "weight_observer": self.weight_observer,
                "smoothquant_alpha": self.smoothquant_alpha,
                "gptq": self.gptq,
                "gptq_sequential": self.gptq_sequential,
                "keep_sensitive": self.keep_sensitive,
                "ignore_patterns": list(self.ignore),
            },
        }

    @classmethod
    def from_quantization_config(cls, qc: dict[str, Any]) -> "QuantConfig":
        """Read a checkpoint's ``quantization_config``; refuse anything this version cannot run."""
        if not isinstance(qc, dict):
            raise UnknownSchemeError(f"quantization_config is {type(qc).__name__}, not a mapping; the config.json "
                                     "is not a compressed-tensors checkpoint's")
        if qc.get("quant_method") != "compressed-tensors":
            raise UnknownSchemeError(
                f"quant_method={qc.get('quant_method')!r} is not supported; quantkit loads 'compressed-tensors'"
            )
        if qc.get("quantization_status", "compressed") != "compressed":
            raise UnknownSchemeError(
                f"quantization_status={qc.get('quantization_status')!r} is not supported; expected 'compressed'"
            )
        for part in _UNSUPPORTED_PARTS:
            if qc.get(part):
                raise UnknownSchemeError(f"quantization_config.{part} is set ({qc[part]!r:.80}); quantkit runs "
                                         "weight and input-activation quantization only, without it")
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
            raise UnknownSchemeError(f"config_groups={groups!r:.80} is not a mapping of groups")
        if len(groups) != 1:
            raise UnknownSchemeError(f"{len(groups)} config_groups found; quantkit supports exactly one")
        group = next(iter(groups.values()))
        if group.get("targets", ["Linear"]) != ["Linear"]:
            raise UnknownSchemeError(f"config_groups targets={group.get('targets')!r} is not supported; "
                                     "quantkit quantizes every Linear (targets=['Linear'])")
        if group.get("output_activations"):
            raise UnknownSchemeError(f"config_groups output_activations={group['output_activations']!r:.80} is "
                                     "set; quantkit quantizes weights and input activations only")
        weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
        if not isinstance(weights, dict) or not isinstance(acts, dict):
            raise UnknownSchemeError(f"config_groups weights={weights!r:.80} / input_activations={acts!r:.80} "
                                     "are not mappings")
        kind = weights.get("type")
        # naive-quantized stores the same int8 / float8 tensors (the other two formats derive from it).
        formats = {"int": ("int-quantized", "naive-quantized"), "float": ("float-quantized", "naive-quantized")}
        if (
            kind not in formats
            or qc.get("format", formats[kind][0]) not in formats[kind]
            or weights.get("num_bits") != 8
            or weights.get("strategy") != "channel"
            or not weights.get("symmetric", True)
            or weights.get("dynamic", False)
            or acts.get("num_bits") != 8
            or not acts.get("symmetric", True)
            or acts.get("type") != kind
        ):
            raise UnknownSchemeError(
                f"quantization scheme (format={qc.get('format')!r}, weights={weights}, input_activations={acts}) "
                "is not one this version of quantkit knows; it runs 8-bit symmetric per-channel static weights "
                "and 8-bit symmetric activations"
            )
        if acts.get("strategy") == "token" and acts.get("dynamic") is True:
            activations = "dynamic"
        elif acts.get("strategy") == "tensor" and acts.get("dynamic") is False:
            activations = "static"
        else:
            raise UnknownSchemeError(f"input_activations={acts} is not supported; use per-token dynamic or per-tensor static")
        extra = qc.get("quantkit") or {}
        if not isinstance(extra, dict):
            extra = {}
        fields = {f.name for f in dataclasses.fields(cls)}
        recipe = {k: v for k, v in extra.items() if k in fields and k != "scheme"}
        ignore = qc.get("ignore") or ()
        if isinstance(ignore, str) or not all(isinstance(name, str) for name in ignore):
            raise UnknownSchemeError(f"ignore={ignore!r:.80} is not a list of module names")
        scheme = dict(weight_type="int8" if kind == "int" else "fp8", activations=activations, ignore=tuple(ignore),
                      name=str(extra.get("scheme", "custom")))
        try:
            return cls(**scheme, **recipe)
        except (TypeError, ValueError) as exc:
            # The "quantkit" section only records how the checkpoint was calibrated; running it
            # does not need it, so a damaged record is dropped, not fatal.
            warnings.warn(f"quantization_config.quantkit holds an invalid recipe record ({exc}); ignoring it",
                          stacklevel=2)
            return cls(**scheme)
