"""Programmatic dependent launch (launch.PDL; on by default on sm_90+, QUANTKIT_PDL=0 turns it off):
the launch option and the kernels' wait always travel together, and the kernels touch no memory
before their grid-dependency wait.

A kernel launched with PDL may be scheduled while the kernel before it still runs, so what
decides correctness is the order in the compiled code: the wait (``griddepcontrol.wait``) must
come before every load and store, and the release of the next kernel
(``griddepcontrol.launch_dependents``) after it. Checked in the PTX of each PDL kernel compiled
for sm_90 here (no GPU needed); the GPU run of benchmarks/decode_pdl.py checks the results bit
for bit (benchmarks/NOTES-gemm.md, sessions 44-45).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.kernels import launch

ROOT = Path(__file__).resolve().parents[2]


def test_pdl_is_off_under_the_interpreter_and_then_leaves_options_alone():
    assert launch.pdl_enabled() is False
    assert launch.pdl_name() == "off"
    assert launch.pdl_options(False) is None
    assert launch.pdl_options(False, {"maxnreg": 80}) == {"maxnreg": 80}


def _unresolved(monkeypatch, value: str, capability=(9, 0), cuda: bool = True) -> None:
    monkeypatch.setattr(launch, "_PDL_VALUE", value)
    monkeypatch.setattr(launch, "PDL", None)
    monkeypatch.setattr(launch, "_PDL_BY_DEVICE", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(launch, "current_gpu", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)


@pytest.mark.parametrize("value", ["true", "on", "2", "early"])
def test_a_quantkit_pdl_value_other_than_0_or_1_is_refused_on_first_use(monkeypatch, value):
    _unresolved(monkeypatch, value)
    with pytest.raises(ValueError, match=f"QUANTKIT_PDL='{value}': set it to 1 .*, 0 \\(off\\), or leave it unset"):
        launch.pdl_enabled()


@pytest.mark.parametrize("value,capability,cuda,enabled", [
    ("", (9, 0), True, True), ("", (10, 0), True, True), ("", (8, 9), True, False), ("", (9, 0), False, False),
    ("0", (9, 0), True, False), ("1", (9, 0), True, True),
])
def test_the_first_launch_resolves_quantkit_pdl_once_per_gpu(monkeypatch, value, capability, cuda, enabled):
    _unresolved(monkeypatch, value, capability, cuda)
    assert launch.pdl_enabled() is enabled
    assert launch.pdl_name() == ("on" if enabled else "off")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    assert launch.pdl_enabled() is enabled  # resolved: not asked again


def test_each_gpu_of_a_mixed_host_gets_its_own_setting(monkeypatch):
    # An sm_90 GPU and an sm_80 one: the wait does not compile for sm_80, so PDL must stay off there
    # even after the sm_90 GPU resolved it on.
    _unresolved(monkeypatch, "")
    capabilities = {0: (9, 0), 1: (8, 0)}
    current = [0]
    monkeypatch.setattr(launch, "current_gpu", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capabilities[device])
    assert launch.pdl_enabled() is True
    current[0] = 1
    assert launch.pdl_enabled() is False
    assert launch.pdl_name() == "off"
    current[0] = 0
    assert launch.pdl_enabled() is True
    assert launch._PDL_BY_DEVICE == {0: True, 1: False}
    monkeypatch.setattr(launch, "PDL", False)  # a process-wide setting (benchmarks) wins on every GPU
    assert launch.pdl_enabled() is False


def test_quantkit_pdl_1_is_refused_on_the_gpu_that_lacks_it(monkeypatch):
    _unresolved(monkeypatch, "1")
    current = [0]
    monkeypatch.setattr(launch, "current_gpu", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: [(9, 0), (8, 9)][device])
    assert launch.pdl_enabled() is True
    current[0] = 1
    with pytest.raises(ValueError, match="needs an sm_90 or newer GPU .*GPU 1 is sm_89: unset QUANTKIT_PDL"):
        launch.pdl_enabled()


def test_asking_for_pdl_without_a_gpu_is_refused_in_one_line(monkeypatch):
    _unresolved(monkeypatch, "1", cuda=False)
    with pytest.raises(ValueError, match="QUANTKIT_PDL=1 needs a CUDA GPU .* unset QUANTKIT_PDL"):
        launch.pdl_enabled()


@pytest.mark.parametrize("capability", [(8, 0), (8, 9)])
def test_asking_for_pdl_on_a_gpu_before_hopper_is_refused_in_one_line(monkeypatch, capability):
    _unresolved(monkeypatch, "1", capability)
    with pytest.raises(ValueError, match=f"needs an sm_90 or newer GPU .*sm_{capability[0]}{capability[1]}: unset "
                                           "QUANTKIT_PDL"):
        launch.pdl_enabled()


def test_pdl_on_adds_the_launch_option():
    assert launch.pdl_options(True) == {"launch_pdl": True}
    assert launch.pdl_options(True, {"maxnreg": 80}) == {"maxnreg": 80, "launch_pdl": True}


# Every PTX instruction that reads or writes global memory: loads, stores, atomics, reductions and
# the asynchronous (cp.async, TMA) copies.
_GLOBAL_MEMORY = re.compile(r"(^|[\s}])(ld\.global|st\.global|atom\.|red\.|cp\.async|cp\.reduce)")


def _ptx_order(kernel, constants: dict, types: dict, num_warps: int, num_stages: int = 1) -> dict:
    """Compile ``kernel`` for sm_90 with PDL on; the load/store lines before and after the wait,
    and whether the next kernel's release comes after the wait."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
        if signature[name].startswith("*") or name.startswith("stride") or name == "K":
            attrs[(i,)] = [["tt.divisibility", 16]]  # as the launchers specialize aligned pointers and strides
    constants = {name: constants[name] for name in kernel.arg_names if name in constants}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=True))
    lines = [line.strip() for line in compiled.asm["ptx"].splitlines()]
    waits = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    triggers = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents")]
    memory = [(i, line) for i, line in enumerate(lines) if _GLOBAL_MEMORY.search(line)]
    first_wait = waits[0] if waits else len(lines)
    return {"launch_pdl": bool(compiled.metadata.launch_pdl), "waits": len(waits), "triggers": len(triggers),
            "trigger_after_wait": bool(triggers) and triggers[0] > first_wait,
            "before": [line for i, line in memory if i < first_wait],
            "after": [line for i, line in memory if i > first_wait]}


