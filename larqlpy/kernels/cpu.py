"""What this CPU can run, read from LLVM's view of the host (the features numba compiles for), and the
kernel path each packed matrix takes. Chosen by instruction set, never by CPU model name."""

from __future__ import annotations

import os
from functools import lru_cache

from llvmlite import binding

# path -> the features it needs (qdot.py): integer dot products with int8 activations, or float
NEEDS = {"vnni512": ("avx512f", "avx512bw", "avx512vnni"), "avx2": ("avx2",), "avx2-signed": ("avx2",), "float": ()}


@lru_cache(maxsize=1)
def features() -> frozenset[str]:
    """The host's features; LARQLPY_ISA=avx2 hides the AVX-512, VNNI and AMX ones, so a bench on a
    newer CPU can measure the paths an AVX2-only CPU takes (its choices, not its speed)."""
    have = frozenset(name for name, on in binding.get_host_cpu_features().items() if on)
    if os.environ.get("LARQLPY_ISA") == "avx2":
        have = frozenset(f for f in have if not f.startswith(("avx512", "amx", "avxvnni")))
    return have


def runnable(path: str) -> bool:
    return all(f in features() for f in NEEDS[path])


def runnable_paths() -> tuple[str, ...]:
    return tuple(p for p in NEEDS if runnable(p))


def int_path(bits: int, lowest: int, highest: int) -> str:
    """The fastest path for codes of `bits` in [lowest, highest] on this CPU. AVX2's byte products
    saturate on codes above 127 unless they are shifted to signed bytes, which needs no code 0."""
    if runnable("vnni512"):
        return "vnni512"
    if runnable("avx2"):
        if bits != 8 or highest <= 127:
            return "avx2"
        if lowest >= 1:
            return "avx2-signed"
    return "float"


@lru_cache(maxsize=1)
def describe() -> str:
    """The features that choose kernels here, for benches and `info` (and every measured choice's
    key, asked per product: LLVM's host name is an FFI call)."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vnni", "avx512bf16", "avxvnni", "amx-bf16",
              "amx-int8", "amx-tile")
    have = [f for f in wanted if f in features()]
    return f"{binding.get_host_cpu_name()}: {' '.join(have) or 'none of ' + ', '.join(wanted)}"
