"""cells/v1's manager: what one sequence's layers share (the rules and their counters, the budget,
the spill file, the scratch). After every block it holds the budget; before a speculative block it
says how far rows can go with no decision of its own (`quiet_rows`)."""

from __future__ import annotations

import torch

from larqlpy.engines.lifecycle import Rules, State
from larqlpy.engines.stores.mapped import SpillFile
from larqlpy.engines.stores.state import Scratch, Shared
from larqlpy.kernels.kvcodec.rowcodec import TurboQuantCodec


class CellManager(Shared):
    """What one sequence's layers share: rules and their counters, the budget, the spill file, the
    scratch. After every block it holds the budget."""

    def __init__(self, rules: Rules, budget: int | None, device: torch.device, spill_dir: str | None = None):
        self.rules, self.budget, self.device = rules, budget, device
        self.own_budget = budget  # the engine's own setting, returned to after outside pressure
        self.cell_size = rules.cell_size
        self.scratch = Scratch(device)
        self.spill = SpillFile(spill_dir)
        self.stores: list = []  # its CellStores (cells.py), one per layer
        self._codecs: dict[tuple[int, int], TurboQuantCodec] = {}

    def codec(self, d: int, bits: int) -> TurboQuantCodec:
        if (d, bits) not in self._codecs:
            self._codecs[(d, bits)] = TurboQuantCodec(d, bits, self.device)
        return self._codecs[(d, bits)]

    def resident(self) -> int:
        return sum(s.resident_bytes() for s in self.stores)

    def end_block(self) -> None:
        self.enforce()
        self.scratch.end_block()

    def enforce(self) -> None:
        if self.budget is None:
            return
        excess = self.resident() - self.budget
        if excess <= 0:
            return
        candidates = sorted(((c.start, s.geometry.index, s, c) for s, c in self._candidates(self.stores[0].end)),
                            key=lambda x: (x[0], x[1]))
        while excess > 0 and candidates:
            progressed = False
            for item in list(candidates):
                _, _, store, cell = item
                before = cell.resident_bytes()
                if not store.demote(cell):
                    candidates.remove(item)
                    continue
                excess -= before - cell.resident_bytes()
                progressed = True
                if cell.state not in (State.ACTIVE, State.QUANTIZED):
                    candidates.remove(item)
                if excess <= 0:
                    break
            if not progressed:
                break

    def shrink(self, target: int) -> bool:
        """Enforce `target` as the budget now (cold cells QUANTIZED, then PERSISTED, as the rules allow)."""
        before = self.resident()
        self.budget = target if self.own_budget is None else min(self.own_budget, target)
        self.enforce()
        return self.resident() < before

    def unshrink(self) -> None:
        self.budget = self.own_budget

    def _candidates(self, end: int, newest: bool = False):
        """(store, cell) the budget may demote at `end`: below the recent positions kept ACTIVE, never
        the newest cell (`newest`: the newest is a cell a later row opens, so every cell counts)."""
        protect_from = max(0, end - max(self.rules.policy.keep_active_recent, 1))
        for s in self.stores:
            for c in s.cells[s.first_live:] if newest else s.cells[s.first_live:-1]:
                if c.state in (State.ACTIVE, State.QUANTIZED) and c.end <= protect_from and s.demotable(c):
                    yield s, c

    def quiet_rows(self, n: int, end: int) -> int:
        """Rows appended from `end` on (at most n) before one would make a decision at its end: the
        budget's demotion (resident past it, with the cells the rows open, and a cell to demote) or
        a window's eviction (a windowed layer's oldest live cell falling below it)."""
        c, opened = self.cell_size, 0
        for m in range(1, n + 1):
            e = end + m  # the end after the m-th row, at position e - 1
            opened += (e - 1) % c == 0
            if any(s.geometry.window is not None and s.first_live < len(s.cells)
                   and s.cells[s.first_live].start + c <= e - s.geometry.window for s in self.stores):
                return m - 1
            if self.budget is not None and self.resident() + opened * self.cell_bytes() > self.budget \
                    and next(self._candidates(e, newest=opened > 0), None) is not None:
                return m - 1
        return n

    def cell_bytes(self) -> int:
        """What a new ACTIVE cell holds in every layer (its rows are allocated when it opens)."""
        return sum(2 * s.geometry.n_kv_heads * self.cell_size * s.geometry.head_dim * s.dtype.itemsize
                   for s in self.stores)

    def nbytes(self) -> int:  # the scratch, reported beside the cells
        return self.scratch.nbytes()

    def report(self) -> dict:
        cells: dict[str, int] = {}
        for s in self.stores:
            for k, v in s.cell_counts().items():
                cells[k] = cells.get(k, 0) + v
        return {"transitions": self.rules.counted(), "cells": cells, "budget": self.budget,
                "spilled_bytes": self.spill.size}
