"""Session 17 GPU check (not kept): INT8 activations saturate to [-128, 127] on the GPU as in the
reference (static per-tensor, dynamic per-token); weights stay in [-127, 127]."""
import json, sys
from pathlib import Path
from kernels_only import ROOT  # noqa
import torch
from quantkit.kernels import quant, reference

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": []}
g = torch.Generator(device="cuda").manual_seed(0)
ok_all = True
for M, K in ((1, 16), (13, 272), (257, 4096), (1024, 14336)):
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(M, K, device="cuda", generator=g) * 3).to(dt)
        for qdt in (torch.int8, torch.float8_e4m3fn):
            scale = torch.tensor([0.01], device="cuda")  # far past the range: saturation both ways
            q = quant.quantize_per_tensor(x, scale, qdt)
            r = reference.quantize_per_tensor(x, scale, qdt)
            same = torch.equal(q.view(torch.int8), r.view(torch.int8))
            floor = q.view(torch.int8).min().item() if qdt == torch.int8 else None
            qt, st = quant.quantize_per_token(x, qdt)
            rt, rs = reference.quantize_per_token(x, qdt)
            same_t = torch.equal(qt.view(torch.int8), rt.view(torch.int8)) and torch.equal(st, rs)
            ok = same and same_t and (floor is None or floor == -128)
            ok_all &= ok
            results["checks"].append({"M": M, "K": K, "x": str(dt), "q": str(qdt), "per_tensor_equal": same,
                                      "int8_min": floor, "per_token_equal": same_t, "ok": ok})
            print(M, K, dt, qdt, same, floor, same_t, flush=True)
w = torch.randn(512, 4096, device="cuda", generator=g)
wq, _ = reference.quantize_per_channel(w, torch.int8)
results["weight_int8_min"] = wq.min().item()
ok_all &= wq.min().item() == -127
results["all_ok"] = ok_all
(out / "int8_floor_check.json").write_text(json.dumps(results, indent=1))
print("all ok:", ok_all)
