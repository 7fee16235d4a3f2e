"""Session 45 GPU checks: the one-launch KV-cache write against torch's two index_copy_ calls.

    PYTHONPATH=. python benchmarks/gpu_checks_s45.py --out DIR

1. Bit-equality with the twin (``reference_attention.write_kv_cache``) on decode and prefill
   shapes, bf16 / fp16 / fp32, a head_dim below the cache's padded one, k as HF's transposed view.
2. Time: ``--layers`` writes of one decode step (batch 1 and 8, 8 kv heads, head_dim 128, a
   4096-slot cache per layer) captured in one CUDA graph, the kernel against index_copy_ x 2;
   ``--samples`` medians of ``--replays`` replays (CUDA events), the two rotated.

3. ``--pdl-equal``: in one process (the autotuners pick once), the e2e benchmark's small random
   Llama and Gemma-3 models, quantized plain (QuantLinear) and fast (``optimize(exact=False)``),
   generate greedily with PDL off and on, CUDA-graph and eager decode, and their prefill logits
   are compared bit for bit; HF's ``model.generate`` on the plain model is reported beside them.

Writes gpu_checks_s45.json under --out (gpu_checks_s45_pdl.json for stage 3).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _bits(t):
    import torch

    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def check_equal(shapes, dtypes) -> list[dict]:
    import torch

    from quantkit.kernels import kv_cache, reference_attention

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch, heads, seqlen, head_dim, cache_dim, capacity in shapes:
        for dtype in dtypes:
            k = torch.randn(batch, seqlen, heads, head_dim, device="cuda", generator=gen).to(dtype).transpose(1, 2)
            v = torch.randn(batch, heads, seqlen, head_dim, device="cuda", generator=gen).to(dtype)
            positions = torch.randperm(capacity, device="cuda", generator=gen)[:seqlen]
            k_cache = torch.randn(batch, heads, capacity, cache_dim, device="cuda", generator=gen).to(dtype)
            v_cache = torch.randn(batch, heads, capacity, cache_dim, device="cuda", generator=gen).to(dtype)
            k_twin, v_twin = k_cache.clone(), v_cache.clone()
            kv_cache.write_kv_cache(k, v, k_cache, v_cache, positions)
            reference_attention.write_kv_cache(k, v, k_twin, v_twin, positions)
            torch.cuda.synchronize()
            equal = bool(torch.equal(_bits(k_cache), _bits(k_twin)) and torch.equal(_bits(v_cache), _bits(v_twin)))
            rows.append({"shape": [batch, heads, seqlen, head_dim, cache_dim, capacity], "dtype": str(dtype),
                         "bit_equal": equal})
    return rows


def time_decode_writes(batch: int, layers: int, replays: int, samples: int) -> dict:
    import torch

    from quantkit.kernels import kv_cache, reference_attention

    heads, head_dim, capacity = 8, 128, 4096
    caches = [(torch.zeros(batch, heads, capacity, head_dim, dtype=torch.bfloat16, device="cuda"),
               torch.zeros(batch, heads, capacity, head_dim, dtype=torch.bfloat16, device="cuda"))
              for _ in range(layers)]
    k = torch.randn(batch, 1, heads, head_dim, device="cuda").to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(batch, 1, heads, head_dim, device="cuda").to(torch.bfloat16).transpose(1, 2)
    positions = torch.tensor([capacity // 2], device="cuda")

    def graph_of(write):
        for k_cache, v_cache in caches:  # compile outside the capture
            write(k, v, k_cache, v_cache, positions)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for k_cache, v_cache in caches:
                write(k, v, k_cache, v_cache, positions)
        return graph

    graphs = {"kernel": graph_of(kv_cache.write_kv_cache), "index_copy": graph_of(reference_attention.write_kv_cache)}
    times = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for sample in range(samples):
        names = list(graphs) if sample % 2 == 0 else list(graphs)[::-1]
        for name in names:
            graphs[name].replay()
            start.record()
            for _ in range(replays):
                graphs[name].replay()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / replays * 1e3 / layers)  # us per layer
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"batch": batch, "layers": layers, "us_per_layer": medians, "samples": times,
            "speedup": medians["index_copy"] / medians["kernel"]}


def pdl_equal(new_tokens: int = 24) -> list[dict]:
    """Stage 3: tokens and logits with PDL off and on, in one process."""
    import copy

    import torch

    from quantkit.api import quantize
    from quantkit.bench.e2e import _small_configs, check_model
    from quantkit.config import QuantConfig
    from quantkit.generate import generate
    from quantkit.kernels import launch
    from quantkit.models.fast_attention import register_quantkit_attention
    from quantkit.models.fast_path import optimize

    setting = launch.pdl_enabled()
    rows = []
    for arch, config in _small_configs().items():
        base, ids = check_model(config, "cuda", torch.bfloat16, 40)
        for scheme in ("fp8", "int8"):
            plain = quantize(copy.deepcopy(base), QuantConfig.preset(scheme), progress=False)
            hf_tokens = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
            plain.set_attn_implementation(register_quantkit_attention(device="cuda"))
            fast = optimize(copy.deepcopy(plain), exact=False)
            results = {}
            for on in (False, True, False, True):
                launch.PDL = on  # every launcher reads it per call
                for name, model in (("plain", plain), ("fast", fast)):
                    with torch.no_grad():
                        logits = model(ids).logits
                    graph = generate(model, ids, new_tokens, eos_token_id=None)
                    eager = generate(model, ids, new_tokens, eos_token_id=None, cuda_graph=False)
                    results.setdefault(name, []).append((on, logits, graph, eager))
            row = {"arch": arch, "scheme": scheme}
            for name, runs in results.items():
                _, logits0, graph0, _ = runs[0]
                row[f"{name}_logits_equal"] = all(bool(torch.equal(r[1], logits0)) for r in runs)
                row[f"{name}_tokens_equal"] = all(bool(torch.equal(r[2], graph0) and torch.equal(r[3], graph0))
                                                  for r in runs)
            row["plain_equals_hf_generate"] = bool(torch.equal(results["plain"][0][2], hf_tokens))
            row["passed"] = all(v for k, v in row.items() if k.endswith("_equal") and not k.startswith("plain_equals"))
            print(json.dumps(row), flush=True)
            rows.append(row)
    launch.PDL = setting
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--pdl-equal", action="store_true", help="stage 3 only")
    args = parser.parse_args()
    import torch

    from quantkit.bench.common import environment_metadata

    args.out.mkdir(parents=True, exist_ok=True)
    if args.pdl_equal:
        rows = pdl_equal()
        failed = [row for row in rows if not row["passed"]]
        (args.out / "gpu_checks_s45_pdl.json").write_text(json.dumps(
            {"meta": environment_metadata(), "rows": rows, "failed": failed}, indent=1))
        if failed:
            raise SystemExit(f"PDL changed logits or tokens: {failed}")
        return

    shapes = [(1, 8, 1, 128, 128, 4096), (8, 8, 1, 128, 128, 4096), (1, 8, 2048, 128, 128, 2560),
              (4, 8, 2048, 128, 128, 2048), (2, 3, 37, 80, 128, 41), (1, 1, 1, 256, 256, 3)]
    checks = check_equal(shapes, [torch.bfloat16, torch.float16, torch.float32])
    timings = [time_decode_writes(batch, args.layers, args.replays, args.samples) for batch in (1, 8)]
    failed = [row for row in checks if not row["bit_equal"]]
    result = {"meta": environment_metadata(), "checks": checks, "failed": failed, "timings": timings}
    (args.out / "gpu_checks_s45.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"checks": len(checks), "failed": len(failed),
                      "timings": [{k: v for k, v in t.items() if k != "samples"} for t in timings]}), flush=True)
    if failed:
        raise SystemExit(f"KV-cache write differs from the twin: {failed}")


if __name__ == "__main__":
    main()
