"""GPTQ before and after session 28's dead-column change, layer by layer on the bundled model (CPU).

Before: a column that never saw an input got a unit Hessian diagonal, counted in the damping's mean.
After: it gets the live columns' mean diagonal, and the damping is a fraction of that mean. The
script loads the old gptq.py from git (commit b830aba's parent), collects the Hessians of a few
layers from the 64 x 512 calibration blocks, and counts the codes that differ and the layer's output
error ``tr(D H D^T)`` of each, INT8 and FP8. Run from the repository root:

    python benchmarks/gptq_damping_compare.py
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import quantkit
from quantkit.calibration import gptq as new
from quantkit.kernels.reference import qmax_of

LAYERS = ["model.layers.0.mlp.gate_proj", "model.layers.5.mlp.gate_proj", "model.layers.5.self_attn.q_proj"]


def old_gptq():
    source = subprocess.run(["git", "show", "b830aba^:quantkit/calibration/gptq.py"], check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "gptq_before_s28.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("gptq_before_s28", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    old = old_gptq()
    model, tokenizer = quantkit.load_model(quantkit.BUNDLED_MODEL, dtype=torch.float32)
    blocks = quantkit.prepare_calibration_data(tokenizer, quantkit.BUNDLED_DATASET, 64, 512)
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
        return record

    for name in LAYERS:
        model.get_submodule(name).register_forward_hook(hook(name))
    with torch.no_grad():
        for i in range(0, len(blocks), 8):
            model(blocks[i:i + 8])
    for name in LAYERS:
        weight = model.get_submodule(name).weight.detach()
        hessian = (2 * sums[name] / blocks.numel()).float()
        dead = int((torch.diag(hessian) == 0).sum())
        for dtype in (torch.int8, torch.float8_e4m3fn):
            scale = weight.abs().amax(1) / qmax_of(dtype)
            before = old.gptq_quantize(weight, hessian, scale, dtype).float()
            after = new.gptq_quantize(weight, hessian, scale, dtype).float()

            def output_error(q):
                d = (q * scale[:, None] - weight).double()
                return float(torch.einsum("nk,kl,nl->", d, hessian.double(), d))

            print(f"{name} {str(dtype).removeprefix('torch.')}: {dead} dead columns, "
                  f"{int((before != after).sum())} of {before.numel()} codes differ, "
                  f"output error {output_error(before):.4g} before / {output_error(after):.4g} after", flush=True)


if __name__ == "__main__":
    sys.exit(main())
