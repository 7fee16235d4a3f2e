"""Programmatic dependent launch (``QUANTKIT_PDL``) and the one-launch KV-cache write on decode, GPU.

    PYTHONPATH=. python benchmarks/decode_pdl.py --out DIR [--layers 32] [--dtypes int8,fp8]
        [--pdl 0,1] [--model-tokens N [--no-model] [--toggle fp8,int8]]

Three stages. In the first two each setting (``--pdl``: QUANTKIT_PDL values, off first) runs in
its own process (``launch.PDL`` is resolved from QUANTKIT_PDL on the first launch):

1. The chain: the quantized part of a Llama-3-8B decode step at batch 1, ``--layers`` times over
   distinct weights (every weight comes from memory, as in a model). Per layer: residual add +
   RMSNorm + per-token quantization -> q/k/v GEMV (6144 x 4096) -> quantization of its first 4096
   columns -> o GEMV (4096 x 4096) -> quantization -> gated gate/up GEMV (2 x 14336 x 4096, SiLU)
   -> quantization -> down GEMV (4096 x 14336). Captured as one CUDA graph; ``--samples`` medians
   of ``--replays`` replays (CUDA events). The GEMV config is pinned (GEMV_CONFIG), so all
   processes run the same kernels; their outputs must be bit-equal, and each graph's output equal
   to its eager run's.
2. The model (``--model-tokens`` > 0, unless ``--no-model``): the e2e benchmark's ``<scheme>-fast``
   Llama-3-8B-shaped model (random weights) generates greedily from one seeded 512-token prompt
   through ``quantkit.generate`` (CUDA-graph decode); the median ms/token of three runs, and the
   tokens, which should be equal across settings (the autotuners may pick differently in two
   processes, and FP8 sums in another order under another config, so a difference is reported,
   not raised).
3. ``--toggle SCHEMES`` (with ``--model-tokens``): one process per scheme builds the model once and
   generates under each of ``TOGGLE_VARIANTS`` twice (PDL off / on, ``set_pdl``, and the KV-cache
   write by the kernel or by index_copy_, ``set_kv_write``), so the autotuned configs are the same
   in all: the tokens must be equal.
4. ``--gemv-configs SCHEMES`` (with ``--model-tokens``): one process per scheme pins every GEMV
   shape of the model to each config of ``gemv.GEMV_CONFIGS`` (or ``--gemv-candidates``) in turn (through the tuned-config
   table), between two runs with the autotuner's per-shape picks; INT8 tokens must be equal (the
   sums are exact), FP8's may differ (another summation order).

Writes decode_pdl.json under --out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, QKV, INTERMEDIATE = 4096, 6144, 14336
# One GEMV config for every shape (the H200 run of session 44 picked 4x2048 or 8x1024 w4 at M = 1).
GEMV_CONFIG = {"BLOCK_N": 4, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1}


def child(dtype_name: str, layers: int, replays: int, samples: int, out: Path) -> dict:
    import torch

    from quantkit.kernels import gemv, launch, quant, reference

    dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(n: int, k: int):
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * k**-0.5
        return reference.quantize_per_channel(w, dtype)

    stack = [dict(qkv=weight(QKV, HIDDEN), o=weight(HIDDEN, HIDDEN), gate_up=weight(2 * INTERMEDIATE, HIDDEN),
                  down=weight(HIDDEN, INTERMEDIATE)) for _ in range(layers)]
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).to(torch.bfloat16)
    x_in = torch.randn(1, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)

    def gemv_call(a, scale, w_and_scale, gated=False):
        w, w_scale = w_and_scale
        n = w.shape[0] // 2 if gated else w.shape[0]
        out = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device="cuda")
        gemv._launch(a, w, out, scale, w_scale, None, "silu" if gated else "none", False, GEMV_CONFIG, gated)
        return out

    def step():
        residual, x = x_in, torch.zeros_like(x_in)
        for layer in stack:
            a, s, residual = quant.rms_norm_quant_per_token(x, norm_weight, 1e-6, dtype, residual=residual)
            h = gemv_call(a, s, layer["qkv"])
            a, s = quant.quantize_per_token(h[:, :HIDDEN], dtype)
            o = gemv_call(a, s, layer["o"])
            a, s = quant.quantize_per_token(o, dtype)
            g = gemv_call(a, s, layer["gate_up"], gated=True)
            a, s = quant.quantize_per_token(g, dtype)
            x = gemv_call(a, s, layer["down"])
        return torch.cat([x, residual])

    eager = step()  # compiles every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    graph.replay()
    torch.cuda.synchronize()
    outputs_equal = bool(torch.equal(result, eager))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    outputs_equal &= bool(torch.equal(result, eager))
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(samples):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / replays * 1e3)  # us per chain
    torch.save(result.cpu(), out)
    return {"dtype": dtype_name, "pdl": launch.pdl_name(), "layers": layers, "us_per_chain": statistics.median(times),
            "us_samples": times, "graph_equals_eager": outputs_equal,
            "weight_bytes": sum(w.numel() for layer in stack for w, _ in layer.values())}


def _model_and_prompt(scheme: str, new_tokens: int):
    """The e2e benchmark's ``<scheme>-fast`` model, its seeded 512-token prompt, and one warm-up
    generation (compile, tune, capture)."""
    import torch

    from quantkit.bench.e2e import PROMPT_LEN, llama3_8b_config, prepare_variant
    from quantkit.generate import generate

    config = llama3_8b_config()
    torch.manual_seed(0)
    model = prepare_variant(f"{scheme}-fast", config, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, PROMPT_LEN), device="cuda", generator=gen)
    generate(model, ids, new_tokens, eos_token_id=None)
    return model, ids


def _timed_generate(model, ids, new_tokens: int):
    """Greedy tokens and the decode loop's ms per token."""
    from quantkit.generate import generate

    stats: dict = {}
    tokens = generate(model, ids, new_tokens, eos_token_id=None, stats=stats)
    return tokens, stats["decode_s"] / stats["decode_steps"] * 1e3


