"""Arrays read straight from a file's pages through mmap: a saved state's data area, and the spill
file PERSISTED cells live in. A location is (offset, length, dtype, shape), from the mapping's base."""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np

Location = tuple[int, int, str, tuple[int, ...]]


class MappedFile:
    def __init__(self, fileobj, base: int = 0):
        self.f, self.base = fileobj, base
        self.map: mmap.mmap | None = None

    def read(self, loc: Location) -> np.ndarray:
        offset, length, dtype, shape = loc
        dt = np.dtype(dtype)
        if self.map is None or self.base + offset + length > len(self.map):  # (re)map once the file has grown
            self.map = mmap.mmap(self.f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(self.map, dtype=dt, count=length // dt.itemsize, offset=self.base + offset).reshape(shape)


class SpillFile(MappedFile):
    """An append-only temporary file (deleted when closed): where cells/v1 writes PERSISTED cells."""

    def __init__(self, directory: str | None = None):
        super().__init__(tempfile.TemporaryFile(prefix="larqlpy-spill-", dir=directory))
        self.size = 0

    def write(self, arrays: dict[str, np.ndarray]) -> dict[str, Location]:
        where = {}
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            self.f.seek(self.size)
            self.f.write(a.tobytes())
            where[name] = (self.size, a.nbytes, a.dtype.str, a.shape)
            self.size += a.nbytes
        self.f.flush()
        return where


def open_mapped(path: str | os.PathLike, base: int = 0) -> MappedFile:
    return MappedFile(open(path, "rb"), base)
