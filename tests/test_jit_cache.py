"""A kernel loaded from numba's on-disk cache gives the bits it gave when just compiled: a state
resumed in another process (which loads what this one cached) continues bit-identically only then."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORK = r"""
import hashlib, json
import numpy as np, torch
from larqlpy.kernels.kvcodec import tq_attend, tq_step, turboquant as tq
from larqlpy.kernels.weights import qdot
from larqlpy.kernels.attention.decode import attend_one
from larqlpy.kernels.weights.matvec import gemv_f32
from larqlpy.kernels.weights.qweight import PackedWeight
rng = np.random.default_rng(0)
hashes = {}
for n, d, g, bits in [(40, 32, 2, 2), (300, 64, 4, 4)]:
    c, _ = tq.codebook(bits)
    norms = rng.random((2, n + 5), dtype=np.float32)
    codes = rng.integers(0, 256, (2, n + 5, d * bits // 8), dtype=np.uint8)
    a, b = (norms, codes, 5, n // 3), (norms, codes, 5 + n // 3, n - n // 3)  # two pieces, as a branch reads
    tier = (norms, codes, 0, 6)
    q = rng.standard_normal((2, g, d), dtype=np.float32)
    cal = (rng.random((2, d), dtype=np.float32) + 0.5, rng.standard_normal((2, d), dtype=np.float32),
           rng.standard_normal((2, d), dtype=np.float32), rng.standard_normal((n + 6, d), dtype=np.float32))
    sink = rng.standard_normal((2, 1, d), dtype=np.float32)
    out = np.empty((2, g, d), np.float32)
    tq_attend.attend(q, cal, tq.signs(d), (a, b, c, bits, a, b, c, bits),
                     (tier, (norms, codes, 0, 0), c, bits, tier, (norms, codes, 0, 0), c, bits),
                     (np.zeros((2, 0, d), np.float32), sink, sink), (n, n, n + 6), np.float32(0.125),
                     np.float32(30.0), np.zeros(0, np.float32), out)
    hashes[f"tq_attend {n}x{d} {bits}"] = hashlib.sha256(out.tobytes()).hexdigest()
    rows = [np.zeros((4, 1) + shape, t) for _ in "kv" for shape, t in (((), np.float32), ((d * bits // 8,), np.uint8))]
    k, v = rng.standard_normal((2, 2, 2, d), dtype=np.float32)  # two branches' step rows, written as codes
    bounds = tq.codebook(bits)[1]
    tq_step.append_step(k, v, (cal[1], cal[0], cal[2], cal[3][:1]), tq.signs(d), ((bounds, bits, bounds, bits, *rows),),
                        (0,))
    hashes[f"tq_step {d} {bits}"] = hashlib.sha256(b"".join(r.tobytes() for r in rows)).hexdigest()
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    q, k, v = torch.randn(4, 1, 64), torch.randn(2, 333, 64).to(dtype), torch.randn(2, 333, 64).to(dtype)
    o = attend_one(q, k, v, 0.125, 30.0)
    hashes[f"attend {dtype}"] = hashlib.sha256(o.numpy().tobytes()).hexdigest()
g = gemv_f32(torch.randn(1, 576), torch.randn(1536, 576), "numba")
hashes["gemv"] = hashlib.sha256(g.numpy().tobytes()).hexdigest()
w = torch.randn(320, 512)
for fmt in ("int4", "int8"):
    packed = PackedWeight.quantize(w, fmt)
    for rows in (1, 3):
        for path in ("float", packed.path):
            y = packed.matmul(torch.randn(rows, 512), path)
            hashes[f"{fmt} {rows} {path}"] = hashlib.sha256(y.numpy().tobytes()).hexdigest()
    codes, scale, minimum, outer = packed.arrays  # scales as float16 bits, as a GGUF's blocks hold them
    halves = scale.astype(np.float16).view(np.uint16)
    for path in ("float", packed.path):
        y = np.empty((2, codes.shape[0] * 64), np.float32)
        qdot.gemm(codes, halves, minimum, outer, packed.zero, packed.bits, np.ones((2, 512), np.float32), path, y)
        hashes[f"{fmt} float16 scales {path}"] = hashlib.sha256(y.tobytes()).hexdigest()
hashes["hits"] = sum(tq_attend.attend.stats.cache_hits.values())
print(json.dumps(hashes))
"""


@pytest.mark.heavy  # ~90 s compiling into a fresh cache: the suite's 30-minute budget
def test_a_kernel_from_the_cache_gives_the_bits_it_gave_when_compiled(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = [subprocess.run([sys.executable, "-c", WORK], env=env, capture_output=True, text=True, check=True,
                           timeout=600) for _ in range(2)]
    runs = [json.loads(d.stdout) for d in done]
    assert runs[0].pop("hits") == 0 and runs[1].pop("hits") > 0  # compiled, then loaded
    assert runs[0] == runs[1]
    assert "Warning" not in done[0].stderr  # numba's IR inliner once warned while compiling float16 scales
