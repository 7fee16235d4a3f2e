"""The registered custom ops: opcheck, torch.compile(fullgraph=True), and ops.py's dispatch."""

import pytest
import torch

from quantkit.kernels import ops, reference, triton_ops

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# test_schema compares inputs before/after with torch.allclose, which CPU torch does not
# implement for float8 tensors; the other three checks run for fp8.
FP8_UTILS = ALL_UTILS[1:]


def _operands(dtype, M=13, N=32, K=64, rows=None):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen)
    a, a_scale = reference.quantize_per_token(x, dtype)
    w, w_scale = reference.quantize_per_channel(torch.randn(rows or N, K, generator=gen), dtype)
    return x, a, a_scale, w, w_scale, torch.randn(N, generator=gen)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_opcheck(dtype):
    utils = ALL_UTILS if dtype == torch.int8 else FP8_UTILS
    x, a, a_scale, w, w_scale, bias = _operands(dtype)
    _, _, _, w2, w2_scale, _ = _operands(dtype, rows=64)
    weight = torch.randn(64)
    cases = [
        (triton_ops._scaled_mm_op, (a, w, a_scale, w_scale, bias, "silu", torch.bfloat16)),
        (triton_ops._scaled_mm_op, (a, w, a_scale[:1].clone(), w_scale[:1].clone(), None, "none", torch.float32)),
        (triton_ops._gated_scaled_mm_op, (a, w2, a_scale, w2_scale, "gelu_tanh", torch.bfloat16)),
        (triton_ops._quantize_per_token_op, (x, dtype)),
        (triton_ops._quantize_per_tensor_op, (x, torch.tensor([0.03]), dtype)),
        (triton_ops._rms_norm_quant_op, (x, weight, 1e-6, dtype, 1.0)),
        (triton_ops._add_rms_norm_quant_op, (x, torch.randn_like(x), weight, 1e-6, dtype, 0.0)),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args, test_utils=utils)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_module_compiles_fullgraph(dtype):
    x, _, _, w, w_scale, bias = _operands(dtype)
    _, _, _, w2, w2_scale, _ = _operands(dtype, N=16, K=32, rows=32)
    norm_weight = torch.randn(64)

    class TinyQuantMLP(torch.nn.Module):
        def forward(self, x, residual):
            q, s, residual = ops.rms_norm_quant_per_token(x, norm_weight, 1e-6, dtype, residual, 1.0, backend="triton")
            h = ops.scaled_mm(q, w, s, w_scale, bias, "none", torch.float32, backend="triton")
            q2, s2 = ops.quantize_per_token(h, dtype, backend="triton")
            return ops.gated_scaled_mm(q2, w2, s2, w2_scale, "silu", torch.float32, backend="triton"), residual

    module = TinyQuantMLP()
    residual = torch.randn_like(x)
    eager = module(x, residual)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")(x, residual)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


_COMPILE_FIRST = """
import torch
from quantkit.kernels import ops, reference
from quantkit.nn.linear import QuantLinear

torch.manual_seed(0)
layer = QuantLinear.from_linear(torch.nn.Linear(64, 48), torch.int8, backend="triton")
backend = ops.resolve_backend("triton", "cpu")
w, w_scale = reference.quantize_per_channel(torch.randn(32, 48), torch.float8_e4m3fn)

def f(x):
    q, s = ops.quantize_per_token(layer(x), torch.float8_e4m3fn, backend=backend)
    return ops.scaled_mm(q, w, s, w_scale, None, "silu", torch.float32, backend=backend)

x = torch.randn(13, 64)
compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x)  # the first call of anything
assert torch.equal(compiled, f(x))
print("compiled first: ok")
"""


