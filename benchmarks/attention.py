"""Check the attention / RoPE / norm kernels on the GPU, then benchmark attention vs SDPA.

    PYTHONPATH=. python benchmarks/attention.py [--out benchmarks/results] [--no-checks] [--sweep]

Writes attention_checks.json, attention.csv/json/png under --out (same code as
``quantkit bench attention``). ``--sweep`` first times candidate prefill tile configs.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantkit.bench.attention import (  # noqa: E402
    bench_decode,
    bench_prefill,
    run_attention_benchmark,
    run_attention_checks,
)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates for head_dim 128 on Hopper.
# (BLOCK_N, num_warps, num_stages, programs_per_sm) candidates for decode, head_dim 128.
# Session 3: the plan counts waves and the combine is fused, so programs_per_sm is now a real
# choice (3 per SM fits a 2-stage 64-key tile's shared memory).
DECODE_SWEEP_CONFIGS = [(64, 4, 3, 2), (64, 4, 2, 3), (64, 4, 3, 3), (128, 4, 2, 2), (128, 8, 3, 1), (32, 4, 4, 3)]
SWEEP_CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4)]


def profile_host_overhead(calls: int = 300) -> None:
    """Microseconds of host time per call, enqueue only (no sync inside the loop)."""
    import time

    import torch
    import torch.nn.functional as F

    from quantkit.kernels import attention
    from quantkit.kernels.reference_attention import check_decode_inputs

    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    parts = {
        "check_decode_inputs": lambda: check_decode_inputs(q, cache, cache, seqlens, None, None),
        "two torch.empty": lambda: (torch.empty((1, 32, 16, 128), device="cuda"), torch.empty((1, 32, 16), device="cuda")),
        "decode_attention (all)": lambda: attention.decode_attention(q, cache, cache, seqlens, 0.1),
        "SDPA": lambda: F.scaled_dot_product_attention(q[:, :, None], cache, cache, enable_gqa=True),
    }
    for name, fn in parts.items():
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host_us = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        print(f"host {name:24s} {host_us:7.1f} us/call", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--no-checks", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-decode", action="store_true")
    parser.add_argument("--profile-host", action="store_true", help="host (Python) cost per decode call")
    parser.add_argument("--quick", action="store_true", help="prefill 4k/16k, decode 1k/32k only")
    parser.add_argument("--prefill-seqs", type=int, nargs="+", help="prefill sequence lengths (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: the attention benchmark needs a CUDA GPU; run it on the GPU machine")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.no_checks:
        checks = run_attention_checks()  # before the sweeps too
        Path(args.out, "attention_checks.json").write_text(json.dumps(checks, indent=1, default=str))
    if args.sweep:
        sweep = []
        for config in SWEEP_CONFIGS:
            for seq in (4096, 16384):
                try:
                    row = bench_prefill(seq, block_config=config)
                except Exception as exc:  # a config that does not compile (shared memory) is skipped
                    print(f"sweep {config} S={seq}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                sweep.append(row)
                print(f"sweep {config} S={seq}: {row['quantkit_tflops']:.1f} TFLOP/s ratio {row['ratio']:.3f}", flush=True)
        Path(args.out, "attention_sweep.json").write_text(json.dumps(sweep, indent=1, default=str))
    if args.sweep_decode:
        sweep = []
        for config in DECODE_SWEEP_CONFIGS:
            for batch, length in ((1, 4096), (1, 32768), (8, 4096), (8, 32768)):
                try:
                    row = bench_decode(batch, length, block_config=config, eager=False)
                except Exception as exc:  # a config over the shared-memory limit is skipped
                    print(f"decode sweep {config}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    break
                sweep.append(row)
                print(f"decode sweep {config} B={batch} L={length}: graph {row['quantkit_graph_ms'] * 1e3:.1f} us "
                      f"vs SDPA {row['sdpa_graph_ms'] * 1e3:.1f} us ({row['ratio_graph']:.3f}x)", flush=True)
        Path(args.out, "attention_decode_sweep.json").write_text(json.dumps(sweep, indent=1, default=str))
    if args.profile_host:
        profile_host_overhead()
    kwargs = dict(prefill_seqs=(4096, 16384), decode_lengths=(1024, 32768)) if args.quick else {}
    if args.prefill_seqs:
        kwargs["prefill_seqs"] = tuple(args.prefill_seqs)
    run_attention_benchmark(out_dir=args.out, checks=False, **kwargs)  # checked above


if __name__ == "__main__":
    main()
