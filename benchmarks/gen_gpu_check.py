"""Session 17 GPU check (not kept): generate after the prefill change, on the GPU with CUDA-graph
decode: the e2e fast-path checks (graph vs eager, fast vs plain, vs HF generate), and one-token
prompts against HF's model.generate."""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
from quantkit.bench.e2e import run_fast_path_checks
from quantkit.generate import generate

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = run_fast_path_checks(device="cuda", inexact=False)
one = []
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
m = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
import quantkit
q = quantkit.quantize(m, quantkit.QuantConfig.preset("fp8"), progress=False)
ids = torch.tensor([[1], [7]], device="cuda")
want = q.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
got = generate(q, ids, 8, eos_token_id=None)
eager = generate(q, ids, 8, eos_token_id=None, cuda_graph=False)
res = {"rows_passed": all(r["passed"] for r in rows), "rows": rows,
       "one_token_graph_equals_eager": bool(torch.equal(got, eager)), "one_token_equals_hf": bool(torch.equal(got, want))}
print(json.dumps({k: v for k, v in res.items() if k != "rows"}))
(out / "gen_gpu_check.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **res}, indent=1, default=str))
