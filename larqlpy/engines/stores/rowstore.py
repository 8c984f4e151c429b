"""`RowStore`: the layer store whose persistence is a set of named `Rows` (rows.py): saved as cells,
restored, trimmed and forked, its retained range and resident bytes all following from its sets."""

from __future__ import annotations

from dataclasses import dataclass

from larqlpy.engines.stores.base import LayerStore
from larqlpy.engines.stores.kvdtype import from_numpy, to_numpy
from larqlpy.engines.stores.rows import CELL_POSITIONS, Rows


@dataclass(frozen=True)
class RowSet:
    """One named `Rows` of a store, with how its cells are saved."""

    rows: Rows
    state: str  # the cell state it is saved as: ACTIVE (exact rows) or QUANTIZED (codes)
    precision: str
    first_positions: int | None = None  # a set that holds only positions below this (attention sinks)

    def end_at(self, layer_end: int) -> int:
        """Where this set ends when its layer ends at `layer_end`."""
        return layer_end if self.first_positions is None else min(layer_end, self.first_positions)


class RowStore(LayerStore):
    """A store kept in named row sets (`row_sets()`, "main" first): persistence, trimming, the
    retained range and resident bytes all follow from them."""

    def row_sets(self) -> dict[str, RowSet]:
        raise NotImplementedError

    @property
    def main(self) -> Rows:
        return self.row_sets()["main"].rows

    def retained(self):
        return self.main.base, self.main.end

    def resident_bytes(self):
        return sum(s.rows.nbytes() for s in self.row_sets().values())

    def reserve(self, positions):
        for s in self.row_sets().values():
            s.rows.reserve(s.end_at(positions))

    def borrows(self):
        return any(s.rows.offset > 0 for s in self.row_sets().values())

    def _named_sets(self, names: list[str] | None) -> list[tuple[str, RowSet]]:
        """Every row set, or those `names`."""
        return [(name, s) for name, s in self.row_sets().items() if names is None or name in names]

    def export(self, names: list[str] | None = None):
        """The records of every row set, or of those `names`."""
        out = []
        for name, s in self._named_sets(names):
            rows = s.rows
            for lo in range(rows.base - rows.base % CELL_POSITIONS, rows.end, CELL_POSITIONS):
                a, b = max(lo, rows.base), min(lo + CELL_POSITIONS, rows.end)
                if a < b:
                    vals = rows.read(a, b)
                    out.append(({"set": name, "start": a, "n": b - a, "state": s.state, "precision": s.precision},
                                {k: to_numpy(v.contiguous().cpu()) for k, v in vals.items()}))
        return out

    def restore(self, end, records, names: list[str] | None = None):
        """Refill every row set, or only those `names` (the others are already in place)."""
        for name, s in self._named_sets(names):
            rows, set_stop = s.rows, s.end_at(end)
            mine = sorted((r for r in records if r[0]["set"] == name), key=lambda r: r[0]["start"])
            pos = mine[0][0]["start"] if mine else (set_stop if rows.keep is not None else 0)
            base = pos
            for meta, arrays in mine:
                if meta["start"] != pos or meta["state"] != s.state or meta["precision"] != s.precision:
                    raise ValueError(f"layer {self.geometry.index}: cell at {meta['start']} does not fit "
                                     f"({meta['state']} {meta['precision']}, expected {s.state} {s.precision} "
                                     f"at {pos})")
                if set(arrays) != set(rows.fields):
                    raise ValueError(f"layer {self.geometry.index}: cell at {pos} has fields {sorted(arrays)}")
                pos += meta["n"]
            if pos != set_stop or (rows.keep is None and base != 0) or \
                    (rows.keep is not None and set_stop - base > rows.keep):
                raise ValueError(f"layer {self.geometry.index}: saved rows [{base}, {pos}) do not fit end {set_stop}")
            rows.restore(base, set_stop, [(m["start"], {k: from_numpy(a.copy(), rows.fields[k][1])
                                                        for k, a in arr.items()}) for m, arr in mine])
        self.end = end

    forks = True

    def fork(self, other):
        """A copy, row for row, through the records a saved state holds (stores that can share
        rows override this)."""
        self.restore(other.end, other.export())

    def can_trim(self, end):
        """The main rows still hold what a query at `end` reads (a ring back from its slack), and
        every other ring (a recent tier, exact keys) all it retains when its layer ends at `end`."""
        if end > self.end or self.main.oldest() > self.geometry.read_start(end):
            return False
        for name, s in self.row_sets().items():
            stop, rows = s.end_at(end), s.rows
            if stop < rows.offset or (name != "main" and rows.keep is not None and
                                      rows.oldest() > max(0, stop - rows.keep)):
                return False
        return True

    def trim(self, end):
        for s in self.row_sets().values():
            s.rows.trim(s.end_at(end))
        self.end = end

    def keep_rollback(self, n):
        for s in self.row_sets().values():
            s.rows.set_slack(n)
