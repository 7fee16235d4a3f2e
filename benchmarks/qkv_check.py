"""GPU check of the fused q/k/v projections (``optimize(exact=False)``, ``FusedQKV``).

    PYTHONPATH=. python benchmarks/qkv_check.py --out $OUT

Small random Llama and Gemma-3 models (bench.e2e's check configs), bf16, Triton backend, INT8 and
FP8: ``optimize(exact=False)`` with the fused q/k/v projections against the same without them
(``qkv=False``). INT8 accumulates exactly and the epilogue is per element, so the logits must be
bit-equal, and so must greedy tokens through ``quantkit.generate`` (CUDA-graph decode); FP8
reports the largest logit difference and token agreement.
"""

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from quantkit.api import quantize  # noqa: E402
from quantkit.bench.common import environment_metadata  # noqa: E402
from quantkit.bench.e2e import _small_configs, build_model  # noqa: E402
from quantkit.config import QuantConfig  # noqa: E402
from quantkit.generate import generate  # noqa: E402
from quantkit.models.fast_path import optimize  # noqa: E402


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for arch, config in _small_configs().items():
        torch.manual_seed(0)
        base = build_model(config, "cuda", torch.bfloat16)
        ids = torch.randint(3, config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1)).to("cuda")
        for scheme in ("int8", "fp8"):
            plain = quantize(copy.deepcopy(base), QuantConfig.preset(scheme), progress=False)
            fused = optimize(copy.deepcopy(plain), exact=False)
            separate = optimize(copy.deepcopy(plain), exact=False, qkv=False)
            want, got = separate(ids).logits, fused(ids).logits
            tokens_want = generate(separate, ids, 16, eos_token_id=None)
            tokens_got = generate(fused, ids, 16, eos_token_id=None)
            row = {"arch": arch, "scheme": scheme, "fused_qkv_layers": len(fused.quantkit_fast_path.fused_qkv),
                   "logits_equal": bool(torch.equal(got, want)),
                   "logits_max_abs_diff": (got.float() - want.float()).abs().max().item(),
                   "logits_max_abs": want.float().abs().max().item(),
                   "tokens_equal": bool(torch.equal(tokens_got, tokens_want))}
            row["passed"] = (row["logits_equal"] and row["tokens_equal"]) if scheme == "int8" else bool(
                row["logits_max_abs_diff"] <= 0.05 * row["logits_max_abs"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "qkv_check.json").write_text(json.dumps({"meta": environment_metadata(), "rows": rows}, indent=1))
    print(f"qkv check: {sum(r['passed'] for r in rows)}/{len(rows)} passed", flush=True)


if __name__ == "__main__":
    main()
