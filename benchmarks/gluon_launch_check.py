"""GPU check of the Gluon GEMM's cached launch: same bits as Gluon's own launcher, host time per call.

For INT8 (plain and gated) and FP8 at M = 2048 on Llama-3-8B shapes: one call through Gluon's JIT
launcher (QUANTKIT_GLUON_CACHED_LAUNCH off: ``gemm_gluon.CACHED_LAUNCH = False``), then cached
calls; outputs compared with ``torch.equal``; host microseconds per call (a tight loop of 200
launches timed on the host, the GPU draining behind) for both paths.

    python benchmarks/gluon_launch_check.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import triton

from quantkit.kernels import gemm_gluon, reference


def host_us(fn, n=200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for dtype, gated, (N, K) in ((torch.int8, False, (6144, 4096)), (torch.int8, True, (14336, 4096)),
                                 (torch.int8, False, (4096, 14336)), (torch.float8_e4m3fn, False, (4096, 4096))):
        M = 2048
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        wf = torch.randn((2 if gated else 1) * N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
        a, a_scale = reference.quantize_per_token(x, dtype)
        w, w_scale = reference.quantize_per_channel(wf, dtype)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        call = gemm_gluon.tuned_call(a, w, out, a_scale, w_scale, None, "silu" if gated else "none", gated)
        row = {"dtype": str(dtype), "gated": gated, "M": M, "N": N, "K": K, "config": call.config.name}
        gemm_gluon.CACHED_LAUNCH = False
        gemm_gluon._COMPILED.clear()
        call(a, w, out, a_scale, w_scale, w_scale)
        torch.cuda.synchronize()
        jit_out = out.clone()
        row["jit_host_us"] = host_us(lambda: call(a, w, out, a_scale, w_scale, w_scale))
        gemm_gluon.CACHED_LAUNCH = True
        out.fill_(float("nan"))
        call(a, w, out, a_scale, w_scale, w_scale)  # first call of the key: Gluon's path, kept
        call(a, w, out, a_scale, w_scale, w_scale)  # cached
        torch.cuda.synchronize()
        row["cached_bit_equal"] = bool(torch.equal(out, jit_out))
        out.fill_(float("nan"))
        other = torch.empty_like(out)
        call(a, w, other, a_scale, w_scale, w_scale)  # another output buffer through the cached path
        torch.cuda.synchronize()
        row["cached_other_buffer_equal"] = bool(torch.equal(other, jit_out))
        row["cached_host_us"] = host_us(lambda: call(a, w, other, a_scale, w_scale, w_scale))
        print(json.dumps(row), flush=True)
        rows.append(row)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gluon_launch_check.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
