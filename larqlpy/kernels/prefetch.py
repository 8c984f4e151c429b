"""How far ahead of a matrix's codes the integer kernels prefetch: measured once per machine and kept.

A decode step reads every weight once, from memory, and the kernels stream each 64-output tile's
codes in order. CPUs differ in how well their own prefetchers keep up: on a Sapphire Rapids-class
Xeon (2 threads) the 1.5B's matrices streamed at 22 GB/s on their own and at 31 GB/s (the machine's
plain-reduction bandwidth) with a software prefetch 4-8 KB ahead, while on a Zen 4 EPYC the same
prefetch cost 5-10% (docs/weights.md). No feature flag tells them apart, so `choose` times the
model's own matrices, one row each, with each distance in turn (kernels/choice.py), once per
machine and size class: weights that may sit in a cache are measured apart from weights that
cannot. Prefetching changes no number.
"""

from __future__ import annotations

from typing import Sequence

import torch

from larqlpy.kernels import choice
from larqlpy.kernels.qweight import PackedWeight

AHEADS = (0, 4096, 8192)  # bytes past a group's codes
STREAMED_BYTES = 256 << 20  # weights of at least this size are measured as streamed from memory


def choose(weights: Sequence[PackedWeight]) -> int:
    """Measure (or recall) the best distance for these matrices on this machine and give it to each
    of them; returns it. Matrices off the CPU, on the float path or of another kind keep theirs."""
    ws = [w for w in weights if isinstance(w, PackedWeight) and w.arrays and w.path != "float"]
    if not ws:
        return 0
    inputs = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(0)) for k in {w.shape[1] for w in ws}}

    def stream(ahead: int):
        def run():
            for w in ws:
                w.ahead = ahead
                w.matmul(inputs[w.shape[1]])
        return run

    size = "streamed" if sum(w.nbytes for w in ws) >= STREAMED_BYTES else "cached"
    best = int(choice.choose(f"codes prefetched ahead, {size} weights", {str(a): stream(a) for a in AHEADS}, runs=3))
    for w in ws:
        w.ahead = best
    return best
