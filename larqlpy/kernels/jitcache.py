"""Keeping numba's on-disk kernel cache true to the code it was compiled from.

numba keys a cached kernel on its own source file and bytecode, not on the jitted code it calls from
other modules: after an edit to the intrinsics in simd.py, qdot.py's kernels would still load
compiled from the old ones (and the integer paths could disagree). `tie` stamps those modules'
sources beside the cache and, when the stamp differs, empties the cache of the module's kernels
before any is used, so they compile afresh once and are cached again.

`FASTMATH` is numba's fastmath less `contract` and `nsz`. A process that compiles a parallel kernel
runs its prange body as optimized on its own; the copy numba writes to the cache has been optimized
a second time inside the kernel's module, and with either flag LLVM rounds the two copies
differently (FMA fusion, a reduction's order). A kernel loaded from the cache then gave other bits
than the same kernel just compiled, and a state resumed in a new process did not continue
bit-identically. tests/test_jit_cache.py holds them to the same bits.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType

from numba.core.registry import CPUDispatcher

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_path

FASTMATH = {"nnan", "ninf", "arcp", "reassoc", "afn"}  # a set, as numba takes it; never mutated


def tie(namespace: dict, *depends_on: ModuleType) -> None:
    """Drop the cached kernels defined in `namespace` (a module's globals(), and the dicts of kernels
    it holds) if any module they call into (`depends_on`) has changed since they were cached."""
    name = namespace["__name__"]
    values = [*namespace.values(), *(x for v in namespace.values() if isinstance(v, dict) for x in v.values())]
    kernels = [v for v in values if isinstance(v, CPUDispatcher) and v.py_func.__module__ == name
               and getattr(v, "_cache", None) is not None and hasattr(v._cache, "flush")]
    if not kernels:
        return
    digest = hashlib.sha256()
    for mod in depends_on:
        digest.update(Path(mod.__file__).read_bytes())
    stamp = digest.hexdigest()
    mark = Path(kernels[0]._cache.cache_path) / f"{name.rsplit('.', 1)[-1]}.depends-on"
    try:
        if mark.read_text() == stamp:
            return
    except OSError:
        pass
    for k in kernels:
        k._cache.flush()
    try:
        with atomic_path(mark) as tmp:
            tmp.write_text(stamp)
    except (OSError, LarqlError):  # a read-only cache: numba falls back to compiling, and so do we
        pass