_SCRIPT = """
import json, torch
from quantkit.kernels import gemv, kv_cache, quant, rope
from tests.kernels.test_pdl import _ptx_order
rows = []
for is_int8, operand, gated, even_k in ((True, "i8", False, True), (False, "fp8e4nv", True, True),
                                        (True, "i8", True, False), (False, "fp8e4nv", False, False)):
    constants = dict(IS_INT8=is_int8, A_PER_TOKEN=True, W_PER_CHANNEL=True, HAS_BIAS=False,
                     ACTIVATION=2 if gated else 0, RAW_ACC=False, GATED=gated, INTERPRETED=False,
                     EVEN_K=even_k, PDL=True, BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048)
    types = {"a_ptr": "*" + operand, "w_ptr": "*" + operand, "out_ptr": "*bf16"}
    rows.append(["gemv", operand, gated, even_k, _ptx_order(gemv._scaled_gemv_kernel, constants, types, 4)])
for K in (4096, 14336):  # the quantization launchers compile with num_stages=3
    rows_, constants, num_warps, _, _ = quant._per_token_plan(K, torch.bfloat16, torch.int8, None)
    types = {"x_ptr": "*bf16", "q_ptr": "*i8"}
    rows.append(["per_token", K, None, None,
                 _ptx_order(quant._quantize_per_token_kernel, {**constants, "PDL": True}, types, num_warps, 3)])
    for residual in (False, True):
        launcher, _, constants, num_warps, _, _ = quant._rms_norm_plan(K, residual, torch.float8_e4m3fn, None)
        types = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "new_residual_ptr": "*bf16", "weight_ptr": "*bf16",
                 "q_ptr": "*fp8e4nv", "eps": "fp32", "offset": "fp32"}
        rows.append(["rms_norm_quant", K, residual, None,
                     _ptx_order(launcher.kernel, {**constants, "PDL": True}, types, num_warps, 3)])
types = {name: "*bf16" for name in ("Q", "K", "COS", "SIN", "Q_OUT", "K_OUT")}
rows.append(["rope", 128, None, None, _ptx_order(rope._rope_kernel, dict(HALF=64, BLOCK_S=1, PDL=True), types, 4, 3)])
types = {"K": "*bf16", "V": "*bf16", "K_CACHE": "*bf16", "V_CACHE": "*bf16", "POSITIONS": "*i64"}
rows.append(["kv_cache", 128, None, None,
             _ptx_order(kv_cache._kv_cache_write_kernel, dict(BLOCK_S=1, BLOCK_D=128, PDL=True), types, 4)])
from quantkit.kernels import attention_decode as ad
# Decode attention with pointer loads (the TMA form's descriptors are host objects) and the fused
# combine (its atomics), split and flat schedules.
types = {name: "*bf16" for name in ("Q", "K", "V", "K_desc", "V_desc", "O")}
types.update(cache_seqlens="*i32", O_part="*fp32", LSE_part="*fp32", counters="*i32", qk_scale="fp32")
common = dict(HEAD_DIM=128, BLOCK_G=16, BLOCK_N=64, HAS_WINDOW=False, UPCAST=False, GROUP_P2=4, SPLIT_CHUNK=8,
              TMA=False, EVICTION="", PDL=True)
split = dict(common, EPILOGUE=ad.EPILOGUE_FUSED, BLOCK_SPLITS=8, K_ROWS=False, PREFETCH_FIRST=False,
             SPLIT_BY_FILL=True)
rows.append(["decode_split", 128, None, None, _ptx_order(ad._decode_split_kernel, split, types, 4, 3)])
flat = dict(common, BLOCK_B=1, MIN_BLOCKS=2)
rows.append(["decode_flat", 128, None, None, _ptx_order(ad._decode_flat_kernel, flat, types, 4, 3)])
print(json.dumps(rows))
"""


