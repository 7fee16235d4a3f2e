"""Per-channel weight clipping search."""

import pytest
import torch

from quantkit.calibration.weights import search_weight_clip, weight_amax
from quantkit.kernels.reference import cast_to_quantized, qmax_of

DTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]


def _row_error(weight, amax, dtype, column_weight=None):
    scale = (amax / qmax_of(dtype))[:, None]
    err = (weight - cast_to_quantized(weight / scale, dtype).float() * scale).pow(2)
    return err @ column_weight if column_weight is not None else err.sum(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 13), (37, 129)], ids=["1x13", "37x129"])
def test_clip_never_worse_than_absmax(dtype, shape):
    torch.manual_seed(0)
    weight = torch.distributions.StudentT(3.0).sample(shape)
    amax = search_weight_clip(weight, dtype)
    absmax = weight.abs().amax(1)
    assert amax.shape == (shape[0],) and amax.dtype == torch.float32
    assert bool((amax <= absmax).all()) and bool((amax >= 0.5 * absmax - 1e-6).all())
    assert bool((_row_error(weight, amax, dtype) <= _row_error(weight, absmax, dtype) * (1 + 1e-6)).all())


def test_search_returns_the_grid_minimum():
    torch.manual_seed(3)
    weight = torch.distributions.Laplace(0.0, 1.0).sample((5, 257))
    ratios = (0.6, 0.75, 0.9, 1.0)
    amax = search_weight_clip(weight, torch.int8, ratios=ratios)
    absmax = weight.abs().amax(1)
    errors = torch.stack([_row_error(weight, absmax * r, torch.int8) for r in ratios])
    assert torch.allclose(_row_error(weight, amax, torch.int8), errors.min(0).values)


def test_heavy_tailed_rows_get_clipped_int8():
    # Long Laplace rows: the few largest weights are rare enough that saturating them costs less
    # than the coarser step absmax would give every other weight (the optimum is ~0.9 of absmax).
    torch.manual_seed(1)
    weight = torch.distributions.Laplace(0.0, 1.0).sample((7, 20001))
    amax = search_weight_clip(weight, torch.int8)
    absmax = weight.abs().amax(1)
    assert bool((amax < 0.97 * absmax).all())
    assert float(_row_error(weight, amax, torch.int8).sum()) < 0.95 * float(_row_error(weight, absmax, torch.int8).sum())


def test_column_weight_changes_the_choice():
    # A huge importance on each row's largest column makes clipping it expensive: keep the full range.
    torch.manual_seed(2)
    weight = torch.distributions.Laplace(0.0, 1.0).sample((3, 20001))
    weight[:, 11] = weight.abs().amax(1) * 1.01
    importance = torch.ones(20001)
    importance[11] = 1e6
    assert bool((search_weight_clip(weight, torch.int8) < weight.abs().amax(1)).all())
    amax = search_weight_clip(weight, torch.int8, column_weight=importance)
    assert torch.allclose(amax, weight.abs().amax(1))


def test_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        search_weight_clip(torch.randn(5), torch.int8)
    with pytest.raises(ValueError, match="not supported"):
        search_weight_clip(torch.randn(3, 5), torch.float16)
    with pytest.raises(ValueError, match="column_weight"):
        search_weight_clip(torch.randn(3, 5), torch.int8, column_weight=torch.ones(4))
    with pytest.raises(ValueError, match="ratios"):
        search_weight_clip(torch.randn(3, 5), torch.int8, ratios=(0.0, 1.0))


def test_weight_observers_on_a_known_distribution():
    # Rows of 1000 |w| values 0.001, 0.002, ..., 1.000 in random order and sign, one row scaled by 7.
    torch.manual_seed(3)
    base = torch.arange(1, 1001, dtype=torch.float32) / 1000
    rows = [base[torch.randperm(1000)] * torch.where(torch.rand(1000) < 0.5, -1.0, 1.0) for _ in range(3)]
    w = torch.stack(rows) * torch.tensor([[1.0], [7.0], [0.5]])
    expected_max = torch.tensor([1.0, 7.0, 0.5])
    torch.testing.assert_close(weight_amax(w, torch.int8, "absmax"), expected_max)
    # Nearest rank: the 99th percentile of 1000 values is the 990th smallest, 0.990 of the row max.
    torch.testing.assert_close(weight_amax(w, torch.int8, "percentile", 99.0), 0.99 * expected_max)
    torch.testing.assert_close(weight_amax(w, torch.int8, "percentile", 100.0), expected_max)
    mse = weight_amax(w, torch.int8, "mse")
    assert bool((mse <= expected_max + 1e-6).all()) and bool((mse >= 0.5 * expected_max).all())
    with pytest.raises(ValueError, match="observer='median'"):
        weight_amax(w, torch.int8, "median")
    with pytest.raises(ValueError, match="percentile=0"):
        weight_amax(w, torch.int8, "percentile", 0.0)


def test_percentile_weight_observer_runs_through_quantize():
    import quantkit
    from tests.tiny import make_model

    model = make_model("llama", vocab_size=300)
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    config = quantkit.QuantConfig.preset("int8", weight_observer="percentile", percentile=99.0, backend="torch")
    quantkit.quantize(model, config, progress=False)
    name = "model.layers.0.mlp.down_proj"
    layer = model.get_submodule(name)
    amax = weight_amax(weights[name], torch.int8, "percentile", 99.0)
    torch.testing.assert_close(layer.weight_scale.view(-1), amax / 127)
