"""Host cost of ``launch.on_its_gpu`` (session 46's device guard on the public launchers), on one GPU.

    PYTHONPATH=. python benchmarks/launch_guard_cost.py --out DIR [--rounds 7] [--calls 2000]

Every public launcher runs under ``on_its_gpu``: one ``Tensor.get_device()`` and one
current-device query (``launch.current_gpu``) per call, before the launcher's own
``pdl_enabled()`` asks the current device again. Measured here in rotating rounds, in three forms:
``guarded`` (the code as it is), ``guarded, torch.cuda.current_device`` (``launch.current_gpu``
replaced by ``torch.cuda.current_device``: the code of commit a0736da, which asked on every call),
and ``unguarded`` (every launcher's ``__wrapped__`` set on its module, ``current_gpu`` as it is):
- the queries alone, per call;
- host time per call of three launchers on tiny tensors (the GPU work stays well below the host
  time, so the loop measures the host): FP8 ``scaled_mm`` at M = 1 (the GEMV), per-token
  quantization, RMSNorm;
- an eager decode loop: ``quantkit.generate`` with ``cuda_graph=False`` on the small seeded Llama
  of the fast-path checks (4 layers, FP8 dynamic, quantkit attention), ms per new token.
Writes launch_guard_cost.json under --out.
"""

import argparse
import copy
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gpu_checks_s46 import LAUNCHERS  # noqa: E402


def launcher_sets() -> tuple[list, list]:
    """(guarded, unguarded): (module, name, function) for every public launcher."""
    guarded, unguarded = [], []
    for module_name, names in LAUNCHERS.items():
        module = importlib.import_module(f"quantkit.kernels.{module_name}")
        for name in names:
            function = getattr(module, name)
            guarded.append((module, name, function))
            unguarded.append((module, name, function.__wrapped__))
    return guarded, unguarded


def install(functions, current_gpu) -> None:
    from quantkit.kernels import launch

    for module, name, function in functions:
        setattr(module, name, function)
    launch.current_gpu = current_gpu


def per_call_us(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from quantkit.api import quantize
    from quantkit.bench import e2e
    from quantkit.bench.common import environment_metadata
    from quantkit.config import QuantConfig
    from quantkit.generate import generate
    from quantkit.kernels import gemm, launch, norm, quant
    from quantkit.models.fast_attention import register_quantkit_attention

    device = torch.device("cuda:0")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, 1024, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1024, 1024, device=device, generator=gen).to(torch.float8_e4m3fn)
    a = x.to(torch.float8_e4m3fn)
    a_scale = torch.rand(1, device=device, generator=gen) + 0.5
    w_scale = torch.rand(1024, device=device, generator=gen) + 0.5
    norm_w = torch.randn(1024, device=device, dtype=torch.bfloat16, generator=gen)
    ops = {
        "torch.cuda.current_device": lambda: torch.cuda.current_device(),
        "launch.current_gpu": lambda: launch.current_gpu(),
        "launch.pdl_enabled": launch.pdl_enabled,
        "gemm.scaled_mm fp8 1x1024x1024": lambda: gemm.scaled_mm(a, w, a_scale, w_scale),
        "quant.quantize_per_token fp8 1x1024": lambda: quant.quantize_per_token(x, torch.float8_e4m3fn),
        "norm.rms_norm 1x1024": lambda: norm.rms_norm(x, norm_w, 1e-6),
    }
    config = e2e._small_configs()["llama"]
    base, ids = e2e.check_model(config, "cuda:0", torch.bfloat16, 40)
    model = quantize(copy.deepcopy(base), QuantConfig.preset("fp8"), progress=False)
    model.set_attn_implementation(register_quantkit_attention(device="cuda:0"))
    prompt = ids[:1]

    def decode_ms() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(model, prompt, args.new_tokens, eos_token_id=None, cuda_graph=False)
        torch.cuda.synchronize()
        if out.shape[1] != prompt.shape[1] + args.new_tokens:
            raise RuntimeError(f"generate returned {out.shape[1] - prompt.shape[1]} new tokens")
        return (time.perf_counter() - start) / args.new_tokens * 1e3

    guarded, unguarded = launcher_sets()
    query = launch.current_gpu
    forms = {"guarded": (guarded, query), "guarded, torch.cuda.current_device": (guarded, torch.cuda.current_device),
             "unguarded": (unguarded, query)}
    times = {form: {name: [] for name in [*ops, "generate eager ms/token"]} for form in forms}
    tokens = {}
    for form, setting in forms.items():  # warm-up: compile, tune, first calls
        install(*setting)
        for fn in ops.values():
            per_call_us(fn, 50)
        decode_ms()
        tokens[form] = generate(model, prompt, 16, eos_token_id=None, cuda_graph=False)
    for round_index in range(args.rounds):
        order = list(forms)[round_index % len(forms):] + list(forms)[:round_index % len(forms)]
        for form in order:
            install(*forms[form])
            for name, fn in ops.items():
                times[form][name].append(per_call_us(fn, args.calls))
            times[form]["generate eager ms/token"].append(decode_ms())
    install(*forms["guarded"])
    rows = []
    print(f"{'':42s} " + "  ".join(f"{form[:22]:>22s}" for form in forms), flush=True)
    for name in times["guarded"]:
        medians = {form: statistics.median(times[form][name]) for form in forms}
        rows.append({"op": name, "unit": "ms" if name.startswith("generate") else "us", "median": medians,
                     "all": {form: times[form][name] for form in forms}})
        print(f"{name:42s} " + "  ".join(f"{value:22.3f}" for value in medians.values()), flush=True)
    result = {"meta": environment_metadata(), "rounds": args.rounds, "calls": args.calls,
              "new_tokens": args.new_tokens, "tokens_equal": all(torch.equal(t, tokens["guarded"]) for t in tokens.values()),
              "rows": rows}
    (args.out / "launch_guard_cost.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
