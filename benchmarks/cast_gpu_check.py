"""Session 17 GPU check (not kept): dtype casts and device moves of quantized models on CUDA."""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import quantkit
from quantkit.generate import generate

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = []
for scheme in ("fp8", "int8"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    cpu_model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    q = quantkit.quantize(cpu_model, quantkit.QuantConfig.preset(scheme), progress=False)  # torch backend on CPU
    q.to("cuda")  # a device move keeps the format
    lin = q.model.layers[0].mlp.down_proj
    moved = {"device": str(lin.weight.device), "weight": str(lin.weight.dtype), "scale": str(lin.weight_scale.dtype)}
    gq = quantkit.quantize(LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval(), quantkit.QuantConfig.preset(scheme),
                           progress=False)
    ids = torch.randint(3, 512, (2, 17), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        before = gq(input_ids=ids).logits.float()
        gq.half()
        after_half = gq(input_ids=ids).logits.float()
        gq.to(torch.bfloat16)
        after_bf16 = gq(input_ids=ids).logits.float()
    fast = quantkit.optimize(gq)
    fast.half()
    graph = generate(fast, ids, 8, eos_token_id=None)
    eager = generate(fast, ids, 8, eos_token_id=None, cuda_graph=False)
    row = {"scheme": scheme, "moved_to_cuda": moved,
           "half_rel": ((after_half - before).norm() / before.norm()).item(),
           "bf16_again_equal": bool(torch.equal(after_bf16, before)),
           "fp16_fast_graph_equals_eager": bool(torch.equal(graph, eager)),
           "weight_dtype_after": str(gq.model.layers[0].self_attn.o_proj.weight.dtype)}
    row["ok"] = (moved["device"].startswith("cuda") and row["bf16_again_equal"] and row["half_rel"] < 2e-2
                 and row["fp16_fast_graph_equals_eager"])
    rows.append(row); print(row, flush=True)
print("all ok:", all(r["ok"] for r in rows))
(out / "cast_gpu_check.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
