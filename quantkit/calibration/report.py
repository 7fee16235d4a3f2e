"""The JSON calibration report: what each algorithm chose, per layer, in one file next to the checkpoint.

Pieces are optional, so a plain dynamic recipe writes a short report and a full recipe a long one:
``smoothquant`` is ``smooth_model``'s return value; ``weight_scales`` / ``input_scales`` map layer
names to scale tensors; ``sensitivity`` is ``rank_layers``'s ranking.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from quantkit.models.loading import write_json


def _summary(values: torch.Tensor) -> dict[str, float]:
    v = values.detach().float().reshape(-1).cpu()
    return {"min": float(v.min()), "median": float(v.median()), "max": float(v.max()), "count": int(v.numel())}


def build_report(
    recipe: dict[str, Any],
    smoothquant: dict | None = None,
    weight_scales: dict[str, torch.Tensor] | None = None,
    input_scales: dict[str, torch.Tensor] | None = None,
    sensitivity: list[tuple[str, float]] | None = None,
    kept_in_16_bits: list[str] | None = None,
) -> dict[str, Any]:
    """A JSON-able dict: the recipe, then one section per algorithm that ran."""
    report: dict[str, Any] = {"recipe": recipe}
    if smoothquant is not None:
        report["smoothquant"] = smoothquant
    layers: dict[str, dict] = {}
    for name, scale in (weight_scales or {}).items():
        layers.setdefault(name, {})["weight_scale"] = _summary(scale)
    for name, scale in (input_scales or {}).items():
        layers.setdefault(name, {})["input_scale"] = float(scale.reshape(-1)[0])
    if layers:
        report["layers"] = layers
    if sensitivity is not None:
        report["sensitivity"] = [{"layer": n, "score": float(s)} for n, s in sensitivity]
    if kept_in_16_bits is not None:
        report["kept_in_16_bits"] = list(kept_in_16_bits)
    return report


def write_report(report: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``report`` as indented JSON, atomically, with the umask's permissions (``write_json``)."""
    return write_json(path, report)
