"""Observers: running statistics of the activations entering a Linear during calibration.

An observer sees every calibration batch (``update``) and then names the clipping range
(``amax``) from which a static per-tensor scale is derived: ``scale = amax / qmax``.

Memory bound: AbsMax keeps one number; Percentile and MSE keep a uniform random subsample of
|x| of at most ``MAX_SAMPLES`` values (4 MiB of float32) per observed layer, plus the exact max.
"""

from __future__ import annotations

import torch

from quantkit.kernels.reference import cast_to_quantized, qmax_of

# Each batch contributes at most this many |x| samples (uniform subsample) ...
MAX_SAMPLES_PER_BATCH = 1 << 16
# ... and an observer keeps at most this many in total: when the store overflows it is halved
# by random decimation, which keeps it a uniform sample of everything seen so far (up to the
# per-batch weighting). torch.quantile also refuses inputs above 2**24 elements.
MAX_SAMPLES = 1 << 20

# Clipping ratios the MSE observer tries, as fractions of the observed absmax. Below 0.2 the
# clipped mass is never worth it for 8-bit grids; 1.0 is included so the search can never do
# worse than absmax on the samples it saw.
MSE_CLIP_RATIOS = tuple(0.2 + 0.8 * i / 79 for i in range(80))
# The MSE search scores each ratio on at most this many samples (80 ratios x 2**18 values keeps
# one layer's search well under a second on a CPU core).
MSE_SEARCH_SAMPLES = 1 << 18


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


class _SampledObserver(Observer):
    """Keeps a bounded uniform subsample of |x| and the exact running max."""

    def __init__(self, seed: int = 0) -> None:
        self._samples: list[torch.Tensor] = []
        self._count = 0
        self._rate = 1.0  # the share of each new batch kept: halved at every thinning, so all batches weigh alike
        self._max: torch.Tensor | None = None
        self._generator = torch.Generator().manual_seed(seed)

    def update(self, x: torch.Tensor) -> None:
        flat = x.detach().abs().float().reshape(-1).cpu()
        if flat.numel() == 0:
            return
        batch_max = flat.amax()
        self._max = batch_max if self._max is None else torch.maximum(self._max, batch_max)
        if flat.numel() > MAX_SAMPLES_PER_BATCH:
            idx = torch.randint(0, flat.numel(), (MAX_SAMPLES_PER_BATCH,), generator=self._generator)
            flat = flat[idx]
        if self._rate < 1.0:
            flat = flat[torch.rand(flat.numel(), generator=self._generator) < self._rate]
        self._samples.append(flat)
        self._count += flat.numel()
        if self._count > MAX_SAMPLES:
            merged = torch.cat(self._samples)
            keep = torch.randperm(merged.numel(), generator=self._generator)[: merged.numel() // 2]
            self._samples, self._count = [merged[keep]], keep.numel()
            self._rate /= 2

    def _values(self) -> torch.Tensor:
        if self._max is None:
            raise RuntimeError("observer saw no data; run calibration batches through the model first")
        # The exact max always takes part, so a percentile of 100 equals the absmax.
        return torch.cat(self._samples + [self._max.reshape(1)])


class PercentileObserver(_SampledObserver):
    """The given percentile of |x| over a bounded subsample: clips rare outliers."""

    def __init__(self, percentile: float = 99.99, seed: int = 0) -> None:
        super().__init__(seed)
        if not 0.0 < percentile <= 100.0:
            raise ValueError(f"percentile={percentile} must be in (0, 100]")
        self.percentile = percentile

    def amax(self) -> torch.Tensor:
        values = self._values().double()
        if not bool(torch.isfinite(self._max)):
            # NaN or inf in the activations: reported as absmax reports them (the converter then
            # names the layer), not hidden behind a finite percentile of the rest.
            return self._max.float()
        # kthvalue instead of torch.quantile: no 2**24 size limit. Nearest-rank definition.
        k = max(1, min(values.numel(), int(round(self.percentile / 100.0 * values.numel()))))
        return values.kthvalue(k).values.float()


def quantization_mse(values: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Mean squared error of symmetric per-tensor fake quantization of ``values`` clipped at each ``amax``.

    values: (S,) samples; amax: (R,) candidate clipping values. Returns (R,) float64.
    The rounding is reference.py's, so FP8's non-uniform grid is scored as the kernels round.
    """
    scale = (amax.double() / qmax_of(dtype)).clamp_min(1e-30)
    v = values.double()
    errors = []
    for s in scale:
        dequant = cast_to_quantized(v / s, dtype, activation=True).double() * s
        errors.append((v - dequant).pow(2).mean())
    return torch.stack(errors)


class MSEObserver(_SampledObserver):
    """The clipping value, a fraction of the absmax, that minimizes the per-tensor quantization MSE.

    The MSE is measured on the subsample of |x| (symmetric quantization, so the sign does not
    matter) for each ratio of ``MSE_CLIP_RATIOS``; heavy-tailed inputs get clipped, light-tailed
    ones keep (nearly) the absmax.
    """

    def __init__(self, dtype: torch.dtype = torch.int8, ratios: tuple[float, ...] = MSE_CLIP_RATIOS, seed: int = 0):
        super().__init__(seed)
        qmax_of(dtype)  # validates the dtype
        if not ratios or any(not 0.0 < r <= 1.0 for r in ratios):
            raise ValueError(f"clip ratios must be non-empty and in (0, 1]; got {ratios}")
        self.dtype = dtype
        self.ratios = torch.tensor(sorted(ratios), dtype=torch.float64)

    def amax(self) -> torch.Tensor:
        values = self._values()
        if values.numel() > MSE_SEARCH_SAMPLES:
            idx = torch.randperm(values.numel(), generator=self._generator)[:MSE_SEARCH_SAMPLES]
            values = values[idx]
        absmax = self._max.double()
        if absmax == 0:
            return absmax.float()
        candidates = self.ratios * absmax
        mse = quantization_mse(values, candidates, self.dtype)
        return candidates[int(torch.argmin(mse))].float()


def make_observer(name: str, percentile: float = 99.99, dtype: torch.dtype = torch.int8) -> Observer:
    """The observer named by ``QuantConfig.activation_observer``; ``dtype`` is the quantized type (MSE needs it)."""
    if name == "absmax":
        return AbsMaxObserver()
    if name == "percentile":
        return PercentileObserver(percentile)
    if name == "mse":
        return MSEObserver(dtype)
    raise ValueError(f"observer={name!r} is not available; choose 'absmax', 'percentile' or 'mse'")