def test_fullgraph_compile_before_any_eager_call():
    """A model's first forward may be a traced one: choosing the "triton" backend (resolve_backend,
    a QuantLinear built for it) imports the kernel modules then, since torch.compile cannot trace
    the lazy import. A fresh process, so no earlier test has imported them."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_FIRST], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled first: ok" in run.stdout, run.stderr[-3000:]


def test_triton_and_torch_backends_agree_through_ops():
    for dtype in (torch.int8, torch.float8_e4m3fn):
        x, a, a_scale, w, w_scale, bias = _operands(dtype)
        results = {}
        for backend in ("torch", "triton"):
            q, s = ops.quantize_per_token(x, dtype, backend=backend)
            results[backend] = ops.scaled_mm(q, w, s, w_scale, bias, "relu", torch.float32, backend=backend)
        torch.testing.assert_close(results["triton"], results["torch"], rtol=1e-6, atol=1e-6)


def test_fake_impl_rejects_bad_input_while_tracing():
    _, a, a_scale, w, w_scale, _ = _operands(torch.int8)

    def f(a, w):
        return ops.scaled_mm(a, w, a_scale, w_scale, None, "none", torch.float32, backend="triton")

    with pytest.raises(Exception, match="K mismatch"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(a, w[:, :48].contiguous())


def test_fake_impls_validate_like_the_kernels():
    """Each registered op's fake implementation (what torch.compile traces with) refuses the bad
    calls the kernel refuses: run under FakeTensorMode, where only the fake runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, a, a_scale, w, w_scale, bias = _operands(torch.int8)
    _, _, _, w3, w3_scale, _ = _operands(torch.int8, rows=3)
    weight = torch.randn(64)
    cases = [
        (triton_ops._scaled_mm_op, (a, w[:, :48], a_scale, w_scale, None, "none", torch.float32), "K mismatch"),
        (triton_ops._scaled_mm_op, (a, w, a_scale[:5], w_scale, bias, "none", torch.float32), "a_scale"),
        (triton_ops._gated_scaled_mm_op, (a, w3, a_scale, w3_scale, "silu", torch.float32), "has 3 rows"),
        (triton_ops._quantize_per_token_op, (x[None], torch.int8), "must be 2-D"),
        (triton_ops._quantize_per_tensor_op, (x, torch.tensor([0.1, 0.2]), torch.int8), "2 elements"),
        (triton_ops._rms_norm_quant_op, (x, torch.randn(7), 1e-6, torch.int8, 0.0), "weight has shape"),
        (triton_ops._rms_norm_quant_op, (x, weight, -1.0, torch.int8, 0.0), "eps=-1.0"),
        (triton_ops._add_rms_norm_quant_op, (x, x[:3], weight, 1e-6, torch.int8, 1.0), "residual shape"),
        (triton_ops._add_rms_norm_quant_op, (x, x, weight, 1e-6, torch.int8, float("inf")), "offset=inf"),
    ]
    for op, args, message in cases:
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises((ValueError, TypeError), match=message):
            op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True):  # and a good call gets the kernel's shapes
        out = triton_ops._gated_scaled_mm_op(a, w, a_scale, w_scale, "silu", torch.bfloat16)
        assert out.shape == (13, 16) and out.dtype == torch.bfloat16


