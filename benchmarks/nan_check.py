"""Session 27 GPU check: NaN propagation of the quantization kernels and the ReLU epilogue, and
the quantization kernels' bandwidth before and after (min/max that keep NaN). Session 47: static
per-tensor quantization, every code compared (INT8: a NaN quotient is code 0).

    python benchmarks/nan_check.py --out DIR [--old-tree PATH]

Part 1 (this process, the working tree): on the GPU, rows holding a NaN or an inf must get the
twin's NaN / inf scale, finite rows the twin's bits; a NaN per-token scale or bias must come out
of a ReLU epilogue as NaN on every GEMM path (GEMV, tiled, persistent, Gluon). Part 2: the
quantization benchmark (quantkit.bench.quant, graph timer) in alternating subprocesses, the
working tree and ``--old-tree`` (a copy of the package before the change), twice each; the
ratio new / old of GB/s per op and shape.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def _nan_equal(a, b) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0, 1, -1), b.nan_to_num(0, 1, -1)))


def correctness() -> list[dict]:
    from quantkit.kernels import gemm, reference, triton_ops

    results = []

    def record(name, ok, **info):
        results.append({"check": name, "ok": bool(ok), **info})
        print(f"{'ok  ' if ok else 'FAIL'} {name} {info}", flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for K in (4096, 14336):
        for xdtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(64, K, device="cuda", generator=gen) * 3).to(xdtype)
            x[5, 17] = float("nan")
            x[9, K - 1] = float("inf")
            x[20, 0] = float("-inf")
            for qdtype in (torch.int8, torch.float8_e4m3fn):
                q, s = triton_ops.quantize_per_token(x, qdtype)
                rq, rs = reference.quantize_per_token(x, qdtype)
                finite = torch.ones(64, dtype=torch.bool, device="cuda")
                finite[[5, 9, 20]] = False
                # Rows with a NaN or inf scale: their codes are unspecified (the row's GEMM output is NaN
                # whatever they are; the GPU's canonical NaN makes the bitcast rounding's code -1).
                ok = (_nan_equal(s, rs) and s[5].isnan().item() and s[9].isinf().item()
                      and torch.equal(q[finite].view(torch.int8), rq[finite].view(torch.int8)))
                record("quantize_per_token", ok, K=K, x=str(xdtype), q=str(qdtype))
                # Static: a NaN quotient is int8 code 0 (the GPU's max.f32 used to make it -128).
                for scale in (0.05, float("inf"), float("nan")):
                    st = torch.tensor([scale], device="cuda")
                    q = triton_ops.quantize_per_tensor(x, st, qdtype)
                    rq = reference.quantize_per_tensor(x, st, qdtype)
                    ok = torch.equal(q.view(torch.int8), rq.view(torch.int8))
                    if qdtype == torch.int8:
                        ok = ok and not q[(x.float() / st).isnan()].any()
                    record("quantize_per_tensor", ok, K=K, x=str(xdtype), q=str(qdtype), scale=scale)
                w = torch.randn(K, device="cuda", generator=gen).to(xdtype)
                res = torch.randn_like(x)
                for residual in (None, res):
                    for offset in (0.0, 1.0):
                        q, s, _ = triton_ops.rms_norm_quant_per_token(x, w, 1e-6, qdtype, residual, offset)
                        rq, rs, _ = reference.rms_norm_quant_per_token(x, w, 1e-6, qdtype, residual, offset)
                        keep = finite.clone()
                        ok = bool(s[[5, 9, 20]].isnan().all() and rs[[5, 9, 20]].isnan().all()
                                  and torch.allclose(s[keep], rs[keep], rtol=1e-6, atol=0))
                        record("rms_norm_quant", ok, K=K, x=str(xdtype), q=str(qdtype),
                               residual=residual is not None, offset=offset)

    for qdtype in (torch.int8, torch.float8_e4m3fn):
        for M, kernel in ((1, "auto"), (13, "tiled"), (1024, "persistent"), (1024, "auto"), (4096, "auto")):
            N, K = 4096, 4096
            xa = torch.randn(M, K, device="cuda", generator=gen)
            wf = torch.randn(N, K, device="cuda", generator=gen)
            a, sa = reference.quantize_per_token(xa, qdtype)
            w, sw = reference.quantize_per_channel(wf, qdtype)
            bias = torch.randn(N, device="cuda", generator=gen)
            if M > 1:  # at M = 1 a NaN token scale would leave no finite output to compare
                sa[M - 1] = float("nan")
            bias[3] = float("nan")
            out = gemm.scaled_mm(a, w, sa, sw, bias, "relu", torch.bfloat16, kernel=kernel)
            ref = reference.scaled_mm(a, w, sa, sw, bias, "relu", torch.float32)
            nan_ok = bool((M == 1 or out[M - 1].isnan().all()) and out[:, 3].isnan().all()
                          and torch.equal(out.isnan(), ref.isnan()))
            fin = ~ref.isnan()
            err = ((out.float()[fin] - ref[fin]).norm() / ref[fin].norm()).item()
            record("relu_nan", nan_ok and err < 1e-2, q=str(qdtype), M=M, kernel=kernel, rel_err=err)
            # No NaN: the ReLU epilogue still matches (the select that replaced max).
            sa[M - 1] = 1e-2
            bias[3] = 0.5
            out = gemm.scaled_mm(a, w, sa, sw, bias, "relu", torch.bfloat16, kernel=kernel)
            ref = reference.scaled_mm(a, w, sa, sw, bias, "relu", torch.float32)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            record("relu_finite", err < 1e-2 and bool((out >= 0).all()), q=str(qdtype), M=M, kernel=kernel, rel_err=err)
    return results


CHILD = """
import json, sys, torch
from quantkit.bench.quant import run_quant_benchmark
import quantkit, os
rows = run_quant_benchmark(out_dir=sys.argv[1])
json.dump({"package": os.path.dirname(quantkit.__file__), "rows": rows}, open(sys.argv[2], "w"))
"""


def bandwidth(out: Path, old_tree: Path, repeats: int) -> dict:
    runs = {"new": [], "old": []}
    for i in range(repeats):
        for label, root in (("new", Path.cwd()), ("old", old_tree)):
            target = out / f"quant_{label}_{i}.json"
            env = dict(os.environ, PYTHONPATH=str(root))
            # cwd too: ``python -c`` puts the working directory ahead of PYTHONPATH.
            proc = subprocess.run([sys.executable, "-c", CHILD, str(out / f"quant_{label}_{i}"), str(target)],
                                  env=env, cwd=root, capture_output=True, text=True, timeout=240)
            if proc.returncode:
                print(proc.stdout[-2000:], proc.stderr[-4000:], flush=True)
                raise SystemExit(f"{label} benchmark failed")
            data = json.loads(target.read_text())
            print(f"{label} run {i}: package {data['package']}", flush=True)
            runs[label].append({(r["op"], r["M"], r["K"]): r["gbs"] for r in data["rows"]})
    summary = []
    for key in runs["new"][0]:
        new = sorted(r[key] for r in runs["new"])
        old = sorted(r[key] for r in runs["old"])
        med = lambda v: v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
        summary.append({"op": key[0], "M": key[1], "K": key[2], "new_gbs": new, "old_gbs": old,
                        "ratio_new_over_old": med(new) / med(old)})
        print(f"{key[0]:26s} M={key[1]:5d} K={key[2]:5d} new {med(new):6.0f} old {med(old):6.0f} GB/s "
              f"ratio {med(new) / med(old):.3f}", flush=True)
    return {"summary": summary}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--old-tree", default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from quantkit.bench.gemm import environment_metadata

    report = {"meta": environment_metadata(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        report["checks"] = correctness()
    except Exception as error:  # keep going to the timing; the failure is recorded
        import traceback

        traceback.print_exc()
        report["checks"] = [{"check": "correctness", "ok": False, "error": repr(error)}]
    report["all_ok"] = all(c["ok"] for c in report["checks"])
    (out / "nan_check.json").write_text(json.dumps(report, indent=1, default=str))
    if args.old_tree:
        report["bandwidth"] = bandwidth(out, Path(args.old_tree), args.repeats)
    (out / "nan_check.json").write_text(json.dumps(report, indent=1, default=str))
    print("all checks ok" if report["all_ok"] else "SOME CHECKS FAILED", flush=True)


if __name__ == "__main__":
    main()
