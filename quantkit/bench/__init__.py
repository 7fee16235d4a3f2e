"""The benchmarks behind ``quantkit bench``, as a public API.

Each runner checks the kernels on the GPU first, then times them against their baselines and writes
CSV/JSON/PNG under ``out_dir`` (``out/bench`` by default, as the CLI's: the committed reference runs
in benchmarks/results are written by the scripts in benchmarks/). A kernel whose output is outside
its bound raises ``CheckFailed``. The benchmark modules (and matplotlib) load when a runner is called.
"""

from __future__ import annotations

import os

BENCH_OUT = "out/bench"


def run_gemm_benchmark(out_dir: str | os.PathLike = BENCH_OUT, **kwargs) -> list[dict]:
    """The quantization kernels and the INT8/FP8 GEMMs vs cuBLAS bf16, ``_scaled_mm`` and ``_int_mm``."""
    from quantkit.bench.gemm import run_all

    return run_all(out_dir=out_dir, **kwargs)


def run_attention_benchmark(out_dir: str | os.PathLike = BENCH_OUT, **kwargs):
    """Flash prefill and split-KV decode attention vs SDPA."""
    from quantkit.bench import attention

    return attention.run_attention_benchmark(out_dir=out_dir, **kwargs)


def run_e2e_benchmark(out_dir: str | os.PathLike = BENCH_OUT, **kwargs):
    """End to end on a Llama-3-8B-shaped model: HF bf16 vs quantkit fp8/int8 prefill, decode, memory."""
    from quantkit.bench import e2e

    return e2e.run_e2e_benchmark(out_dir=out_dir, **kwargs)


def __getattr__(name: str):
    # CheckFailed lives with the benchmarks' shared helpers, loaded on first use like the runners.
    if name == "CheckFailed":
        from quantkit.bench.common import CheckFailed

        return CheckFailed
    raise AttributeError(f"module 'quantkit.bench' has no attribute {name!r}")


__all__ = ["BENCH_OUT", "CheckFailed", "run_attention_benchmark", "run_e2e_benchmark", "run_gemm_benchmark"]
