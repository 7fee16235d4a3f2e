"""Session 28's review fixes on the GPU (one JSON file of checks; raises nothing, records each).

    PYTHONPATH=. python benchmarks/review_s28_check.py OUT.json [CHECK ...]   # e.g. compile_check

- Quantized layers on the Triton kernels: with autograd recording, the forward gives the same
  values as under no_grad and a backward raises; transposed / strided inputs give the contiguous
  input's bits (FP8 and INT8, dynamic and static, the GEMV, tiled and Gluon sizes of M).
- An Exaone-4 model whose global layers pass ``sliding_window=None``: quantkit's Triton attention
  against SDPA (logits and greedy tokens).
- The end-to-end fast-path checks (``run_fast_path_checks``: exact and exact=False modes, CUDA
  graph decode against eager decode, the norm + quantization and residual fusions).
- ``optimize(exact=False)`` compiled with ``torch.compile(fullgraph=True)`` on CUDA.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback

import torch
from torch import nn

import quantkit
from quantkit.bench.common import environment_metadata
from quantkit.bench.e2e import run_fast_path_checks
from quantkit.models.fast_attention import register_quantkit_attention
from quantkit.nn import QuantLinear

RESULTS: list[dict] = []


def record(name: str, ok: bool, **info) -> None:
    RESULTS.append({"check": name, "ok": bool(ok), **info})
    print(f"[{'ok' if ok else 'FAIL'}] {name} {info}", flush=True)


def layer_checks() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float8_e4m3fn, torch.int8):
        for static in (False, True):
            linear = nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16)
            layer = QuantLinear.from_linear(linear, dtype, input_amax=6.0 if static else None, backend="triton")
            for M in (1, 13, 1024):
                x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                with torch.no_grad():
                    want = layer(x)
                    strided = layer(x.detach().t().contiguous().t())
                    wide = torch.randn(M, 8192, device="cuda", dtype=torch.bfloat16)
                    every_other = torch.equal(layer(wide[:, ::2]), layer(wide[:, ::2].contiguous()))
                got = layer(x)
                try:
                    got.float().sum().backward()
                    refused = False
                except RuntimeError as exc:
                    refused = "no backward" in str(exc)
                record("quant_linear", torch.equal(got.detach(), want) and torch.equal(strided, want) and every_other
                       and refused, dtype=str(dtype), static=static, M=M, backward_refused=refused)


def exaone_check() -> None:
    from transformers import Exaone4Config, Exaone4ForCausalLM

    for layer_types in (["full_attention"] * 2, ["sliding_attention", "full_attention"]):
        torch.manual_seed(0)
        model = Exaone4ForCausalLM(Exaone4Config(
            vocab_size=160, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, sliding_window=8,
            layer_types=layer_types, bos_token_id=1, eos_token_id=2, pad_token_id=0)).to("cuda", torch.bfloat16).eval()
        ids = torch.randint(3, 160, (1, 40), device="cuda")
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            want = model(ids).logits.float()
            want_tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
        model.set_attn_implementation(register_quantkit_attention(backend="triton", device="cuda"))
        with torch.no_grad():
            got = model(ids).logits.float()
            got_tokens = model.generate(ids, max_new_tokens=8, do_sample=False)
        err = ((got - want).norm() / want.norm()).item()
        record("exaone4_window_none", err < 2e-2 and torch.equal(got_tokens, want_tokens), layer_types=layer_types,
               rel_err=err, tokens_equal=bool(torch.equal(got_tokens, want_tokens)))


def compile_check() -> None:
    from quantkit.bench.e2e import _small_configs, build_model

    config = _small_configs()["llama"]
    torch.manual_seed(0)
    base = build_model(config, "cuda", torch.bfloat16)
    plain = quantkit.quantize(copy.deepcopy(base), "int8", progress=False)
    model = quantkit.optimize(copy.deepcopy(plain), exact=False)
    ids = torch.randint(3, config.vocab_size, (2, 64), device="cuda")

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    with torch.no_grad():
        exact = base(ids, use_cache=False).logits.float()
        plain_err = rel(plain(ids, use_cache=False).logits.float(), exact)
        want = model(ids, use_cache=False).logits.float()
        got = torch.compile(model, fullgraph=True)(ids, use_cache=False).logits.float()
    # Traced, the norms do not defer (no fused norm + quantization): the compiled model rounds as
    # the plain path does, so it differs from the eager exact=False model by about the
    # quantization error itself. The check: as close to the unquantized model as the plain path.
    compiled_err, eager_err = rel(got, exact), rel(want, exact)
    record("compile_fullgraph_exact_false", compiled_err <= 1.1 * plain_err, compiled_vs_eager=rel(got, want),
           compiled_vs_unquantized=compiled_err, eager_vs_unquantized=eager_err, plain_vs_unquantized=plain_err)


def main() -> None:
    out = sys.argv[1]
    only = sys.argv[2:]  # check names to run (default: all)
    for check in (layer_checks, exaone_check, compile_check):
        if only and check.__name__ not in only:
            continue
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - every check is recorded, the run goes on
            record(check.__name__, False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    try:
        rows = run_fast_path_checks("cuda", norm_quant=True) if not only or "fast_path" in only else []
        for row in rows:
            record("fast_path", row["passed"], **{k: v for k, v in row.items() if not k.endswith("report")})
    except Exception as exc:  # noqa: BLE001
        record("fast_path", False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    with open(out, "w") as f:
        json.dump({"meta": environment_metadata(), "checks": RESULTS}, f, indent=1, default=str)
    print(f"{sum(r['ok'] for r in RESULTS)} of {len(RESULTS)} checks passed", flush=True)


if __name__ == "__main__":
    main()
