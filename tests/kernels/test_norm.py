"""RMSNorm / LayerNorm kernels (+ fused residual add, Gemma's 1 + w) vs twins and torch/HF."""

import pytest
import torch
import torch.nn.functional as F

from quantkit.kernels import attention_ops


SHAPES = [(1, 64), (13, 640), (7, 1), (5, 4097)]
IDS = [f"{m}x{n}" for m, n in SHAPES]


@pytest.mark.parametrize("rows,hidden", SHAPES, ids=IDS)
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_rms_norm_fp32(rows, hidden, offset, poisoned_empty):
    torch.manual_seed(rows + hidden)
    x, residual, weight = torch.randn(rows, hidden) * 3, torch.randn(rows, hidden), torch.randn(hidden)
    y, res = attention_ops.rms_norm(x, weight, 1e-6, None, offset, backend="triton")
    assert res is None
    torch.testing.assert_close(y, F.rms_norm(x, (hidden,), weight + offset, 1e-6), rtol=1e-5, atol=1e-5)
    y, res = attention_ops.rms_norm(x, weight, 1e-6, residual, offset, backend="triton")
    y_twin, res_twin = attention_ops.rms_norm(x, weight, 1e-6, residual, offset, backend="torch")
    torch.testing.assert_close(res, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(y, F.rms_norm(x + residual, (hidden,), weight + offset, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, y_twin, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,hidden", SHAPES, ids=IDS)
def test_layer_norm_fp32(rows, hidden, poisoned_empty):
    torch.manual_seed(rows * hidden)
    x, residual = torch.randn(rows, hidden) * 3 + 1, torch.randn(rows, hidden)
    weight, bias = torch.randn(hidden), torch.randn(hidden)
    y, res = attention_ops.layer_norm(x, weight, bias, 1e-5, None, backend="triton")
    assert res is None
    torch.testing.assert_close(y, F.layer_norm(x, (hidden,), weight, bias, 1e-5), rtol=1e-5, atol=1e-5)
    y, res = attention_ops.layer_norm(x, weight, None, 1e-5, residual, backend="triton")
    torch.testing.assert_close(res, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(y, F.layer_norm(x + residual, (hidden,), weight, None, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_bf16_3d_gemma():
    """bf16 (B, S, H) input as a model hands it over; Gemma-3's norm in fp32 is the oracle."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(6)
    hidden = 640
    x, residual = torch.randn(2, 13, hidden).bfloat16(), torch.randn(2, 13, hidden).bfloat16()
    norm = Gemma3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    y, res = attention_ops.rms_norm(x, norm.weight.data, 1e-6, residual, 1.0, backend="triton")
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    summed = (x.float() + residual.float()).bfloat16()
    # the interpreter truncates fp32 -> bf16 (GPU.md), so allow one bf16 ulp on the residual
    torch.testing.assert_close(res.float(), summed.float(), rtol=2 ** -7, atol=0)
    ref = norm(summed.float())
    rel = (y.float() - ref).norm() / ref.norm()
    # bf16 output truncated by the interpreter: up to 2**-7 of each value, 4.3e-3 here in norm;
    # a missing offset or residual costs tens of percent.
    assert rel < 6e-3


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_norm_bad_input_raises(backend):
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight must be"):
        attention_ops.rms_norm(x, torch.randn(63), 1e-6, backend=backend)
    with pytest.raises(ValueError, match="residual"):
        attention_ops.rms_norm(x, torch.randn(64), 1e-6, residual=x.half(), backend=backend)
    with pytest.raises(ValueError, match="dtype"):
        attention_ops.layer_norm(x.double(), torch.randn(64), None, 1e-5, backend=backend)
    with pytest.raises(ValueError, match="bias must be"):
        attention_ops.layer_norm(x, torch.randn(64), torch.randn(3), 1e-5, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_norm_takes_strided_weight_and_bias(backend):
    # The kernels read weight and bias with unit stride: views with another stride used to be
    # read as if contiguous (every other element, or past the end for an expanded weight).
    x = torch.randn(5, 64)
    stacked = torch.randn(2, 128)
    weight, bias = stacked[0, ::2], stacked[1, 1::2]
    for w in (weight, torch.tensor([1.7]).expand(64)):
        got, _ = attention_ops.rms_norm(x, w, 1e-6, backend=backend)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    got, _ = attention_ops.layer_norm(x, weight, bias, 1e-5, backend=backend)
    torch.testing.assert_close(got, torch.nn.functional.layer_norm(x, (64,), weight, bias, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("eps", [-1e-6, float("nan"), None])
def test_norm_refuses_a_bad_eps(backend, eps):
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="eps="):
        attention_ops.rms_norm(x, torch.randn(64), eps, backend=backend)
    with pytest.raises(ValueError, match="eps="):
        attention_ops.layer_norm(x, torch.randn(64), None, eps, backend=backend)
