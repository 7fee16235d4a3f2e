"""GPU checks of session 39's code changes (the CPU suite runs the interpreter, where the launchers'
signature caches are off and nothing is tuned):
1. torch.compile(fullgraph=True) of a QuantLinear on the "triton" backend as the process's first
   call of any quantkit op (choosing the backend now imports the kernel modules), equal to eager;
2. the cached launch paths name a non-tensor argument (the checks' error, not an AttributeError),
   after the signature is in the cache;
3. the RMSNorm + quant cached path with an int, a float and a refused offset; outputs equal to the
   uncached launch;
4. the tuner's timer after its graphs moved to ``gemm_tma.flush_graphs``: a fresh tuning key
   (tiled and Gluon), outputs within the tolerance of the reference, and the timer's reading of
   one GEMM against the benchmark timer's.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_checks_s39.py --out $OUT/checks39
"""

import argparse
import json
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402

RESULTS = []


def record(name, ok, **info):
    RESULTS.append({"check": name, "ok": bool(ok), **info})
    print(f"[{'ok' if ok else 'FAILED'}] {name} {info}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)

    # 1. compile first: nothing from quantkit.kernels' Triton side imported yet.
    import sys

    from quantkit.nn.linear import QuantLinear

    before = "quantkit.kernels.triton_ops" in sys.modules
    linear = torch.nn.Linear(4096, 1024, bias=True).cuda().to(torch.bfloat16)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        layer = QuantLinear.from_linear(linear, dtype, backend="triton")
        x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16)
        try:
            compiled = torch.compile(layer, fullgraph=True)(x)
            eager = layer(x)
            record("compile_first_call", torch.allclose(compiled.float(), eager.float(), rtol=1e-2, atol=1e-2),
                   dtype=str(dtype), imported_before=before, bit_equal=torch.equal(compiled, eager),
                   max_diff=(compiled.float() - eager.float()).abs().max().item())
        except Exception as e:  # noqa: BLE001 - recorded
            record("compile_first_call", False, dtype=str(dtype), error=f"{type(e).__name__}: {str(e)[:300]}")

    from quantkit.kernels import gemm, gemm_tma, quant, reference
    from quantkit.bench.gemm import adaptive_graph_ms

    # 2. non-tensor arguments on the cached paths.
    a, sa = reference.quantize_per_token(torch.randn(16, 512, device="cuda"), torch.int8)
    w, sw = reference.quantize_per_channel(torch.randn(256, 512, device="cuda"), torch.int8)
    bias = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    gemm.scaled_mm(a, w, sa, sw, bias)  # the signature is cached now
    gemm.gated_scaled_mm(a, w, sa, sw)
    xq = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    nw = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    quant.quantize_per_token(xq, torch.int8)
    quant.rms_norm_quant_per_token(xq, nw, 1e-6, torch.int8)
    cases = [
        ("a_scale_float", lambda: gemm.scaled_mm(a, w, 0.5, sw, bias), "a_scale is a float"),
        ("bias_list", lambda: gemm.scaled_mm(a, w, sa, sw, bias.tolist()), "bias is a list"),
        ("gated_w_scale_float", lambda: gemm.gated_scaled_mm(a, w, sa, 2.0), "w_scale is a float"),
        ("x_list", lambda: quant.quantize_per_token(xq.tolist(), torch.int8), "must be a"),
        ("weight_list", lambda: quant.rms_norm_quant_per_token(xq, nw.tolist(), 1e-6, torch.int8), "weight is a list"),
        ("residual_float", lambda: quant.rms_norm_quant_per_token(xq, nw, 1e-6, torch.int8, 1.0),
         "residual is a float"),
        ("offset_str", lambda: quant.rms_norm_quant_per_token(xq, nw, 1e-6, torch.int8, None, "1"), "offset='1'"),
        ("offset_nan", lambda: quant.rms_norm_quant_per_token(xq, nw, 1e-6, torch.int8, None, float("nan")),
         "offset=nan"),
    ]
    for name, call, message in cases:
        try:
            call()
            record(f"bad_input_{name}", False, error="no exception")
        except (ValueError, TypeError) as e:
            record(f"bad_input_{name}", message in str(e), message=str(e)[:200])
        except Exception as e:  # noqa: BLE001 - recorded
            record(f"bad_input_{name}", False, error=f"{type(e).__name__}: {str(e)[:200]}")

    # 3. offsets on the cached RMSNorm path: int 1 and float 1.0 give the same bits as the uncached launch.
    for dtype in (torch.int8, torch.float8_e4m3fn):
        res = torch.randn_like(xq)
        fresh = quant.rms_norm_quant_per_token(xq, nw, 1e-6, dtype, res, 1.0, out=torch.empty_like(xq, dtype=dtype))
        for offset in (1, 1.0, 1, 1.0):
            got = quant.rms_norm_quant_per_token(xq, nw, 1e-6, dtype, res, offset)
            same = all(torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                                   f.view(torch.uint8) if f.dtype == torch.float8_e4m3fn else f)
                       for g, f in zip(got, fresh))
            record("rms_norm_offset_cached", same, dtype=str(dtype), offset=repr(offset))

    # 4. fresh tuning keys (tiled at M = 48, Gluon at M = 1024 where available) and the tuner's timer.
    for M in (48, 1024):
        for dtype in (torch.int8, torch.float8_e4m3fn):
            a2, sa2 = reference.quantize_per_token(torch.randn(M, 4096, device="cuda"), dtype)
            w2, sw2 = reference.quantize_per_channel(torch.randn(3072, 4096, device="cuda") * 0.02, dtype)
            out = gemm.scaled_mm(a2, w2, sa2, sw2, None, "silu", torch.float32)
            ref = reference.scaled_mm(a2, w2, sa2, sw2, None, "silu", torch.float32)
            err = ((out - ref).norm() / ref.norm()).item()
            def call(a2=a2, w2=w2, sa2=sa2, sw2=sw2):
                return gemm.scaled_mm(a2, w2, sa2, sw2, None, "silu", torch.bfloat16)
            tuner_ms = gemm_tma._graph_bench_ms(call)
            bench_ms = adaptive_graph_ms(call)
            record("fresh_tuning", err < 5e-3 and 0.8 < tuner_ms / bench_ms < 1.25, M=M, dtype=str(dtype),
                   rel_err=err, tuner_us=tuner_ms * 1e3, bench_us=bench_ms * 1e3)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_checks_s39.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    failed = [r for r in RESULTS if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