def model_child(scheme: str, new_tokens: int, out: Path) -> dict:
    import torch

    from quantkit.kernels import launch

    model, ids = _model_and_prompt(scheme, new_tokens)
    runs = []
    for _ in range(3):
        tokens, ms = _timed_generate(model, ids, new_tokens)
        runs.append(ms)
    torch.save(tokens.cpu(), out)
    return {"scheme": scheme, "pdl": launch.pdl_name(), "ms_per_token": statistics.median(runs), "ms_runs": runs}


def set_pdl(on: bool) -> None:
    """PDL on or off in this process (every launcher reads ``launch.PDL`` per call)."""
    from quantkit.kernels import launch

    launch.PDL = on


def set_kv_write(kernel: bool) -> None:
    """generate's KV-cache write: the one-launch kernel (the default on CUDA) or torch's two
    index_copy_ calls (what session 44 measured)."""
    import quantkit.generate
    from quantkit.kernels import attention_ops

    def with_index_copy(*args, backend="torch"):
        return attention_ops.write_kv_cache(*args, backend="torch")

    quantkit.generate.write_kv_cache = attention_ops.write_kv_cache if kernel else with_index_copy


# (PDL, KV write by the kernel), each run twice in this order by the toggle stage.
TOGGLE_VARIANTS = [(False, False), (False, True), (True, True)]


def toggle_child(scheme: str, new_tokens: int) -> dict:
    import torch

    from quantkit.generate import generate

    model, ids = _model_and_prompt(scheme, new_tokens)  # compiled and tuned with the process's setting
    runs = []
    for on, kernel in TOGGLE_VARIANTS * 2:
        set_pdl(on)
        set_kv_write(kernel)
        generate(model, ids, new_tokens, eos_token_id=None)  # compile the PDL kernels outside the timing
        tokens, ms = _timed_generate(model, ids, new_tokens)
        runs.append((on, kernel, tokens, ms))
    first = runs[0][2]
    return {"scheme": scheme, "tokens_equal": all(bool(torch.equal(t, first)) for _, _, t, _ in runs),
            "ms_per_token": [["pdl on" if on else "pdl off", "kernel" if kernel else "index_copy", ms]
                             for on, kernel, _, ms in runs]}


