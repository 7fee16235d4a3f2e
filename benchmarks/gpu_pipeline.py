"""GPU check of the whole pipeline on the bundled Gemma-3-270M (run through the device tool).

Quantizes with fp8 and int8 on the Triton backend, compares the logits with the torch reference
backend on the same GPU, saves and reloads (logits must be bit-identical), and times a forward.
Writes a JSON report to the path given as the first argument.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile

import torch
import triton
import transformers

import quantkit
from quantkit.bench.common import environment_metadata
from quantkit.kernels.reference import sqnr_db


def main(out_path: str) -> None:
    device = "cuda"
    model, tokenizer = quantkit.load_model(quantkit.BUNDLED_MODEL, device=device)
    tokens = quantkit.prepare_evaluation_tokens(tokenizer, quantkit.BUNDLED_DATASET, max_tokens=4 * 1024)
    ids = torch.cat([torch.tensor([tokenizer.bos_token_id]), tokens[1:1024]]).to(device)[None]
    report = {
        **environment_metadata(),
        "transformers": transformers.__version__,
        "schemes": {},
    }
    with torch.no_grad():
        base_logits = model(input_ids=ids).logits.float()
    for scheme in ("fp8", "int8", "fp8-static", "int8-static"):
        config = quantkit.QuantConfig.preset(scheme)
        blocks = None
        if config.needs_calibration:
            blocks = quantkit.prepare_calibration_data(tokenizer, quantkit.BUNDLED_DATASET, 16, 512, model=model)
        on_triton = quantkit.quantize(copy.deepcopy(model), config.replace(backend="triton"), blocks, progress=False)
        on_torch = quantkit.quantize(copy.deepcopy(model), config.replace(backend="torch"), blocks, progress=False)
        with torch.no_grad():
            lt = on_triton(input_ids=ids).logits.float()
            lr = on_torch(input_ids=ids).logits.float()
        with tempfile.TemporaryDirectory() as tmp:
            quantkit.save(on_triton, f"{tmp}/ckpt", tokenizer=tokenizer)
            reloaded = quantkit.load(f"{tmp}/ckpt", device=device)
            with torch.no_grad():
                ll = reloaded(input_ids=ids).logits.float()
        timings = {}
        for name, m in (("baseline_bf16", model), ("triton", on_triton), ("torch_reference", on_torch)):
            with torch.no_grad():
                timings[name] = triton.testing.do_bench(lambda: m(input_ids=ids), warmup=50, rep=200)
        row = {
            "triton_vs_torch_rel": ((lt - lr).norm() / lr.norm()).item(),
            "triton_vs_bf16_sqnr_db": sqnr_db(base_logits, lt),
            "reload_bit_identical": bool(torch.equal(ll, lt)),
            "forward_ms_1x1024": timings,
            "nan": bool(torch.isnan(lt).any()),
        }
        report["schemes"][scheme] = row
        print(scheme, json.dumps(row), flush=True)
        del on_triton, on_torch, reloaded
    with open(out_path, "w") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
