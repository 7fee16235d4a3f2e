"""Observers: running statistics of the activations entering a Linear during calibration.

An observer sees every calibration batch (``update``) and then names the clipping range
(``amax``) from which a static per-tensor scale is derived: ``scale = amax / qmax``.
"""

from __future__ import annotations

import torch

# Percentile observers keep at most this many samples per layer (uniform subsample per batch),
# so memory stays bounded whatever the calibration size.
MAX_SAMPLES_PER_BATCH = 1 << 16


class Observer:
    """Base class: accumulates statistics, then answers with a clipping value."""

    def update(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def amax(self) -> torch.Tensor:
        """The clipping magnitude as a 0-d float32 tensor."""
        raise NotImplementedError


class AbsMaxObserver(Observer):
    """The largest magnitude ever seen: no clipping, never saturates on calibration data."""

    def __init__(self) -> None:
        self._amax: torch.Tensor | None = None

    def update(self, x: torch.Tensor) -> None:
        batch_amax = x.detach().abs().amax().float().cpu()
        self._amax = batch_amax if self._amax is None else torch.maximum(self._amax, batch_amax)

    def amax(self) -> torch.Tensor:
        if self._amax is None:
            raise RuntimeError("observer saw no data; run calibration batches through the model first")
        return self._amax


class PercentileObserver(Observer):
    """The given percentile of |x| over a bounded subsample: clips rare outliers."""

    def __init__(self, percentile: float = 99.99, seed: int = 0) -> None:
        self.percentile = percentile
        self._samples: list[torch.Tensor] = []
        self._generator = torch.Generator().manual_seed(seed)

    def update(self, x: torch.Tensor) -> None:
        flat = x.detach().abs().float().reshape(-1).cpu()
        if flat.numel() > MAX_SAMPLES_PER_BATCH:
            idx = torch.randint(0, flat.numel(), (MAX_SAMPLES_PER_BATCH,), generator=self._generator)
            # Always keep the batch maximum so a percentile of 100 equals the absmax.
            flat = torch.cat([flat[idx], flat.amax().reshape(1)])
        self._samples.append(flat)

    def amax(self) -> torch.Tensor:
        if not self._samples:
            raise RuntimeError("observer saw no data; run calibration batches through the model first")
        values = torch.cat(self._samples)
        return torch.quantile(values.double(), self.percentile / 100.0).float()


def make_observer(name: str, percentile: float = 99.99) -> Observer:
    if name == "absmax":
        return AbsMaxObserver()
    if name == "percentile":
        return PercentileObserver(percentile)
    raise ValueError(f"observer={name!r} is not available; choose 'absmax' or 'percentile'")
