"""window/v1: keep only the rows a later step can still read -- bit-identical to canonical/v1.

Sliding layers hold their last `window` rows in a ring of exactly that many rows; global layers keep
everything (they can read every earlier position). A block's new rows wait beside the ring while its
queries attend, then the newest `window` of them are written into the ring and the rest are gone:
between steps a sliding layer's physical storage is exactly `window` rows, whatever the length of
the sequence.

A query at position p on a layer with window W reads positions p-W+1 .. p, so W-1 stored rows would
do; keeping W matches LARQL's accounting (Gemma 3 4B at 4,096 positions: 50,176 rows).
"""

from __future__ import annotations

import torch

from larqlpy.engines.base import LayerGeometry, LayerStore, Provider
from larqlpy.engines.canonical import CanonicalStore
from larqlpy.engines.spec import OptionSpec, int_in
from larqlpy.errors import LarqlError


class RingStore(LayerStore):
    """The newest `keep` rows of a sliding layer, in a ring; reads come back in position order."""

    def __init__(self, geometry: LayerGeometry, device: torch.device, keep: int):
        super().__init__(geometry, device)
        self.keep = keep
        shape = (geometry.n_kv_heads, keep, geometry.head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        self.base = 0  # first retained position; position p lives at slot p % keep
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # this block's rows until release

    def append(self, k, v):
        assert self.pending is None, "append twice without release"
        self.pending = (k.float(), v.float())
        self.end += k.shape[1]

    def _ring_rows(self, lo: int, hi: int, buf: torch.Tensor) -> list[torch.Tensor]:
        """Slices of `buf` holding positions [lo, hi) in order (at most two: the ring may wrap)."""
        if lo >= hi:
            return []
        a, b = lo % self.keep, (hi - 1) % self.keep + 1
        return [buf[:, a:b]] if a < b else [buf[:, a:], buf[:, :b]]

    def read(self, start, dtype):
        stored_end = self.end - (self.pending[0].shape[1] if self.pending else 0)
        if start < self.base:
            raise RuntimeError(f"layer {self.geometry.index}: position {start} was released (base {self.base})")
        ks = self._ring_rows(start, stored_end, self.k)
        vs = self._ring_rows(start, stored_end, self.v)
        if self.pending:
            pk, pv = self.pending
            lo = max(0, start - stored_end)
            ks.append(pk[:, lo:])
            vs.append(pv[:, lo:])
        return torch.cat(ks, dim=1).to(dtype), torch.cat(vs, dim=1).to(dtype)

    def release(self):
        if self.pending is None:
            return
        pk, pv = self.pending
        self.pending = None
        n = min(pk.shape[1], self.keep)  # the block's newest `keep` rows survive, the rest are gone
        a = (self.end - n) % self.keep
        head = min(n, self.keep - a)
        for ring, rows in ((self.k, pk[:, -n:]), (self.v, pv[:, -n:])):
            ring[:, a:a + head] = rows[:, :head]
            ring[:, :n - head] = rows[:, head:]  # wrapped part (empty when it fits)
        self.base = max(0, self.end - self.keep)

    def retained(self):
        return self.base, self.end

    def resident_bytes(self):
        pending = sum(t.untyped_storage().nbytes() for t in self.pending) if self.pending else 0
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes() + pending


class Window(Provider):
    identity = "window/v1"
    summary = "only rows a layer can still read (sliding: its window, global: all); exact"

    @classmethod
    def option_specs(cls):
        return (OptionSpec("window", int_in(1), help="rows kept on sliding layers (>= the model's window)"),)

    def keep(self, geometry: LayerGeometry) -> int:
        return int(self.options.get("window", geometry.window))

    def check_geometry(self, geometries):
        for g in geometries:
            if g.window is not None and self.keep(g) < g.window:
                raise LarqlError(f"window/v1: window={self.keep(g)} is below layer {g.index}'s sliding window "
                                 f"{g.window}; rows attention still reads would be dropped")

    def make_store(self, geometry, device):
        if geometry.window is None:
            return CanonicalStore(geometry, device)
        return RingStore(geometry, device, self.keep(geometry))

    def retained_rows(self, geometry, positions):
        return positions if geometry.window is None else min(positions, self.keep(geometry))