def test_pdl_kernels_touch_no_memory_before_their_wait_and_release_the_next_after_it():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 4 + 2 * 3 + 2 + 2
    for kind, what, flag, even_k, order in rows:
        case = (kind, what, flag, even_k)
        assert order["launch_pdl"] and order["waits"] == 1 and order["triggers"] == 1, case
        assert order["trigger_after_wait"], case
        assert order["before"] == [], case
        assert any("ld.global" in line for line in order["after"]), case
        assert any("st.global" in line for line in order["after"]), case
        if kind.startswith("decode"):
            assert any("atom." in line for line in order["after"]), case


class _Recorder:
    """Stands in for a ``launch.CachedLaunch``: records what a launcher hands it, runs nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, key, grid, args, constexprs, num_warps, num_stages, triton_args=None, options=None):
        self.calls.append((key, dict(constexprs), options))


class _GridRecorder:
    """Stands in for a @triton.jit kernel launched as ``kernel[grid](...)``: records its keywords."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.calls.append((None, {k: v for k, v in kwargs.items() if k == "PDL"},
                               {k: v for k, v in kwargs.items() if k == "launch_pdl"}))
        return launch_


def test_the_pdl_setting_reaches_each_kernel_its_launch_option_and_its_cache_key(monkeypatch):
    """The PDL constexpr (the wait in the kernel) and triton's launch_pdl (the early start) must
    travel together: a kernel launched early without its wait would race."""
    from quantkit.kernels import attention_decode, gemv, kv_cache, quant, rope
    from quantkit.kernels.call_cache import SignatureCache
    from quantkit.kernels.reference import quantize_per_channel, quantize_per_token

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    norm_weight = torch.randn(64, generator=gen).to(torch.bfloat16)
    a, a_scale = quantize_per_token(x[:1].float(), torch.int8)
    w, w_scale = quantize_per_channel(torch.randn(40, 64, generator=gen), torch.int8)
    q = torch.randn(1, 4, 1, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 2, 1, 64, generator=gen).to(torch.bfloat16)
    cos, sin = torch.randn(1, 1, 64, generator=gen), torch.randn(1, 1, 64, generator=gen)
    k_cache, v_cache = torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16)
    seqlens = torch.tensor([5], dtype=torch.int32)
    keys = {}
    for pdl in (False, True):
        monkeypatch.setattr(launch, "PDL", pdl)
        recorders = {name: _Recorder() for name in ("_PER_TOKEN", "_RMS_NORM_QUANT", "_RMS_NORM_QUANT_CHUNKED")}
        for name, recorder in recorders.items():
            monkeypatch.setattr(quant, name, recorder)
        for name in ("_PER_TOKEN_PLANS", "_RMS_PLANS"):  # fresh plans, restored after the test
            monkeypatch.setattr(quant, name, {})
        for name in ("_PER_TOKEN_CALLS", "_RMS_CALLS"):
            monkeypatch.setattr(quant, name, SignatureCache())
        for module, name in ((gemv, "_GEMV"), (rope, "_ROPE"), (kv_cache, "_WRITE")):
            recorders[name] = _Recorder()
            monkeypatch.setattr(module, name, recorders[name])
        attention = _GridRecorder()
        for name in ("_decode_split_kernel", "_decode_flat_kernel"):
            monkeypatch.setattr(attention_decode, name, attention)

        gemv._launch(a, w, torch.empty(1, 40, dtype=torch.bfloat16), a_scale, w_scale, None, "none", False, None)
        quant.quantize_per_token(x, torch.int8)
        quant.rms_norm_quant_per_token(x, norm_weight, 1e-6, torch.int8)
        quant.rms_norm_quant_per_token(x, norm_weight, 1e-6, torch.int8, config={"chunk_k": 32})
        rope.apply_rope(q, k, cos, sin)
        kv_cache.write_kv_cache(k, k, k_cache, v_cache, torch.tensor([4]))
        attention_decode.decode_attention(q[:, :, 0], k_cache, v_cache, seqlens, 0.125)
        for name, recorder in {**recorders, "attention": attention}.items():
            assert len(recorder.calls) == 1, name
            key, constexprs, options = recorder.calls[0]
            assert constexprs["PDL"] is pdl, name
            assert bool((options or {}).get("launch_pdl")) is pdl, name
        keys[pdl] = [recorder.calls[0][0] for recorder in recorders.values()]
    for off, on in zip(keys[False], keys[True]):
        assert off != on
