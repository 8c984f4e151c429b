"""Which weight files were already checked finite, so that a load of an unchanged file skips its pass
over every weight (f32: 1.07 GB on the 270M, 0.1-0.2 s of each fresh `run`).

A file is known by its identity -- device, inode, size, modification and change times -- the stat
data git's index trusts to skip rehashing a file. Writing a file (or chmod, or a copy over it)
changes its change time, which no call can set back. A file changed less than RACY_NS before its
check is not recorded: a rewrite within one timestamp tick keeps the identity (git's "racy" entries),
so it is checked again next time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write
from larqlpy.model.files import check_finite

NAME = "finite.json"
RACY_NS = 2_000_000_000


def identity(file: Path) -> list[int]:
    st = os.stat(file)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class FiniteChecks:
    """The record in one cache directory (the packed-weight cache's): file name -> its identity and
    the tensors that passed while it had that identity. A load that read only some of a file's
    tensors (a low-bit load takes its matrices from the packed cache) vouches for those alone."""

    def __init__(self, cache_dir: Path):
        self.path = cache_dir / NAME
        try:
            known = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: every file is checked
            known = {}
        self.known: dict[str, tuple[list, set]] = {}
        for name, entry in (known.items() if isinstance(known, dict) else ()):
            if isinstance(entry, dict) and isinstance(entry.get("id"), list) and isinstance(entry.get("tensors"), list):
                self.known[name] = (entry["id"], set(entry["tensors"]))
        self.seen: dict[Path, list[int]] = {}  # files this load looked at -> their identity now
        self.passed: dict[Path, set[str]] = {}  # tensors this load checked, per file

    def check(self, file: Path, name: str, a: np.ndarray) -> None:
        """`check_finite`, unless this tensor of `file` passed while the file had the identity it has now."""
        if file not in self.seen:
            self.seen[file] = identity(file)
        ident, tensors = self.known.get(file.name, (None, set()))
        if ident == self.seen[file] and name in tensors:
            return
        check_finite(file, name, a)
        self.passed.setdefault(file, set()).add(name)

    def record(self) -> None:
        """After a load whose every tensor passed: remember what it checked. A cache directory that
        cannot be written costs the skip, not the load."""
        now = time.time_ns()
        fresh = {}
        for f, names in self.passed.items():
            ident = self.seen[f]
            if now - max(ident[3], ident[4]) <= RACY_NS:
                continue
            old_ident, old = self.known.get(f.name, (None, set()))
            fresh[f.name] = (ident, names | (old if old_ident == ident else set()))
        if not fresh:
            return
        out = {name: {"id": ident, "tensors": sorted(tensors)} for name, (ident, tensors) in {**self.known, **fresh}.items()}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(self.path) as f:
                f.write(json.dumps(out, sort_keys=True).encode())
        except (OSError, LarqlError):
            pass
