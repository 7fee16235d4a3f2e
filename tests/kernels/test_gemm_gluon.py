"""The Gluon GEMM's host side on a CPU: the module imports anywhere, says it cannot run, validates
its configs. The kernel itself needs a Hopper GPU (benchmarks/gemm_gluon.py checks it there); with
triton 3.6 installed, ``test_compiles_for_sm90`` compiles it offline and reads the PTX."""

import re
import shutil
import subprocess

import pytest
import torch
import triton

from quantkit.kernels import gemm_gluon


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_not_available_without_a_gpu():
    assert gemm_gluon.available() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_launcher_refuses_without_a_gpu():
    a = torch.zeros(4, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="sm_90"):
        gemm_gluon.gluon_scaled_mm(a, a, torch.ones(4), torch.ones(4))


@pytest.mark.parametrize("name", list(gemm_gluon.CONFIGS))
def test_configs_fit_in_shared_memory(name):
    config = gemm_gluon.CONFIGS[name]
    assert config.shared_bytes() <= gemm_gluon.SHARED_LIMIT
    assert name.split("_")[0] in config.name


@pytest.mark.parametrize("kwargs, message", [
    (dict(stages=8), "shared memory"),
    (dict(consumers=3), "consumers"),
    (dict(consumer_warps=8, block_m=64), "block_m"),
    (dict(epilogue_split=3), "epilogue_split"),
    (dict(block_k=48), "block_k"),
], ids=["too-many-stages", "three-consumers", "rows-per-warp", "split", "block-k"])
def test_config_errors_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        gemm_gluon.GluonConfig(**kwargs)


@pytest.mark.parametrize("M", [1024, 4096, 16384])
@pytest.mark.parametrize("N, K", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_pick_config_returns_a_listed_config(M, N, K):
    assert gemm_gluon.pick_config(N, K, M, torch.float8_e4m3fn) in gemm_gluon.CONFIGS.values()


def _compile(config, dtype: str):
    """Compile for sm_90 without a GPU (Gluon's own source object, as its JIT builds it)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    operand = gl.int8 if dtype == "i8" else gl.float8e4nv
    chunk_n = config.block_n // config.epilogue_split

    def desc(dt, block, gl_dtype):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
        return f"tensordesc<{dt}[{block[0]}, {block[1]}],{layout!r}>"

    signature = {
        "a_desc": desc(dtype, [config.block_m, config.block_k], operand),
        "w_desc": desc(dtype, [config.block_n, config.block_k], operand),
        "out_desc": desc("bf16", [config.block_m, chunk_n], gl.bfloat16),
        "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
    }
    constants = dict(HAS_BIAS=True, ACTIVATION=2, GROUP_M=config.group_m, STAGES=config.stages,
                     CONSUMERS=config.consumers, EPILOGUE_SPLIT=config.epilogue_split,
                     EPILOGUE_BUFFERS=config.epilogue_buffers,
                     LOADER_REGS=config.loader_regs, CONSUMER_REGS=config.consumer_regs,
                     num_warps=config.consumer_warps)
    signature.update({name: "constexpr" for name in constants})
    source = GluonASTSource(gemm_gluon._scaled_mm_kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=config.consumer_warps))


@pytest.mark.skipif(not triton.__version__.startswith(gemm_gluon.SUPPORTED_TRITON),
                    reason="the kernels are written against triton 3.6's Gluon")
@pytest.mark.parametrize("dtype", ["fp8e4nv", "i8"])
@pytest.mark.parametrize("name", list(gemm_gluon.CONFIGS))
def test_compiles_for_sm90(name, dtype, tmp_path):
    """Asynchronous wgmma for INT8 as for FP8 (one MMA in flight: wait_group 1 in the K loop),
    a producer partition (setmaxnreg), shared memory within an H100's, no register spills."""
    config = gemm_gluon.CONFIGS[name]
    kernel = _compile(config, dtype)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    assert kernel.metadata.shared <= gemm_gluon.SHARED_LIMIT
    ptxas = shutil.which("ptxas", path=str(triton.__path__[0] + "/backends/nvidia/bin"))
    if ptxas:
        (tmp_path / "k.ptx").write_text(ptx)
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", "-o", str(tmp_path / "k.cubin"),
                              str(tmp_path / "k.ptx")], capture_output=True, text=True, check=True).stderr
        assert re.search(r"\b0 bytes spill stores", log), log


@pytest.mark.skipif(gemm_gluon._GLUON_ERROR is not None, reason="Gluon does not import here")
def test_weight_descriptor_cached_per_weight_and_released_with_it():
    import gc

    w = torch.zeros(256, 128, dtype=torch.int8)
    first = gemm_gluon._weight_descriptor(w, [128, 128])
    assert gemm_gluon._weight_descriptor(w, [128, 128]) is first
    assert gemm_gluon._weight_descriptor(w, [256, 128]) is not first
    assert first.base.data_ptr() == w.data_ptr() and first.base is not w
    before = len(gemm_gluon._WEIGHT_DESCRIPTORS)
    del w, first
    gc.collect()
    assert len(gemm_gluon._WEIGHT_DESCRIPTORS) == before - 1
