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


def test_plain_points_also_time_the_quantization_in_front_of_the_gemm(monkeypatch):
    """o_proj and down_proj quantize their bf16 input in a kernel of their own: the plain rows
    carry that op's time too, against bf16, so the ratio a model sees there is on record."""
    fake = {**FAKE_MS, "quantkit_fp8+quantize": 0.20, "quantkit_int8+quantize": 0.15}
    timed = []

    def fake_medians(ops, timer, rounds):
        timed.extend(ops)
        for op in ops.values():  # every op runs (the quantize + GEMM ones on the interpreter)
            op()
        return {name: fake[name] for name in ops}, None

    monkeypatch.setattr(bench_gemm, "rotated_medians", fake_medians)
    rows = {row["op"]: row for row in bench_gemm.bench_scaled_mm_point(17, 48, 64, "plain", device="cpu")}
    assert set(timed) == set(fake)
    assert rows["quantkit_fp8+quantize"]["speedup_vs_bf16"] == pytest.approx(0.30 / 0.20)
    assert rows["quantkit_int8+quantize"]["speedup_vs_bf16"] == pytest.approx(0.30 / 0.15)
    assert bench_gemm.timed_ops(("plain", "bias_silu")) == 14
    bench_gemm.print_point(list(rows.values()), 17, 48, 64)  # the run's log line for each row


@pytest.mark.parametrize("epilogue", ["plain", "bias_silu"])
def test_a_wrong_kernel_stops_the_benchmark_instead_of_getting_a_time(monkeypatch, epilogue):
    from quantkit.bench.common import CheckFailed
    from quantkit.kernels import triton_ops

    monkeypatch.setattr(bench_gemm, "rotated_medians", lambda ops, timer, rounds: ({name: FAKE_MS.get(name, 0.2)
                                                                                     for name in ops}, None))
    real = triton_ops.scaled_mm

    def off_by_one_percent(*args, **kwargs):
        return real(*args, **kwargs) * 1.01

    monkeypatch.setattr(triton_ops, "scaled_mm", off_by_one_percent)
    with pytest.raises(CheckFailed, match=r"quantkit_fp8 at M=32 N=48 K=64 .*exceeds 4.0e-03"):
        bench_gemm.bench_scaled_mm_point(32, 48, 64, epilogue, device="cpu")
