"""The GEMM benchmark's rows: ratios and TFLOP/s from the measured times, in the right direction.

The timer is replaced by fixed, made-up times per op (the real ones need a GPU); everything else
runs as on the GPU, the autotuned kernel's output check included (the interpreter on CPU)."""

import pytest

from quantkit.bench import gemm as bench_gemm

FAKE_MS = {
    "bf16_F.linear": 0.30,
    "torch._scaled_mm_rowwise_promoted+epilogue": 0.24,
    "torch._scaled_mm_rowwise_fast_accum+epilogue": 0.20,
    "torch._int_mm+epilogue": 0.50,
    "quantkit_fp8": 0.16,
    "quantkit_int8": 0.125,
}


def test_rows_divide_the_baseline_time_by_ours(monkeypatch):
    timed = []

    def fake_medians(ops, timer, rounds):
        timed.extend(ops)
        return {name: FAKE_MS[name] for name in ops}, None

    monkeypatch.setattr(bench_gemm, "rotated_medians", fake_medians)
    M, N, K = 32, 48, 64
    rows = {row["op"]: row for row in bench_gemm.bench_scaled_mm_point(M, N, K, "bias_silu", device="cpu")}
    assert set(timed) == set(FAKE_MS)
    fp8, int8 = rows["quantkit_fp8"], rows["quantkit_int8"]
    # FP8 is compared with cuBLAS's fast-accumulation mode, as quantkit's default FP8 mode is.
    assert fp8["baseline"] == "torch._scaled_mm_rowwise_fast_accum+epilogue"
    assert fp8["speedup_vs_baseline"] == pytest.approx(0.20 / 0.16)  # 1.25: ours is faster
    assert fp8["speedup_vs_bf16"] == pytest.approx(0.30 / 0.16)
    assert int8["baseline"] == "torch._int_mm+epilogue"
    assert int8["speedup_vs_baseline"] == pytest.approx(4.0) and int8["speedup_vs_bf16"] == pytest.approx(2.4)
    assert int8["tflops"] == pytest.approx(2 * M * N * K / 0.125e-3 / 1e12)
    assert rows["bf16_F.linear"]["ms"] == 0.30 and "speedup_vs_baseline" not in rows["bf16_F.linear"]
    # The output check ran on the real kernels: quantkit's output against the reference twin.
    assert fp8["rel_err"] < 1e-2 and int8["rel_err"] < 1e-2
