"""GPU checks of session 41's change (the contest between the tiled and the Gluon kernel at 129-255
rows, ``gemm._contest``), through a ``QuantLinear`` on the "triton" backend, INT8 and FP8:
1. the first eager call at M = 192 runs a contest (one new ``gemm.CONTEST_TIMES`` entry, its winner
   recorded) and matches the torch backend (the reference twin) within 1e-2 relative error;
2. a second eager call (the signature cache's launch) is bit-equal to the first;
3. a CUDA graph captured after it replays bit-equal;
4. ``torch.compile(fullgraph=True)`` matches eager;
5. M = 250 (same tuning key) runs no new contest and matches the reference;
6. a first call of a new contested key (M = 208, after a warm-up at M = 112) inside a graph capture
   raises the tuners' warm-up error, and the same call eagerly afterwards runs its contest and
   matches the reference.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_checks_s41.py --out $OUT/checks41
"""

import argparse
import json
from pathlib import Path

import kernels_only  # noqa: F401  (quantkit without its __init__)
import torch

from quantkit.bench.common import environment_metadata, rel_err

RESULTS = []


def record(name, ok, **info):
    RESULTS.append({"check": name, "ok": bool(ok), **info})
    print(f"[{'ok' if ok else 'FAILED'}] {name} {info}", flush=True)


def layers(in_features, out_features, dtype):
    from quantkit.nn.linear import QuantLinear

    linear = torch.nn.Linear(in_features, out_features, bias=False).cuda().to(torch.bfloat16)
    return (QuantLinear.from_linear(linear, dtype, backend="triton"),
            QuantLinear.from_linear(linear, dtype, backend="torch"))


def check_layer(in_features, out_features, dtype):
    from quantkit.kernels import gemm

    fast, twin = layers(in_features, out_features, dtype)
    point = {"dtype": str(dtype), "in": in_features, "out": out_features}
    x = torch.randn(192, in_features, device="cuda", dtype=torch.bfloat16)
    before = dict(gemm.CONTEST_TIMES)
    first = fast(x)
    new = {str(k[:3]): v for k, v in gemm.CONTEST_TIMES.items() if k not in before}
    contest = next(iter(new.values()), None)
    err = rel_err(first.float(), twin(x).float())
    record("contest_first_call", len(new) == 1 and err <= 1e-2, **point, rel_err=err, contest_ms=contest,
           winner=min(contest, key=contest.get) if contest else None)
    again = fast(x)
    record("cached_call_bit_equal", torch.equal(again, first), **point)

    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fast(static_x)
    graph.replay()
    torch.cuda.synchronize()
    record("graph_replay_bit_equal", torch.equal(static_y, first), **point)

    try:
        compiled = torch.compile(fast, fullgraph=True)(x)
        record("compiled_matches_eager", rel_err(compiled.float(), first.float()) <= 1e-3, **point,
               bit_equal=torch.equal(compiled, first))
    except Exception as error:  # noqa: BLE001 - recorded
        record("compiled_matches_eager", False, **point, error=f"{type(error).__name__}: {str(error)[:300]}")

    count = len(gemm.CONTEST_TIMES)
    x250 = torch.randn(250, in_features, device="cuda", dtype=torch.bfloat16)
    err = rel_err(fast(x250).float(), twin(x250).float())
    record("same_bucket_no_new_contest", len(gemm.CONTEST_TIMES) == count and err <= 1e-2, **point, rel_err=err)


def check_capture_refusal(dtype):
    from quantkit.kernels import gemm

    fast, twin = layers(4096, 3072, dtype)  # a key no other check uses
    # Warm-up at M = 112 (the M bucket of 128: tiled, no contest) compiles the input's quantization
    # kernel for this K; the capture at M = 208 then meets the new key's contest first.
    fast(torch.randn(112, 4096, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(208, 4096, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    message = None
    try:
        with torch.cuda.graph(graph):
            fast(x)
    except RuntimeError as error:
        message = str(error)
    count = len(gemm.CONTEST_TIMES)
    err = rel_err(fast(x).float(), twin(x).float())
    record("capture_refused_then_eager_contest", message is not None and "warm-up call" in message
           and len(gemm.CONTEST_TIMES) == count + 1 and err <= 1e-2, dtype=str(dtype), message=message,
           rel_err=err)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for in_features, out_features in ((14336, 4096), (2048, 640)):
            check_layer(in_features, out_features, dtype)
        check_capture_refusal(dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    passed = sum(r["ok"] for r in RESULTS)
    (out / "gpu_checks_s41.json").write_text(json.dumps(
        {"meta": environment_metadata(), "passed": passed, "total": len(RESULTS), "results": RESULTS}, indent=1))
    print(f"{passed} of {len(RESULTS)} checks passed")


if __name__ == "__main__":
    main()
