"""Session 29's one-off diagnostic of sampled decoding, graph against eager (result:
results/sampling_diag_s29_h200.json). ``choose`` on fixed tie-dense logits eager twice and replayed
in a graph; int8 decoding at batch 1 with top-p and temperature only, graph/graph, eager/eager and
graph/eager (index of the first differing token, None when equal); greedy graph against eager.

    PYTHONPATH=. python benchmarks/sampling_diag.py OUT.json
"""
import json, sys, torch
sys.path.insert(0, ".")
import quantkit
from quantkit.generate import Sampling
from benchmarks.sampling_check import gemma3_270m_shaped
res = {}
# (1) choose on fixed tie-dense logits: eager twice, and replayed in a graph
logits = (torch.randn(1, 262144, generator=torch.Generator().manual_seed(3)) * 0.5).bfloat16().float().cuda()
s = Sampling.of(0.8, None, 0.95)
us = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).cuda()
e1 = torch.stack([s.choose(logits, us[i:i+1]) for i in range(64)])
e2 = torch.stack([s.choose(logits, us[i:i+1]) for i in range(64)])
u = us[:1].clone(); out = torch.zeros(1, dtype=torch.long, device="cuda")
st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(st):
    out.copy_(s.choose(logits, u))
torch.cuda.current_stream().wait_stream(st)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out.copy_(s.choose(logits, u))
gr = []
for i in range(64):
    u.copy_(us[i:i+1]); g.replay(); gr.append(out.clone())
gr = torch.stack(gr)
res["choose_eager_eager"] = bool(torch.equal(e1, e2)); res["choose_eager_graph"] = bool(torch.equal(e1, gr))
print(res, flush=True)
model = quantkit.optimize(quantkit.quantize(gemma3_270m_shaped(), quantkit.QuantConfig.preset("int8"), progress=False), exact=True)
ids = torch.randint(3, 262144, (1, 32), generator=torch.Generator().manual_seed(1)).cuda()
for name, kw in (("top_p", dict(temperature=0.8, top_p=0.95)), ("temp", dict(temperature=0.8))):
    runs = {}
    for tag, graph in (("g1", True), ("g2", True), ("e1", False), ("e2", False)):
        runs[tag] = quantkit.generate_tokens(model, ids, 24, eos_token_id=None, do_sample=True, cuda_graph=graph,
                                             generator=torch.Generator("cuda").manual_seed(5), **kw)[0, 32:]
    for a, b in (("g1", "g2"), ("e1", "e2"), ("g1", "e1")):
        d = (runs[a] != runs[b]).nonzero()
        res[f"{name}_{a}_{b}"] = None if d.numel() == 0 else int(d[0])
    print(res, flush=True)
gr = [quantkit.generate_tokens(model, ids, 24, eos_token_id=None, cuda_graph=g)[0, 32:] for g in (True, False)]
res["greedy_g_e"] = bool(torch.equal(*gr))
print(res, flush=True)
json.dump(res, open(sys.argv[1], "w"))
