"""Which layers the accurate recipes keep in 16 bits on the bundled model: the old rule (the N most
sensitive layers) against session 28's (each with the layers that read its input).

Replays quantize()'s path up to the choice (SmoothQuant, then the sensitivity ranking on the same
calibration blocks as the calibration sweep) without GPTQ or evaluation. CPU, fp32; about 5-20 min a
recipe on 2 cores. Prints one JSON line per (scheme, calibration shape); writes them to argv[1].

    python benchmarks/kept_replay.py benchmarks/results/kept_s28.json
"""
import copy
import json
import sys
import time

import quantkit
from quantkit.calibration.sensitivity import most_sensitive, rank_layers, shared_input_groups
from quantkit.calibration.smoothquant import smooth_model
from quantkit.convert import target_linears

model, tok = quantkit.load_model("gemma3-270m")
out = {}
# Ranking cut as quantize() cuts it (api._quantize_eval); groups from the same blocks.
for blocks_shape in [(64, 512), (16, 2048)]:
    data = quantkit.prepare_calibration_data(tok, "wikipedia-excerpt", *blocks_shape)
    for scheme in ["int8", "fp8", "int8-static", "fp8-static"]:
        t = time.time()
        config = quantkit.QuantConfig.preset(scheme, recipe="accurate")
        m = copy.deepcopy(model).eval()
        if config.smoothquant_alpha is not None:
            smooth_model(m, data, alpha=config.smoothquant_alpha, exclude=config.ignore, progress=False,
                         quant_dtype=config.torch_dtype, static_activations=config.is_static)
        ranking = rank_layers(m, data, config, progress=False, max_seq_len=128)
        groups = shared_input_groups(m, data, target_linears(m, config))
        old = most_sensitive(ranking, config.keep_sensitive)
        new = most_sensitive(ranking, config.keep_sensitive, groups)
        key = f"{scheme} {blocks_shape}"
        out[key] = {"old": old, "new": new, "same": sorted(old) == sorted(new), "s": time.time() - t}
        print(key, json.dumps(out[key]), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
