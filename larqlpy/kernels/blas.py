"""MKL's GEMM in its strict reproducible mode (MKL_CBWR=AUTO,STRICT), so that torch's float32
products give the same bits at any thread count.

By default MKL splits a product's work by the thread count, so a prefill's GEMM (and the few-row
products of a batch step) rounded differently on 1 thread than on 2: a server's greedy answers
parted between thread counts, and within one run whenever `threads.LoadFollower` changed the count
(docs/scale-out.md). Strict CNR mode keeps ?gemm's bits whatever the thread count on AVX2 and
AVX-512 (oneMKL's "Reproducibility Conditions"); AUTO keeps the best code path this CPU has. MKL
reads the setting at its first call, so it is set on import of the kernels, before any product.
"""

from __future__ import annotations

import os

SETTING = "AUTO,STRICT"


def reproducible_gemm(environ=os.environ) -> str | None:
    """Set MKL_CBWR unless the user set it; returns what was set (None: nothing)."""
    if "MKL_CBWR" in environ:
        return None
    environ["MKL_CBWR"] = SETTING
    return SETTING
