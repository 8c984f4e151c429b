"""What is known about a model's weight files while they stay unchanged: which tensors were checked
finite (so a load skips its pass over every weight, a visible part of each fresh f32 `run`) and the
digest of the whole file (what the packed-weight cache was built from).

A file is known by its identity -- device, inode, size, modification and change times -- the stat
data git's index trusts to skip rehashing a file. Writing a file (or chmod, or a copy over it)
changes its change time, which no call can set back. A file changed less than RACY_NS before it was
read is not recorded: a rewrite within one timestamp tick keeps the identity (git's "racy" entries),
so it is read again next time.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

import numpy as np
import xxhash

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write
from larqlpy.weights.checkpoint import check_finite

NAME = "known-files.json"
OLD_NAMES = ("finite.json",)  # the record's earlier name (finite checks only): removed when it is rewritten
RACY_NS = 2_000_000_000


def identity(file: Path) -> list[int]:
    st = os.stat(file)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_digest(file: Path) -> str:
    """xxh3-128 of every byte of `file` (at memory speed over pages in memory; a file not read yet
    costs its page faults too)."""
    with open(file, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return xxhash.xxh3_128_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return xxhash.xxh3_128_hexdigest(m)


class KnownFiles:
    """The record in one cache directory (the packed-weight cache's): file name -> its identity, the
    tensors that passed the finite check and the file's digest while it had that identity. A load
    that read only some of a file's tensors (a low-bit load takes its matrices from the packed cache)
    vouches for those alone."""

    def __init__(self, cache_dir: Path):
        self.path = cache_dir / NAME
        try:
            known = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: every file is read again
            known = {}
        self.known: dict[str, tuple[list, set, str | None]] = {}
        for name, entry in (known.items() if isinstance(known, dict) else ()):
            if isinstance(entry, dict) and isinstance(entry.get("id"), list) and isinstance(entry.get("tensors"), list):
                digest = entry.get("xxh3_128")
                self.known[name] = (entry["id"], set(entry["tensors"]), digest if isinstance(digest, str) else None)
        self.seen: dict[Path, list[int]] = {}  # files this load looked at -> their identity now
        self.passed: dict[Path, set[str]] = {}  # tensors this load checked, per file
        self.digests: dict[Path, str] = {}  # digests this load computed

    def _known(self, file: Path) -> tuple[set, str | None]:
        """What the record holds for `file` as it is now: (tensors checked finite, digest)."""
        if file not in self.seen:
            self.seen[file] = identity(file)
        ident, tensors, digest = self.known.get(file.name, (None, set(), None))
        return (tensors, digest) if ident == self.seen[file] else (set(), None)

    def check(self, file: Path, name: str, a: np.ndarray) -> None:
        """`check_finite`, unless this tensor of `file` passed while the file had the identity it has now."""
        if name in self._known(file)[0]:
            return
        check_finite(file, name, a)
        self.passed.setdefault(file, set()).add(name)

    def digest(self, file: Path) -> str:
        """The digest of `file` (file_digest), from the record while the file keeps the identity it
        had when it was hashed."""
        known = self._known(file)[1]
        if known is not None:
            return known
        if file not in self.digests:
            self.digests[file] = file_digest(file)
        return self.digests[file]

    def record(self) -> None:
        """After a load whose every tensor passed: remember what it checked and hashed. A cache
        directory that cannot be written costs the skip, not the load."""
        now = time.time_ns()
        fresh = {}
        for f in set(self.passed) | set(self.digests):
            ident = self.seen[f]
            if now - max(ident[3], ident[4]) <= RACY_NS:
                continue
            old_tensors, old_digest = self._known(f)
            fresh[f.name] = (ident, self.passed.get(f, set()) | old_tensors, self.digests.get(f, old_digest))
        if not fresh:
            return
        out = {}
        for name, (ident, tensors, digest) in {**self.known, **fresh}.items():
            out[name] = {"id": ident, "tensors": sorted(tensors), **({"xxh3_128": digest} if digest else {})}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(self.path) as f:
                f.write(json.dumps(out, sort_keys=True).encode())
            for old in OLD_NAMES:
                (self.path.parent / old).unlink(missing_ok=True)
        except (OSError, LarqlError):
            pass