def test_resolve_backend():
    assert ops.resolve_backend("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="backend='cuda'"):
        ops.resolve_backend("cuda", "cpu")


def test_direct_eager_launch_equals_the_registered_ops(monkeypatch):
    """Eager calls skip the custom-op dispatcher; results are the op's bit for bit, and tracing
    (torch.compile) still goes through the op (test_module_compiles_fullgraph)."""
    calls = []
    real = triton_ops._scaled_mm_op
    monkeypatch.setattr(triton_ops, "_scaled_mm_op", lambda *a: calls.append(1) or real(*a))
    for dtype in (torch.int8, torch.float8_e4m3fn):
        x, _, _, w, w_scale, bias = _operands(dtype)
        norm_weight = torch.randn(64)
        results = []
        for direct in (True, False):
            monkeypatch.setattr(triton_ops, "DIRECT_EAGER_LAUNCH", direct)
            q, s = ops.quantize_per_token(x, dtype, backend="triton")
            q2, s2, res = ops.rms_norm_quant_per_token(x, norm_weight, 1e-6, dtype, x.flip(0), 1.0, backend="triton")
            results.append((q, s, q2, s2, res, ops.scaled_mm(q, w, s, w_scale, bias, "silu", torch.bfloat16,
                                                             backend="triton")))
        for a, b in zip(*results):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    assert len(calls) == 2  # only the DIRECT_EAGER_LAUNCH=False passes went through the op
    assert not triton_ops.direct_launch(torch.nn.Parameter(torch.randn(2)))  # subclasses take the op


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_both_backends_refuse_the_same_bad_calls(backend):
    """The torch backend validates as the kernels do (it used to return wrong results: scales applied
    along the wrong axis of a 3-D input, int8 outputs that wrapped around, a 3-row gated weight)."""
    x, a, a_scale, w, w_scale, bias = _operands(torch.int8)
    _, _, _, w3, w3_scale, _ = _operands(torch.int8, rows=3)
    cases = [
        (lambda: ops.quantize_per_token(x[None], torch.int8, backend=backend), "must be 2-D"),
        (lambda: ops.quantize_per_token(x, torch.float8_e5m2, backend=backend), "not a quantized dtype"),
        (lambda: ops.quantize_per_tensor(x, 0.5, torch.int8, backend=backend), "1-element float32 tensor"),
        (lambda: ops.scaled_mm(a, w, a_scale, w_scale, None, "none", torch.int8, backend=backend), "out_dtype"),
        (lambda: ops.scaled_mm(a, w.float(), a_scale, w_scale, backend=backend), "w.dtype"),
        (lambda: ops.scaled_mm(a, w[:, :32], a_scale, w_scale, backend=backend), "K mismatch"),
        (lambda: ops.scaled_mm(a, w, a_scale.half(), w_scale, backend=backend), "a_scale.dtype"),
        (lambda: ops.scaled_mm(a, w, a_scale, w_scale, bias[:1], backend=backend), "bias"),
        (lambda: ops.scaled_mm(a[:, :0], w[:, :0], a_scale, w_scale, backend=backend), "K=0"),
        (lambda: ops.gated_scaled_mm(a, w3, a_scale, w3_scale, backend=backend), "has 3 rows"),
        (lambda: ops.rms_norm_quant_per_token(x, torch.randn(7), 1e-6, torch.int8, backend=backend), "weight has shape"),
        (lambda: ops.scaled_mm(a, w, 0.5, w_scale, backend=backend), "a_scale is a float"),
        (lambda: ops.scaled_mm(a, w, a_scale, w_scale, 0.0, backend=backend), "bias is a float"),
        (lambda: ops.quantize_per_token(x.tolist(), torch.int8, backend=backend), "must be a"),
        (lambda: ops.rms_norm_quant_per_token(x, torch.randn(64), 1e-6, torch.int8, None, "1", backend=backend),
         "offset='1'"),
        (lambda: ops.rms_norm_quant_per_token(x, torch.randn(64), 1e-6, torch.int8, None, float("nan"),
                                              backend=backend), "offset=nan"),
        (lambda: ops.rms_norm_quant_per_token(x, [1.0] * 64, 1e-6, torch.int8, backend=backend), "weight is a list"),
        (lambda: ops.rms_norm_quant_per_token(x, torch.randn(64), 1e-6, torch.int8, 0.0, backend=backend),
         "residual is a float"),
    ]
    for call, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            call()


def test_cached_launch_path_names_a_non_tensor_argument(monkeypatch):
    """On a GPU the launchers key a signature cache on their arguments' shapes before validating
    (off under the interpreter): a non-tensor scale, bias, weight or residual must still get the
    checks' error, not an AttributeError from building the key."""
    from quantkit.kernels import gemm, quant

    monkeypatch.setattr(gemm, "INTERPRETED", False)
    x, a, a_scale, w, w_scale, bias = _operands(torch.int8)
    _, _, _, w2, w2_scale, _ = _operands(torch.int8, rows=64)
    cases = [
        (lambda: gemm.scaled_mm(a, w, 0.5, w_scale), "a_scale is a float"),
        (lambda: gemm.scaled_mm(a, w, a_scale, w_scale, bias.tolist()), "bias is a list"),
        (lambda: gemm.gated_scaled_mm(a, w2, a_scale, 2.0), "w_scale is a float"),
        (lambda: quant.quantize_per_token(x.tolist(), torch.int8), "must be a"),
        (lambda: quant.rms_norm_quant_per_token(x, [1.0] * 64, 1e-6, torch.int8), "weight is a list"),
        (lambda: quant.rms_norm_quant_per_token(x, torch.randn(64), 1e-6, torch.int8, 1.0), "residual is a float"),
    ]
    for call, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            call()


def test_unknown_backend_is_refused():
    x, a, a_scale, w, w_scale, _ = _operands(torch.int8)
    for backend in ("auto", "Triton"):
        with pytest.raises(ValueError, match=f"backend='{backend}'"):
            ops.scaled_mm(a, w, a_scale, w_scale, backend=backend)
        with pytest.raises(ValueError, match=f"backend='{backend}'"):
            ops.quantize_per_token(x, torch.int8, backend=backend)


def test_fake_and_real_scaled_mm_agree_on_k0():
    from torch._subclasses.fake_tensor import FakeTensorMode

    a = torch.empty_strided((4, 0), (16, 1), dtype=torch.int8)
    w = torch.empty_strided((8, 0), (16, 1), dtype=torch.int8)
    args = (a, w, torch.ones(4), torch.ones(8), None, "none", torch.bfloat16)
    with pytest.raises(ValueError, match="K=0"):
        triton_ops._scaled_mm_op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match="K=0"):
        triton_ops._scaled_mm_op(*args)
