"""optimize(): the fast path is bit-identical to the plain QuantLinear model in exact mode.

Tiny random Llama (GQA, SiLU) and Gemma-3 (MQA, tanh GELU, (1 + w) norms, sliding window) models
on CPU, torch backend; fp32 (gated kernel path) and bf16 (shared-quantization two-GEMM path).
"""

import copy

import pytest
import torch
from torch import nn

import quantkit
from quantkit.models import fast_norm
from quantkit.config import QuantConfig
from quantkit.generate import generate
from quantkit.models.fast_path import FastRMSNorm, FusedQKV, GatedQuantMLP, QKVProjection, kernel_activation_of, optimize
from quantkit.nn import QuantLinear
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)


# Tiny random models with head_dim 64 (what quantkit's attention kernels take); test_generate uses them too.
COMMON = dict(vocab_size=160, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_tiny(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, attention_bias=True, **COMMON))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(
            hidden_size=128, intermediate_size=224, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, use_sliding_window=False, **COMMON))
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            hidden_size=128, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=64, sliding_window=6, query_pre_attn_scalar=64,
            layer_types=["sliding_attention", "full_attention"], **COMMON))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; spread them so that greedy choices are not ties.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
        model.lm_head.weight.mul_(8.0)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def _quantized(arch, scheme, dtype):
    model = make_tiny(arch).to(dtype)
    return quantkit.quantize(model, QuantConfig.preset(scheme), progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_exact_fast_path_gives_identical_logits(arch, scheme, dtype):
    plain = _quantized(arch, scheme, dtype)
    plain.set_attn_implementation(quantkit.models.fast_attention.register_quantkit_attention(backend="torch"))
    fast = optimize(copy.deepcopy(plain), exact=True)
    report = fast.quantkit_fast_path
    assert len(report.fused_mlps) == plain.config.num_hidden_layers
    assert not any(isinstance(m, QuantLinear) and name.endswith(("gate_proj", "up_proj"))
                   for name, m in fast.named_modules())
    if dtype == torch.float32:
        # fp32 on the torch backend: the gated kernel is the plain path's arithmetic.
        assert len(report.exact_gated_kernel_mlps) == len(report.fused_mlps)
    else:
        assert report.exact_gated_kernel_mlps == []
    if arch == "gemma3":
        assert report.swapped_norms, "Gemma's (1 + w) RMSNorm is exact on the torch backend"
    if arch == "llama" and dtype == torch.bfloat16:
        # Llama rounds to bf16 before the weight multiply; the op does not: not exact, kept.
        assert report.swapped_norms == []
    ids = torch.randint(3, plain.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = plain(ids).logits
        got = fast(ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_exact_mode_stays_exact_after_a_cast(arch, caplog, monkeypatch):
    """optimize(exact=True) verifies bit-equality in the model's dtype at that time: cast to bf16
    afterwards, it used to run fp32-verified fused norms and gated MLPs in bf16 (Qwen2: 62 of 160
    greedy tokens differed). Those now run the model's own arithmetic in any other dtype."""
    monkeypatch.setattr(fast_norm, "_WARNED_CASTS", set())  # warned once a process
    model = _quantized(arch, "int8", torch.float32)
    fast = optimize(copy.deepcopy(model), exact=True).to(torch.bfloat16)
    plain = model.to(torch.bfloat16)
    plain.set_attn_implementation(quantkit.models.fast_attention.register_quantkit_attention(backend="torch"))
    ids = torch.randint(3, plain.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), caplog.at_level("WARNING"):
        assert torch.equal(fast(ids).logits, plain(ids).logits)
    assert torch.equal(generate(fast, ids, 12, eos_token_id=None), generate(plain, ids, 12, eos_token_id=None))
    if fast.quantkit_fast_path.swapped_norms:
        assert caplog.text.count("call optimize() again after changing the model's dtype") == 1


def test_inexact_mode_uses_gated_kernel_and_stays_close():
    # exact=False in bf16: the fused kernel's fp32 act(gate) * up with one cast differs from the
    # plain path's bf16-rounded gate and up by bf16 rounding only.
    plain = _quantized("gemma3", "fp8", torch.bfloat16)
    plain_mlp = plain.model.layers[0].mlp
    fast = optimize(copy.deepcopy(plain), exact=False)
    fused = fast.model.layers[0].mlp
    assert isinstance(fused, GatedQuantMLP) and fused.uses_gated_kernel(torch.bfloat16)
    # Compare before down_proj: its FP8 requantization turns a 1-ulp bf16 difference into a whole
    # FP8 step (3 mantissa bits) now and then, which says nothing about the gated product itself.
    plain_mlp.down_proj = fused.down_proj = nn.Identity()
    x = torch.randn(13, plain.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.no_grad():
        want = plain_mlp(x).float()
        got = fused(x).float()
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 1e-2


def test_optimize_again_switches_exactness():
    model = optimize(_quantized("llama", "int8", torch.float32), exact=True)
    assert all(m.exact for m in model.modules() if isinstance(m, GatedQuantMLP))
    optimize(model, exact=False)
    assert all(not m.exact for m in model.modules() if isinstance(m, GatedQuantMLP))


@pytest.mark.parametrize("second", [dict(exact=True), dict(exact=True, norms=False)], ids=["exact", "exact-no-norms"])
def test_optimize_exact_after_inexact_gives_the_plain_logits(second):
    # exact=False swaps norms that are only close (and defers them); a later exact=True must undo
    # that as on a fresh model, not keep them (bf16 logits differed by up to 0.047 before).
    plain = _quantized("llama", "int8", torch.bfloat16)
    plain.set_attn_implementation(quantkit.models.fast_attention.register_quantkit_attention(backend="torch"))
    ids = torch.randint(3, plain.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3))
    model = optimize(copy.deepcopy(plain), exact=False)
    assert model.quantkit_fast_path.swapped_norms and model.quantkit_fast_path.deferred_norms
    optimize(model, **second)
    assert not any(isinstance(m, FastRMSNorm) for m in model.modules())
    assert model.quantkit_fast_path.deferred_norms == []
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, plain(ids, use_cache=False).logits)
    optimize(model, exact=False)  # and back: swapped and deferred again
    assert model.quantkit_fast_path.deferred_norms
    assert not any("original" in key for key in model.state_dict())  # the kept original is no submodule
    model.float()  # a cast after the swap reaches the original put back by the next call
    optimize(model, **second)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(m.weight.dtype == torch.float32 for m in norms)


def test_static_input_gate_up_share_one_scale():
    plain = _quantized("llama", "int8", torch.float32)
    for module in plain.modules():
        if isinstance(module, QuantLinear) and module.in_features == plain.config.hidden_size:
            module.static_input = True
            module.input_scale = torch.full((1,), 0.05)
    fast = optimize(copy.deepcopy(plain))
    ids = torch.randint(3, plain.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(fast(ids).logits, plain(ids).logits)


def test_static_input_scale_of_fused_modules_moves_with_the_model():
    # The fused q/k/v and gate/up modules keep the calibrated input scale as a buffer: .to()
    # moves it and state_dict carries it (a plain attribute stayed behind on the old device).
    torch.manual_seed(3)
    model = make_tiny("llama")
    blocks = torch.randint(3, model.config.vocab_size, (2, 16))
    fast = optimize(quantkit.quantize(model, QuantConfig.preset("int8-static"), blocks, progress=False))
    fused = [m for m in fast.modules() if isinstance(m, (FusedQKV, GatedQuantMLP))]
    assert fused and all(m.static_input for m in fused)
    names = set(fast.state_dict())
    for name, module in fast.named_modules():
        if isinstance(module, (FusedQKV, GatedQuantMLP)):
            assert f"{name}.input_scale" in names
            assert float(module.input_scale) > 0
    fast.to("meta")
    assert all(m.input_scale.device.type == "meta" for m in fused)


def test_fused_qkv_shared_by_two_threads_gives_each_its_own_projections(monkeypatch):
    # Each GEMM's output lives in a list of its own: a thread between its check and its read
    # never sees the other thread's output (the stash changed in place did, ~1 % of the parts).
    import sys
    import threading

    fused = FusedQKV([QuantLinear(16, n, False, torch.int8, False) for n in (16, 8, 8)], [False, False, True],
                     exact=False)

    def tagged_gemm(self, x, start, stop, dtype):
        return torch.full((x.shape[0], stop - start), float(x[0, 0]))

    monkeypatch.setattr(FusedQKV, "_gemm", tagged_gemm)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    wrong, errors = [], []

    def worker(tag):
        try:
            for _ in range(2000):
                x = torch.full((2, 16), float(tag))
                for index in range(3):
                    if not bool((fused.project(x, index) == tag).all()):
                        wrong.append(tag)
        except Exception as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(repr(exc))

    try:
        threads = [threading.Thread(target=worker, args=(tag,)) for tag in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and not wrong


def test_saving_an_optimized_model_is_refused_and_writes_nothing(tmp_path):
    from quantkit.checkpoint import CheckpointError

    fast = optimize(_quantized("llama", "int8", torch.float32), exact=False)
    with pytest.raises(CheckpointError, match="optimize"):
        quantkit.save(fast, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_unquantized_model_is_refused():
    with pytest.raises(ValueError, match="quantize"):
        optimize(make_tiny("llama"))


def test_norm_swap_matches_gemma_offset():
    model = _quantized("gemma3", "int8", torch.float32)
    norm = model.model.norm
    x = torch.randn(3, 5, norm.weight.shape[0])
    optimize(model)
    assert isinstance(model.model.norm, FastRMSNorm) and model.model.norm.offset == 1.0
    with torch.no_grad():
        torch.testing.assert_close(model.model.norm(x), norm(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "act, want",
    [(nn.SiLU(), ("silu", True)), (nn.GELU(approximate="tanh"), ("gelu_tanh", True)), (nn.GELU(), ("gelu", True)),
     (nn.Tanh(), None)],
    ids=["silu", "gelu_tanh", "gelu", "tanh"],
)
def test_activation_is_found_by_probing(act, want):
    assert kernel_activation_of(act) == want


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_inexact_fused_qkv_is_one_gemm_and_equal_for_int8(arch, monkeypatch):
    # INT8 on the torch backend: exact int32 accumulation and a per-element epilogue, so one GEMM
    # over the stacked [q; k; v] weight gives the three projections' bits.
    plain = _quantized(arch, "int8", torch.float32)
    fast = optimize(copy.deepcopy(plain), exact=False, norms=False)
    layers = plain.config.num_hidden_layers
    assert len(fast.quantkit_fast_path.fused_qkv) == layers
    attn = fast.model.layers[0].self_attn
    assert isinstance(attn.qkv_fused, FusedQKV) and isinstance(attn.q_proj, QKVProjection)
    reference = optimize(copy.deepcopy(plain), exact=False, norms=False, qkv=False)
    from quantkit.kernels import ops

    calls = []
    real = ops.scaled_mm
    monkeypatch.setattr(ops, "scaled_mm", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    ids = torch.randint(3, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got = fast(ids).logits
        n_fused = len(calls)
        want = reference(ids).logits
    assert torch.equal(got, want)
    assert len(calls) - n_fused - n_fused == 2 * layers  # q/k/v: 1 GEMM per layer instead of 3
    # Once q, k and v took their parts, the stash holds neither the input nor the output.
    assert all(fast.model.layers[i].self_attn.qkv_fused._stash[0] is None
               and fast.model.layers[i].self_attn.qkv_fused._stash[2] is None for i in range(layers))


def test_fused_qkv_recomputes_for_a_new_or_changed_input_and_copies_v():
    plain = _quantized("llama", "int8", torch.float32)
    attn = plain.model.layers[0].self_attn
    q_lin, k_lin, v_lin = attn.q_proj, attn.k_proj, attn.v_proj
    optimize(plain, exact=False, norms=False, attention=False)
    q_proj, k_proj, v_proj = attn.q_proj, attn.k_proj, attn.v_proj
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, plain.config.hidden_size, generator=gen)
    y = torch.randn(2, 5, plain.config.hidden_size, generator=gen)
    with torch.no_grad():
        q = q_proj(x)
        assert not q.is_contiguous()  # a view of the stacked output
        k_other = k_proj(y)  # another input: computed for y, not taken from x's stash
        assert torch.equal(k_other, k_lin(y))
        x.mul_(2.0)  # changed in place: the version counter moves, the stash is stale
        assert torch.equal(k_proj(x), k_lin(x))
        assert torch.equal(q_proj(x), q_lin(x))
        v = v_proj(x)
        assert v.is_contiguous() and torch.equal(v, v_lin(x))
        assert torch.equal(q, q_lin(x / 2.0))


def test_optimize_again_switches_fused_qkv_exactness():
    model = optimize(_quantized("llama", "fp8", torch.float32), exact=False)
    assert all(not m.exact for m in model.modules() if isinstance(m, FusedQKV))
    optimize(model, exact=True)
    assert all(m.exact for m in model.modules() if isinstance(m, FusedQKV))
    assert len(model.quantkit_fast_path.fused_qkv) == model.config.num_hidden_layers


def test_inexact_model_compiles_fullgraph():
    """The norm's defer check asked dynamo about inference mode before asking whether it traces,
    and torch.compile(fullgraph=True) refused the exact=False model."""
    model = optimize(_quantized("llama", "int8", torch.float32), exact=False)
    ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # With autograd on (embeddings are parameters), the layers' backward guard stays out of the trace.
    torch._dynamo.reset()
    got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids, use_cache=False).logits
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-5)
