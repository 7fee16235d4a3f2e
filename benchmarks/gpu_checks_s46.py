"""GPU check of session 46: a quantized model on the second GPU while the first one is current.

    PYTHONPATH=. python benchmarks/gpu_checks_s46.py --out DIR      # needs 2 CUDA GPUs

triton launches on the current GPU and its current stream; ``launch.on_its_gpu`` makes the
launchers run with their first tensor's GPU current. One process per mode, GPU 0 current
throughout: the small seeded Llama of the e2e fast-path checks, quantized FP8 (dynamic per token)
on cuda:0 and on cuda:1, Triton backend, quantkit attention. Compared: the prompt's logits and
``quantkit.generate``'s greedy tokens (CUDA-graph decode) of the two copies.
- ``guarded``: the code as it is; the two GPUs must agree bit for bit.
- ``unguarded``: every public launcher replaced by the function it wraps (``__wrapped__``): what
  the code did before; the error or the difference is recorded.
Writes gpu_checks_s46.json under --out.
"""

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAUNCHERS = {"gemm": ("scaled_mm", "gated_scaled_mm"),
             "moe": ("plan_for", "grouped_scaled_mm", "gather_slots", "grouped_slot_mm", "combine"),
             "quant": ("quantize_per_token", "quantize_per_tensor", "rms_norm_quant_per_token"),
             "attention": ("flash_attention", "decode_attention"), "attention_decode": ("decode_attention",),
             "rope": ("apply_rope",), "kv_cache": ("write_kv_cache",), "norm": ("rms_norm", "layer_norm")}


def child(mode: str) -> dict:
    import importlib

    import torch

    from quantkit.api import quantize
    from quantkit.bench import e2e
    from quantkit.config import QuantConfig
    from quantkit.generate import generate
    from quantkit.models.fast_attention import register_quantkit_attention

    if mode == "unguarded":
        for module_name, names in LAUNCHERS.items():
            module = importlib.import_module(f"quantkit.kernels.{module_name}")
            for name in names:
                setattr(module, name, getattr(module, name).__wrapped__)
    config = e2e._small_configs()["llama"]
    base, ids = e2e.check_model(config, "cuda:0", torch.bfloat16, 40)
    row = {"mode": mode}
    out = {}
    try:
        for device in ("cuda:0", "cuda:1"):
            model = quantize(copy.deepcopy(base).to(device), QuantConfig.preset("fp8"), progress=False)
            model.set_attn_implementation(register_quantkit_attention(device=device))
            with torch.no_grad():
                logits = model(ids.to(device)).logits
            tokens = generate(model, ids.to(device), 16, eos_token_id=None)
            torch.cuda.synchronize(device)
            out[device] = (logits.to("cuda:0"), tokens.to("cuda:0"))
            row[f"backend_{device}"] = getattr(model.model.layers[0].mlp.down_proj, "backend", None)
        (l0, t0), (l1, t1) = out["cuda:0"], out["cuda:1"]
        row.update(logits_equal=bool(torch.equal(l0, l1)), max_abs_logit_diff=float((l0 - l1).abs().max()),
                   tokens_equal=bool(torch.equal(t0, t1)), finite=bool(l1.isfinite().all()))
    except Exception as err:  # the unguarded mode may fail on the GPU: record it
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    row["current_device_after"] = torch.cuda.current_device()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--modes", default="guarded,unguarded")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        (args.out / f"{args.child}.json").write_text(json.dumps(child(args.child)))
        return
    import torch

    from quantkit.bench.common import environment_metadata

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"this check needs 2 CUDA GPUs; {torch.cuda.device_count()} found")
    rows = []
    for mode in args.modes.split(","):
        run = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--child", mode],
                             capture_output=True, text=True)
        path = args.out / f"{mode}.json"
        row = json.loads(path.read_text()) if path.exists() else {"mode": mode}
        row["returncode"] = run.returncode
        if run.returncode:
            row["stderr_tail"] = run.stderr[-1500:]
        rows.append(row)
        print(json.dumps(row), flush=True)
    failed = [r["mode"] for r in rows if r["mode"] == "guarded" and not (
        r.get("logits_equal") and r.get("tokens_equal") and r.get("current_device_after") == 0)]
    (args.out / "gpu_checks_s46.json").write_text(json.dumps({"meta": environment_metadata(), "rows": rows,
                                                              "failed_checks": failed}, indent=1))
    if failed:
        raise SystemExit(f"checks failed: {failed}")


if __name__ == "__main__":
    main()
