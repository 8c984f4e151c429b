"""What the turning mean costs a decode step: codec/v1 bits=4 on the model's own calibration (some
heads' means turning with RoPE) against the same calibration with every turning part dropped (a
timing control, not a calibration anyone should use), both prefilled to N positions of long.txt,
16 decode steps each, alternating, 6 repeats. Prints ms per token for each repeat.

    python bench/turning_cost.py models/smollm2-135m-instruct 4096
"""
import sys
import time

import torch

from larqlpy.weights.loader import load
from larqlpy.engines import parse_engine_spec, new_state
from larqlpy.engines.stores.calibration import KeyCalibration
from larqlpy.model.decoder import prefill
from larqlpy.tools.ladder import ladder_ids
loaded = load(sys.argv[1], device="cpu")
m = loaded.model
ids = ladder_ids(loaded.tokenizer, int(sys.argv[2]))
turning = m.key_calibration
fixed = [KeyCalibration.of(c.mean, c.scale) for c in turning]
spec = parse_engine_spec(None, "codec/v1", ["bits=4"])
states = {}
for name, cals in (("turning", turning), ("fixed", fixed)):
    m.key_calibration = cals
    st = new_state(spec, m.geometries(), m.device)
    with torch.inference_mode():
        prefill(m, st, ids, 1024)
    states[name] = st
res = {"turning": [], "fixed": []}
with torch.inference_mode():
    for rep in range(6):
        for name in ("turning", "fixed"):
            st, t0 = states[name], time.perf_counter()
            for i in range(16):
                m(torch.tensor([ids[i]]), st)
            res[name].append((time.perf_counter() - t0) / 16)
print({k: [round(x * 1000, 1) for x in v] for k, v in res.items()}, "ms/token")
