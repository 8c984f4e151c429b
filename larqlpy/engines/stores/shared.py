"""A layer that attends over an earlier layer's K/V rows (Gemma 4's shared K/V, `LayerGeometry.reads`):
its store holds no rows. Every engine's state gets these the same way (`with_readers`, from
`Provider.new_state`): the provider builds stores for the layers that keep rows only, so no engine
stores a shared layer's rows twice and no budget or residency counts them twice.

Order within a block: the source layer appends the block's rows and attends; its `done` leaves the
release (a ring folding the block in, cells below the window evicted) to the last layer reading it,
so every reader's queries still find the rows the source's own queries read, exactly those. A
reader keeps its own position, so a block of speculative steps attends each step over the rows up
to its own position."""

from __future__ import annotations

from typing import Sequence

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.base import AttentionParams, LayerStore
from larqlpy.engines.stores.state import EngineState


class ReadsEarlier(LayerStore):
    """A layer's view of an earlier layer's store (`source`): it appends nothing and holds nothing;
    its queries read the source's rows. `last`: the source's last reader, which releases it."""

    def __init__(self, geometry: LayerGeometry, source: LayerStore, last: bool):
        super().__init__(geometry, source.device)
        self.source, self.last = source, last

    def append(self, k, v):
        raise RuntimeError(f"layer {self.geometry.index} reads layer {self.geometry.reads}'s rows; it stores none")

    def read(self, start, dtype):
        return self.source.read(start, dtype)

    def retained(self):
        return self.end, self.end  # none of its own: its rows are counted at the source

    def resident_bytes(self):
        return 0

    def decode_rows(self, k, v):
        return None  # through attend: it reads the source's rows as they stand

    def attend(self, q, k, v, p: AttentionParams):
        q_start = self.end
        self.end += q.shape[1]
        out = self.source.attend_read(q, q_start, p)
        if self.last and self.end == self.source.end:  # the source's block read by every layer: let it go
            self.source.release()
        return out

    def export(self):
        return []

    def restore(self, end, records):
        if records:
            raise ValueError(f"layer {self.geometry.index} reads layer {self.geometry.reads}'s rows: none saved")
        self.end = end

    def can_trim(self, end):
        return end <= self.end

    def trim(self, end):
        self.end = end

    forks = True

    def fork(self, other):
        self.end = other.end


def with_readers(state: EngineState, geometries: Sequence[LayerGeometry]) -> EngineState:
    """`state`, built for the layers that keep rows, with a `ReadsEarlier` at each layer that reads
    an earlier one's: the full stack of layers, in order."""
    if all(g.reads is None for g in geometries):
        return state
    own, layers = iter(state.layers), []
    last = {g.reads: g.index for g in geometries if g.reads is not None}
    for g in geometries:
        if g.reads is None:
            layers.append(next(own))
            continue
        source = layers[g.reads]
        source.readers += 1
        layers.append(ReadsEarlier(g, source, last[g.reads] == g.index))
    state.layers = layers
    return state
