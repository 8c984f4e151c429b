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

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.options import OptionSpec, int_in
from larqlpy.engines.provider import Provider
from larqlpy.errors import LarqlError


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
        from larqlpy.engines.stores.exact import ExactStore  # torch: loaded when rows are first stored

        return ExactStore(geometry, device, None if geometry.window is None else self.keep(geometry))

    def retained_rows(self, geometry, positions):
        return positions if geometry.window is None else min(positions, self.keep(geometry))
