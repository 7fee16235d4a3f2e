"""Why is eager prefill at 1x2048 slower than its CUDA-graph replay? (session 5, one GPU run)

Llama-3-8B layer shapes, 8 layers, random weights, int8 and fp8 fast paths. Per variant: eager
forward ms (median of 5), issue time (host returns before the GPU is done), graph-replay ms,
any synchronizing op (torch.cuda.set_sync_debug_mode), and a cProfile of one forward.
"""
import cProfile
import gc
import io
import json
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quantkit.api import quantize  # noqa: E402
from quantkit.bench.e2e import build_model, llama3_8b_config  # noqa: E402
from quantkit.config import QuantConfig  # noqa: E402
from quantkit.models.fast_path import optimize  # noqa: E402


def sync_ms(fn, reps=5):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return sorted(out)[len(out) // 2]


def issue_ms(fn, reps=5):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    return sorted(out)[len(out) // 2]


def main(out_dir):
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    config = llama3_8b_config(num_hidden_layers=8)
    for scheme in ("int8", "fp8"):
        for norm_quant in (True, False):
            model = build_model(config, "cuda")
            quantize(model, QuantConfig.preset(scheme), progress=False)
            optimize(model, exact=False, norm_quant=norm_quant)
            print(scheme, norm_quant, model.quantkit_fast_path, flush=True)
            ids = torch.randint(0, config.vocab_size, (1, 2048), device="cuda")

            @torch.no_grad()
            def fwd():
                return model(ids, use_cache=False, logits_to_keep=1)

            for _ in range(3):
                fwd()
            row = {"scheme": scheme, "norm_quant": norm_quant, "eager_ms": sync_ms(fwd), "issue_ms": issue_ms(fwd)}
            gc.disable()
            row["eager_ms_gc_off"] = sync_ms(fwd)
            row["issue_ms_gc_off"] = issue_ms(fwd)
            gc.enable()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                fwd()
                torch.cuda.set_sync_debug_mode(0)
            row["sync_warnings"] = [str(w.message)[:300] for w in caught][:10]
            row["n_sync_warnings"] = len(caught)
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fwd()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                fwd()
            row["graph_ms"] = sync_ms(graph.replay)
            del graph
            prof = cProfile.Profile()
            torch.cuda.synchronize()
            prof.enable()
            fwd()
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            row["cprofile_tottime"] = buf.getvalue()[-6000:]
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
            row["cprofile_cumulative"] = buf.getvalue()[-6000:]
            print({k: v for k, v in row.items() if not k.startswith("cprofile")}, flush=True)
            results.append(row)
            (out_dir / "host_profile_s5.json").write_text(json.dumps(results, indent=1))
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
