"""The fast path's one-launch RoPE: same bits as HF's eager RoPE, only inside marked models."""

import sys

import pytest
import torch

import quantkit
from quantkit.kernels import attention_ops
from quantkit.models import fast_rope
from tests.tiny import make_model


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """Let the dispatcher take CPU tensors (the kernel runs under the interpreter) and count its calls."""
    calls = []
    real = attention_ops.apply_rope

    def counting(q, k, cos, sin, backend="torch"):
        calls.append(backend)
        return real(q, k, cos, sin, backend=backend)

    def takes(q, k, cos, sin):
        return q.dtype in (torch.float16, torch.bfloat16) and all(t.dtype == q.dtype for t in (k, cos, sin))

    monkeypatch.setattr(fast_rope, "_kernel_takes", takes)
    monkeypatch.setattr(attention_ops, "apply_rope", counting)
    yield calls
    restore_modeling_modules()


def restore_modeling_modules():
    """Leave transformers' modeling modules as they were for the rest of the session."""
    for name, module in list(sys.modules.items()):
        current = getattr(module, "apply_rotary_pos_emb", None) if name.startswith("transformers.models.") else None
        if hasattr(current, "quantkit_original"):
            module.apply_rotary_pos_emb = current.quantkit_original


@pytest.mark.parametrize("arch,layers", [("llama", 2), ("gemma3", 3)])
def test_fused_rope_is_bit_identical_and_scoped(kernel_on_cpu, arch, layers):
    torch.manual_seed(0)
    model = make_model(arch, vocab_size=300).to(torch.bfloat16)
    bystander = make_model(arch, vocab_size=300, seed=1).to(torch.bfloat16)
    ids = torch.randint(3, 300, (2, 37))
    with torch.no_grad():
        want = model(ids).logits
        want_bystander = bystander(ids).logits
        names = fast_rope.enable_fused_rope(model)
        assert len(names) == layers and all(n.endswith("self_attn") for n in names)
        got = model(ids).logits
        assert kernel_on_cpu == ["triton"] * layers
        # Another model of the same architecture keeps HF's function (its modules are not marked).
        assert torch.equal(bystander(ids).logits, want_bystander)
        assert kernel_on_cpu == ["triton"] * layers
    assert torch.equal(got, want)
    # Idempotent: a second call neither wraps twice nor adds hooks.
    assert fast_rope.enable_fused_rope(model) == names
    with torch.no_grad():
        model(ids)
    assert kernel_on_cpu == ["triton"] * (2 * layers)


def test_float32_and_cpu_fall_back_to_hf():
    model = make_model("llama", vocab_size=300)
    ids = torch.randint(3, 300, (1, 19))
    with torch.no_grad():
        want = model(ids).logits
        fast_rope.enable_fused_rope(model)
        try:
            assert torch.equal(model(ids).logits, want)
        finally:
            restore_modeling_modules()


def test_optimize_reports_fused_rope_in_both_modes_unless_disabled():
    """The kernel rounds as HF's eager function (bit-equal on an H100, rope_check_s4_h100.json),
    so exact mode routes RoPE too; rope=False keeps HF's function."""
    model = make_model("llama-hd64", vocab_size=300)
    qmodel = quantkit.quantize(model, quantkit.QuantConfig.preset("int8", backend="torch"), progress=False)
    try:
        quantkit.optimize(qmodel, exact=True, rope=False)
        assert qmodel.quantkit_fast_path.fused_rope == []
        quantkit.optimize(qmodel, exact=True)
        assert len(qmodel.quantkit_fast_path.fused_rope) == 2
        quantkit.optimize(qmodel, exact=False)
        assert len(qmodel.quantkit_fast_path.fused_rope) == 2
        assert "one-launch RoPE in 2 attention modules" in str(qmodel.quantkit_fast_path)
    finally:
        restore_modeling_modules()
