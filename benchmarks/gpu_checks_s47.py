"""GPU check of session 47: a saved checkpoint loaded onto the second GPU, through the public API.

    PYTHONPATH=. python benchmarks/gpu_checks_s47.py --out DIR      # needs 2 CUDA GPUs

What a user of two GPUs does, with GPU 0 current throughout: ``quantkit.quantize`` (FP8, dynamic per
token) on GPU 0, ``quantkit.save``, then ``quantkit.load(path, device=...)`` onto cuda:0 and onto
cuda:1, ``quantkit.optimize(exact=False)`` (fused q/k/v and gate/up, RMSNorm fused into the next
quantization, one-launch RoPE, quantkit attention, grouped experts), and on each copy: the prompt's
logits eager, the same through ``quantkit.graphed``, and ``quantkit.generate_tokens``' greedy tokens
(CUDA-graph decode). Three small seeded models: the Llama and Gemma-3 of the e2e fast-path checks and
a Qwen3-MoE. The cuda:1 copy must equal the cuda:0 copy bit for bit, and GPU 0 stay current.
Writes gpu_checks_s47.json under --out.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402


def models() -> dict:
    from quantkit.bench import e2e

    configs = e2e._small_configs()
    configs["qwen3_moe"] = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_experts=16,
        num_experts_per_tok=4, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return configs


def run_copy(path: Path, device: str, ids: torch.Tensor, new_tokens: int) -> dict:
    import quantkit

    model = quantkit.optimize(quantkit.load(path, device=device, progress=False), exact=False)
    ids = ids.to(device)
    with torch.no_grad():
        logits = model(ids).logits
        graph_logits = quantkit.graphed(model)(ids).logits
    tokens = quantkit.generate_tokens(model, ids, new_tokens, eos_token_id=None)
    torch.cuda.synchronize(device)
    return {"logits": logits.to("cuda:0"), "graph_logits": graph_logits.to("cuda:0"), "tokens": tokens.to("cuda:0"),
            "report": getattr(model, "quantkit_fast_path", None)}


def check(name: str, config, new_tokens: int) -> dict:
    import quantkit
    from quantkit.bench import e2e

    base, ids = e2e.check_model(config, "cuda:0", torch.bfloat16, 40)
    model = quantkit.quantize(base, quantkit.QuantConfig.preset("fp8"), progress=False)
    row = {"model": name}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        quantkit.save(model, path)
        del model, base
        out = {device: run_copy(path, device, ids, new_tokens) for device in ("cuda:0", "cuda:1")}
    a, b = out["cuda:0"], out["cuda:1"]
    row.update(
        logits_equal=bool(torch.equal(a["logits"], b["logits"])),
        max_abs_logit_diff=float((a["logits"].float() - b["logits"].float()).abs().max()),
        graph_logits_equal=bool(torch.equal(a["graph_logits"], b["graph_logits"])),
        graph_equals_eager=bool(torch.equal(b["graph_logits"], b["logits"])),
        tokens_equal=bool(torch.equal(a["tokens"], b["tokens"])),
        finite=bool(b["logits"].isfinite().all()),
        current_device_after=torch.cuda.current_device(),
        fast_path=str(b["report"])[:400],
    )
    row["passed"] = all(row[key] for key in ("logits_equal", "graph_logits_equal", "tokens_equal", "finite")) \
        and row["current_device_after"] == 0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from quantkit.bench.common import environment_metadata

    if torch.cuda.device_count() < 2:
        raise SystemExit(f"this check needs 2 CUDA GPUs; {torch.cuda.device_count()} found")
    rows = []
    for name, config in models().items():
        try:
            row = check(name, config, args.new_tokens)
        except Exception as err:  # record it and go on to the next model
            row = {"model": name, "passed": False, "error": f"{type(err).__name__}: {str(err)[:400]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    failed = [row["model"] for row in rows if not row["passed"]]
    (args.out / "gpu_checks_s47.json").write_text(json.dumps({"meta": environment_metadata(), "rows": rows,
                                                              "failed_checks": failed}, indent=1))
    if failed:
        raise SystemExit(f"checks failed: {failed}")


if __name__ == "__main__":
    main()
