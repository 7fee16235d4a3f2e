"""Programmatic dependent launch (PDL) for the Gluon GEMM: what it saves, and that it is safe (session 16).

    PYTHONUNBUFFERED=1 python benchmarks/gemm_pdl.py --out $OUT/pdl

With ``GluonCall(pdl=True)`` the kernel is launched with the programmatic-stream-serialization
attribute and waits (``griddepcontrol.wait``) after its set-up, before any global memory access:
its CTAs' launch, shared-memory carve-out and barrier set-up run under the previous kernel's end.

Per point (plain epilogue, FP8 and INT8): the tuned config (``gemm_gluon.tuned_call``, as the
standard benchmark runs it) launched with PDL and without, and cuBLAS (``_scaled_mm`` rowwise, fast
accumulation, for FP8; ``_int_mm`` for INT8), timed with the standard benchmark's timer
(``adaptive_graph_ms``: CUDA-graph replays of L2 flush + op minus the flushes alone), in rounds
with the order rotated. Checks, before any timing:
- the two launches give the same bits;
- a dependent chain: an elementwise kernel writes the GEMM's input ``a`` (and its scales) and the
  PDL-launched GEMM follows at once, eagerly and in a CUDA graph, 20 times with fresh data: the
  output must match the output for the new data (a GEMM that read ``a`` before the wait would
  see the old values);
- the kernel names cuBLAS ran at each point (torch.profiler), for the notes.
Writes gemm_pdl.json and gemm_pdl.txt under --out.
"""

import argparse
import datetime
import json
from pathlib import Path

import kernels_only  # noqa: E402, F401  (quantkit without its __init__)

import torch  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.gemm import _bf16_operands, _quantized, adaptive_graph_ms  # noqa: E402
from quantkit.kernels import gemm_gluon  # noqa: E402
from quantkit.kernels.launch import rotated_medians  # noqa: E402

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = [512, 1024, 4096, 16384]
DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


def operands(M, N, K, dtype, seed=0):
    x, w_bf16, _ = _bf16_operands(M, N, K, "cuda", seed)
    a, a_scale, w, w_scale = _quantized(x, w_bf16, dtype)
    return a.contiguous(), a_scale.reshape(-1).float().contiguous(), w.contiguous(), w_scale.reshape(-1).float().contiguous()


def calls(a, w, a_scale, w_scale, N):
    """The tuned config's launch with and without PDL into one output buffer."""
    out = torch.empty(a.shape[0], N, device="cuda", dtype=torch.bfloat16)
    tuned = gemm_gluon.tuned_call(a, w, out, a_scale, w_scale, None, "none")
    launches = {pdl: gemm_gluon.GluonCall(tuned.config, a.shape[0], N, a.device, False, "none", pdl=pdl)
                for pdl in (False, True)}
    return tuned.config.name, out, launches


def check_chain(M, N, K, dtype, launch, reps=20):
    """The PDL launch right after a kernel that rewrites its inputs, eager and graphed: the output
    must be the one for the new inputs, bit for bit (same kernel, same data)."""
    a, a_scale, w, w_scale = operands(M, N, K, dtype)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    fresh = [operands(M, N, K, dtype, seed) for seed in (1, 2)]
    expected = []
    for fa, fs, _, _ in fresh:
        a.copy_(fa)
        a_scale.copy_(fs)
        torch.cuda.synchronize()
        launch(a, w, out, a_scale, w_scale, w_scale)
        torch.cuda.synchronize()
        expected.append(out.clone())
    if torch.equal(expected[0], expected[1]):
        raise RuntimeError("the two fresh inputs give the same output: the chain check could not fail")
    failures = 0
    for r in range(reps):
        fa, fs, _, _ = fresh[r % 2]
        out.fill_(float("nan"))
        a.copy_(fa)  # the previous kernels in the stream write a and its scales
        a_scale.copy_(fs)
        launch(a, w, out, a_scale, w_scale, w_scale)
        torch.cuda.synchronize()
        failures += not torch.equal(out, expected[r % 2])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    source = torch.empty_like(a)
    source_scale = torch.empty_like(a_scale)
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            a.copy_(source)
            a_scale.copy_(source_scale)
            launch(a, w, out, a_scale, w_scale, w_scale)
    torch.cuda.current_stream().wait_stream(side)
    for r in range(reps):
        fa, fs, _, _ = fresh[r % 2]
        source.copy_(fa)
        source_scale.copy_(fs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        failures += not torch.equal(out, expected[r % 2])
    return failures


def cublas_kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--dtypes", default="fp8,int8")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, lines = [], []
    chain_failures = {}
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for N, K in SHAPES:
            for M in map(int, args.ms.split(",")):
                a, a_scale, w, w_scale = operands(M, N, K, dtype)
                name, out, launches = calls(a, w, a_scale, w_scale, N)
                results = {}
                for pdl, launch in launches.items():
                    launch(a, w, out, a_scale, w_scale, w_scale)
                    torch.cuda.synchronize()
                    results[pdl] = out.clone()
                same_bits = torch.equal(results[False], results[True])
                if M == 1024:
                    chain_failures[f"{dtype_name} {M}x{N}x{K}"] = check_chain(M, N, K, dtype, launches[True])
                if dtype == torch.int8:
                    w_t = w.t()
                    baseline = ("_int_mm", lambda: torch._int_mm(a, w_t))
                else:
                    w_t, sa, sb = w.t(), a_scale.view(-1, 1), w_scale.view(1, -1)
                    baseline = ("_scaled_mm", lambda: torch._scaled_mm(a, w_t, sa, sb, out_dtype=torch.bfloat16,
                                                                       use_fast_accum=True))
                ops = {baseline[0]: baseline[1],
                       "pdl_off": lambda: launches[False](a, w, out, a_scale, w_scale, w_scale),
                       "pdl_on": lambda: launches[True](a, w, out, a_scale, w_scale, w_scale)}
                medians, samples = rotated_medians(ops, adaptive_graph_ms, args.rounds)
                row = dict(dtype=dtype_name, M=M, N=N, K=K, config=name, same_bits=same_bits,
                           us={k: v * 1e3 for k, v in medians.items()},
                           samples_us={k: [v * 1e3 for v in vs] for k, vs in samples.items()},
                           pdl_saving_us=(medians["pdl_off"] - medians["pdl_on"]) * 1e3,
                           ratio_on_vs_baseline=medians[baseline[0]] / medians["pdl_on"],
                           ratio_off_vs_baseline=medians[baseline[0]] / medians["pdl_off"],
                           cublas_kernels=cublas_kernels(baseline[1]))
                rows.append(row)
                line = (f"{dtype_name:4s} {M:6d}x{N:5d}x{K:5d} {name:24s} {baseline[0]} {row['us'][baseline[0]]:9.2f} us"
                        f"  off {row['us']['pdl_off']:9.2f}  on {row['us']['pdl_on']:9.2f}"
                        f"  saved {row['pdl_saving_us']:6.2f} us  ratio off {row['ratio_off_vs_baseline']:.3f}"
                        f" on {row['ratio_on_vs_baseline']:.3f}  same bits {same_bits}")
                print(line)
                lines.append(line)
                del a, w, out, launches
                torch.cuda.empty_cache()
    lines.append(f"dependent-chain failures (of 40 per point): {chain_failures}")
    print(lines[-1])
    meta = environment_metadata()
    meta["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    (out_dir / "gemm_pdl.json").write_text(json.dumps(dict(meta=meta, rows=rows, chain_failures=chain_failures),
                                                      indent=1))
    (out_dir / "gemm_pdl.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
