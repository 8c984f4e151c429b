"""How far ahead of a matrix's codes the integer kernels prefetch: measured once per machine and kept.

A decode step reads every weight once, from memory, and the kernels stream each 64-output tile's
codes (or bf16 rows) in order. CPUs differ in how well their own prefetchers keep up: on some an
explicit prefetch a few KB ahead brings a stream to the machine's bandwidth, on others the same
prefetch costs time (docs/weights.md has both). No feature flag tells them apart, so `choose` times the
model's own matrices, one row each, with each distance in turn (kernels/weights/choice.py), once per
machine and size class: weights that may sit in a cache are measured apart from weights that
cannot, and weights small enough to sit in any cache are not prefetched. Prefetching changes no
number.
"""

from __future__ import annotations

from typing import Sequence

import torch

from larqlpy.kernels.weights import choice
from larqlpy.kernels.weights.qweight import PackedWeight

AHEADS = (0, 4096, 8192)  # bytes past a group's codes
MEASURED_BYTES = 32 << 20  # below this the weights sit in a cache: no prefetch, nothing measured
STREAMED_BYTES = 256 << 20  # weights of at least this size are measured as streamed from memory


def choose(weights: Sequence) -> dict[str, int]:
    """Measure (or recall) the best distance on this machine for these matrices and give it to each
    of them: integer codes and bf16 and f16 rows (`dequant.gemv_16`) apart. Returns {"codes" | "bf16 rows" | "f16
    rows": it}.
    Matrices off the CPU, of another kind, or on the float path with float codes keep theirs."""
    ws = [w for w in weights if isinstance(w, PackedWeight) and w.arrays]
    kinds = {"codes": [w for w in ws if w.path != "float"], "bf16 rows": [w for w in ws if w.kind == "bf16"],
             "f16 rows": [w for w in ws if w.kind == "f16"]}
    return {kind: _measure(kind, group) for kind, group in kinds.items() if group}


def _measure(kind: str, ws: list[PackedWeight]) -> int:
    total = sum(w.nbytes for w in ws)
    if total < MEASURED_BYTES:
        for w in ws:
            w.ahead = 0
        return 0
    inputs = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(0)) for k in {w.shape[1] for w in ws}}

    def stream(ahead: int):
        def run():
            for w in ws:
                w.ahead = ahead
                w.matmul(inputs[w.shape[1]])
        return run

    size = "streamed" if total >= STREAMED_BYTES else "cached"
    best = int(choice.choose(f"{kind} prefetched ahead, {size} weights", {str(a): stream(a) for a in AHEADS},
                             runs=3))
    for w in ws:
        w.ahead = best
    return best
