"""Where a graph-captured decode step spends its time (GPU, Llama-3-8B shape, random weights).

    PYTHONPATH=. python benchmarks/decode_profile.py [--schemes fp8,int8] [--batches 1,8] [--out DIR]

For each scheme, the e2e benchmark's ``<scheme>-fast`` model (``quantkit.bench.e2e.prepare_variant``)
runs ``quantkit.generate`` twice under ``torch.profiler`` with 17 and 81 new tokens after the same
512-token prompt. The per-kernel GPU time of the second minus that of the first, over the 64 extra
steps, is a decode step's kernel time without the prefill and capture; the wall time of the two
runs' decode loops (``stats["decode_s"]``) gives the step's time. Their difference is time the GPU
spent between kernels. Writes decode_profile.json under --out.
"""

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.e2e import PROMPT_LEN, llama3_8b_config, prepare_variant  # noqa: E402
from quantkit.generate import generate  # noqa: E402

SHORT, LONG = 17, 81


def kernel_times(model, ids, new_tokens: int) -> tuple[dict[str, float], float, int, dict[str, int]]:
    """GPU microseconds per kernel name, the decode loop's wall seconds, its step count and the
    launches per kernel name."""
    stats: dict = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(model, ids, new_tokens, eos_token_id=None, stats=stats)
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time
            counts[event.name] += 1
    return dict(times), stats["decode_s"], stats["decode_steps"], dict(counts)


def category(name: str) -> str:
    lowered = name.lower()
    for key, label in (("attention", "attention"), ("decode", "attention"), ("gemv", "gemv"),
                       ("nvjet", "cublas (lm_head)"), ("gated", "gemm"), ("scaled_mm", "gemm"), ("gemm", "gemm"),
                       ("split", "gemm"), ("rms", "norm+quant"), ("quant", "norm+quant"), ("rope", "rope"),
                       ("index_copy", "kv-cache write"), ("kv_cache_write", "kv-cache write"), ("memcpy", "copy"),
                       ("memset", "copy")):
        if key in lowered:
            return label
    return "other"


def profile_scheme(scheme: str, batches: list[int]) -> list[dict]:
    config = llama3_8b_config()
    model = prepare_variant(f"{scheme}-fast", config, "cuda")
    weight_bytes = sum(b.numel() * b.element_size() for b in model.buffers()) + sum(
        p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for batch in batches:
        ids = torch.randint(0, config.vocab_size, (batch, PROMPT_LEN), device="cuda")
        generate(model, ids, SHORT, eos_token_id=None)  # compile, tune, capture outside the profile
        short, short_s, short_steps, short_counts = kernel_times(model, ids, SHORT)
        long, long_s, long_steps, counts = kernel_times(model, ids, LONG)
        steps = long_steps - short_steps
        per_kernel = {name: (long.get(name, 0.0) - short.get(name, 0.0)) / steps for name in long}
        step_us = (long_s - short_s) / steps * 1e6
        kernel_us = sum(per_kernel.values())
        by_category: dict[str, float] = collections.defaultdict(float)
        for name, us in per_kernel.items():
            by_category[category(name)] += us
        top = sorted(per_kernel.items(), key=lambda item: -item[1])[:25]
        rows.append({
            "scheme": scheme, "batch": batch, "steps": steps, "step_us": step_us, "kernel_us": kernel_us,
            "idle_us": step_us - kernel_us, "weight_bytes": weight_bytes,
            "weight_tb_per_s_at_step": weight_bytes / step_us / 1e6,
            "by_category_us": dict(sorted(by_category.items(), key=lambda item: -item[1])),
            "top_kernels_us": [{"name": name[:160], "us_per_step": us,
                                "launches_per_step": (counts[name] - short_counts.get(name, 0)) / steps} for name, us in top],
        })
        print(f"{scheme} b{batch}: step {step_us:.1f} us, kernels {kernel_us:.1f} us, "
              f"idle {step_us - kernel_us:.1f} us; " + ", ".join(f"{k} {v:.0f}" for k, v in rows[-1]["by_category_us"].items()),
              flush=True)
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", default="fp8,int8")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = [row for scheme in args.schemes.split(",") for row in profile_scheme(scheme, batches)]
    meta = {**environment_metadata(), "prompt_len": PROMPT_LEN, "short": SHORT, "long": LONG}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_profile.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