def gemv_configs_child(scheme: str, new_tokens: int, names: str | None) -> dict:
    """Stage 4: the model's decode with every GEMV shape pinned to one config of GEMV_CONFIGS (or
    of ``names``, gemv.parse_config's form) in turn, against the autotuner's per-shape picks
    (before and after), in one process."""
    import torch

    from quantkit.kernels import gemv, launch

    model, ids = _model_and_prompt(scheme, new_tokens)  # tunes every GEMV shape of the model
    tuned = dict(gemv._TUNED)
    runs, first = [], None
    pinned = ([gemv.parse_config(n) for n in names.split(",")] if names
              else [launch.config_dict(c) for c in gemv.GEMV_CONFIGS])
    candidates = [None] + pinned + [None]
    for config in candidates:
        for key in gemv._TUNED:
            gemv._TUNED[key] = tuned[key] if config is None else config
        _timed_generate(model, ids, new_tokens)  # compile outside the timing
        tokens, ms = _timed_generate(model, ids, new_tokens)
        first = tokens if first is None else first
        runs.append({"config": "autotuned" if config is None else gemv.config_name(config), "ms_per_token": ms,
                     "tokens_equal": bool(torch.equal(tokens, first))})
    gemv._TUNED.update(tuned)
    return {"scheme": scheme, "tuned": {str(k[:3]): gemv.config_name(v) for k, v in tuned.items()}, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--model-tokens", type=int, default=0)
    parser.add_argument("--schemes", default="fp8,int8")
    parser.add_argument("--toggle", default=None, help="schemes for stage 3 (same-process off/on/off)")
    parser.add_argument("--gemv-configs", default=None, help="schemes for stage 4 (GEMV configs pinned in turn)")
    parser.add_argument("--gemv-candidates", default=None,
                        help="stage 4's configs, BNxBKwW,... (default: gemv.GEMV_CONFIGS)")
    parser.add_argument("--chain", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--model", action=argparse.BooleanOptionalAction, default=True,
                        help="stage 2 (with --model-tokens); --no-model runs only the toggle stage's model")
    parser.add_argument("--pdl", default="0,1", help="QUANTKIT_PDL values of stages 1-2, off first")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if (args.toggle or args.gemv_configs) and args.model_tokens < 2:
        parser.error(f"--toggle / --gemv-configs generate with the model: give --model-tokens >= 2 (got "
                     f"{args.model_tokens})")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        kind, name, tag = args.child.split(":")
        if kind == "toggle":
            row = toggle_child(name, args.model_tokens)
        elif kind == "gemv_configs":
            row = gemv_configs_child(name, args.model_tokens, args.gemv_candidates)
        elif kind == "model":
            row = model_child(name, args.model_tokens, args.out / f"{tag}.pt")
        else:
            row = child(name, args.layers, args.replays, args.samples, args.out / f"{tag}.pt")
        (args.out / f"{tag}.json").write_text(json.dumps(row))
        return

    import torch

    from quantkit.bench.common import environment_metadata

    def run_pair(kind: str, name: str) -> list[dict]:
        rows, first = [], None
        for pdl in args.pdl.split(","):
            tag = f"{kind}_{name}_pdl{pdl}"
            env = {**os.environ, "QUANTKIT_PDL": pdl}
            t0 = time.time()
            subprocess.run([sys.executable, __file__, "--out", str(args.out), "--layers", str(args.layers),
                            "--replays", str(args.replays), "--samples", str(args.samples), "--model-tokens",
                            str(args.model_tokens), "--child", f"{kind}:{name}:{tag}"], env=env, check=True)
            row = json.loads((args.out / f"{tag}.json").read_text())
            output = torch.load(args.out / f"{tag}.pt")
            first = output if first is None else first
            finite = bool(output.float().isfinite().all()) if output.is_floating_point() else True
            row.update(tag=tag, equals_pdl_off=bool(torch.equal(output, first)), finite=finite,
                       process_s=time.time() - t0)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "us_samples"}), flush=True)
        return rows

    rows, summary = [], {}
    for dtype_name in args.dtypes.split(",") if args.chain else ():
        off, *ons = run_pair("chain", dtype_name)
        rows += [off, *ons]
        summary[f"chain_{dtype_name}"] = {"us_off": off["us_per_chain"],
                                          **{f"us_{on['pdl']}": on["us_per_chain"] for on in ons},
                                          **{f"speedup_{on['pdl']}": off["us_per_chain"] / on["us_per_chain"]
                                             for on in ons},
                                          "bit_equal": all(on["equals_pdl_off"] for on in ons)}
    if args.model_tokens and args.model:
        for scheme in args.schemes.split(","):
            off, *ons = run_pair("model", scheme)
            rows += [off, *ons]
            summary[f"model_{scheme}"] = {"ms_off": off["ms_per_token"],
                                          **{f"ms_{on['pdl']}": on["ms_per_token"] for on in ons},
                                          **{f"speedup_{on['pdl']}": off["ms_per_token"] / on["ms_per_token"]
                                             for on in ons},
                                          "tokens_equal": all(on["equals_pdl_off"] for on in ons)}
    for kind, schemes in (("toggle", args.toggle), ("gemv_configs", args.gemv_configs)):
        for scheme in schemes.split(",") if schemes else ():
            # One process per scheme, in the process's default PDL setting.
            tag = f"{kind}_{scheme}"
            extra = ["--gemv-candidates", args.gemv_candidates] if args.gemv_candidates else []
            subprocess.run([sys.executable, __file__, "--out", str(args.out), "--model-tokens",
                            str(args.model_tokens), "--child", f"{kind}:{scheme}:{tag}", *extra], check=True)
            row = json.loads((args.out / f"{tag}.json").read_text())
            row["tag"] = tag
            rows.append(row)
            summary[tag] = row
            print(json.dumps(row), flush=True)
    failed = [r["tag"] for r in rows if (r["tag"].startswith("chain") and not (
        r["graph_equals_eager"] and r["equals_pdl_off"] and r["finite"])) or (r["tag"].startswith("toggle")
                                                                              and not r["tokens_equal"])
              or (r["tag"] == "gemv_configs_int8" and not all(run["tokens_equal"] for run in r["runs"]))]
    print(json.dumps(summary), flush=True)
    meta = {**environment_metadata(), "pdl": "per row (each child process sets QUANTKIT_PDL)"}
    (args.out / "decode_pdl.json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                          "failed_checks": failed, "rows": rows}, indent=1))
    if failed:
        raise SystemExit(f"chain checks failed: {failed}")


if __name__ == "__main__":
    main()
