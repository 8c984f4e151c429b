"""cells/v1's layer store (see engines/cells.py): cells of positions, each in a lifecycle state, under
one manager per sequence that holds the budget."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import torch

from larqlpy.engines.geometry import KV_DTYPES, LayerGeometry
from larqlpy.engines.lifecycle import Event, State
from larqlpy.engines.stores.base import LayerStore
from larqlpy.engines.stores.calibration import require_calibration
from larqlpy.engines.stores.cell_manager import CellManager
from larqlpy.engines.stores.kvcodec import KVCodec, precision_widths
from larqlpy.engines.stores.kvdtype import from_numpy, readonly_tensor, to_numpy, torch_dtype
from larqlpy.engines.stores.mapped import MappedFile
from larqlpy.engines.stores.state import EngineState


class Cell:
    __slots__ = ("start", "n", "state", "precision", "data", "where", "backing")

    def __init__(self, start: int):
        self.start, self.n = start, 0
        self.state = State.NONE
        self.precision = "f32"  # exact rows: their kv_dtype; QUANTIZED: the codec's label
        self.data: dict[str, torch.Tensor] | None = None  # in memory (ACTIVE: capacity rows; QUANTIZED: n rows)
        self.where: dict | None = None  # PERSISTED: field -> location in `backing`
        self.backing: MappedFile | None = None

    @property
    def end(self) -> int:
        return self.start + self.n

    def resident_bytes(self) -> int:
        if self.state in (State.ACTIVE, State.QUANTIZED) and self.data:
            return sum(t.untyped_storage().nbytes() for t in self.data.values())
        return 0


class CellStore(LayerStore):
    def __init__(self, geometry: LayerGeometry, device: torch.device, manager: CellManager):
        super().__init__(geometry, device)
        self.manager = manager
        # the layer's key calibration when the rules ask for it (policy `calib: on`), else None
        cal = geometry.key_calibration if manager.rules.policy.calib else None
        self.calibration = None if cal is None else cal.to(device)
        self.cells: list[Cell] = []  # index i covers [i * C, (i + 1) * C); evicted cells stay as markers
        self.first_live = 0  # index of the oldest non-evicted cell
        self._codecs: dict[tuple[int, int], KVCodec] = {}
        self.dtype = torch_dtype(geometry.kv_dtype)  # of exact (ACTIVE, and PERSISTED from ACTIVE) cells

    def codec(self, widths: tuple[int, int]) -> KVCodec:
        """The K/V codec pair of this layer's QUANTIZED cells at (K bits, V bits)."""
        if widths not in self._codecs:
            d = self.geometry.head_dim
            self._codecs[widths] = KVCodec(self.manager.codec(d, widths[0]), self.manager.codec(d, widths[1]),
                                           self.calibration)
        return self._codecs[widths]

    # -- writing -------------------------------------------------------------------------------
    def append(self, k, v):
        rules, c_size = self.manager.rules, self.manager.cell_size
        hkv, d = self.geometry.n_kv_heads, self.geometry.head_dim
        t, done = k.shape[1], 0
        while done < t:
            cell = self.cells[-1] if self.cells else None
            if cell is None or cell.n == c_size:
                cell = Cell(len(self.cells) * c_size)
                cell.state = rules.apply(Event.TOKEN_APPEND, State.NONE, State.ACTIVE)
                cell.precision = self.geometry.kv_dtype
                cell.data = {name: torch.empty(hkv, c_size, d, dtype=self.dtype, device=self.device)
                             for name in ("k", "v")}
                self.cells.append(cell)
            if cell.state != State.ACTIVE:
                raise RuntimeError("the newest cell left ACTIVE")  # the manager never demotes it
            take = min(c_size - cell.n, t - done)
            cell.data["k"][:, cell.n:cell.n + take] = k[:, done:done + take]
            cell.data["v"][:, cell.n:cell.n + take] = v[:, done:done + take]
            cell.n += take
            done += take
        self.end += t

    # -- reading -------------------------------------------------------------------------------
    def read(self, start, dtype):
        rules = self.manager.rules
        hkv, d, n = self.geometry.n_kv_heads, self.geometry.head_dim, self.end - start
        buf = self.manager.scratch.get(2, hkv, n, d)
        for cell in self.cells[start // self.manager.cell_size:]:
            lo, hi = max(start, cell.start), cell.end
            if lo >= hi:
                continue
            if cell.state == State.EVICTED:
                raise RuntimeError(f"layer {self.geometry.index}: read of evicted cell at {cell.start}")
            a, b, dst = lo - cell.start, hi - cell.start, slice(lo - start, hi - start)
            if cell.state == State.ACTIVE:
                rules.apply(Event.READ_REQUEST, State.ACTIVE, State.ACTIVE)
                buf[0][:, dst], buf[1][:, dst] = cell.data["k"][:, a:b], cell.data["v"][:, a:b]
            elif cell.state == State.QUANTIZED:
                rules.apply(Event.READ_REQUEST, State.QUANTIZED, State.QUANTIZED)
                self._decode(cell.data, cell.precision, cell.start + a, a, b, buf, dst)
            else:  # PERSISTED: bring it back for this read only
                cell.state = rules.apply(Event.CACHE_MISS, State.PERSISTED, State.RECOVERING)
                exact = cell.precision == self.geometry.kv_dtype
                fields = {name: readonly_tensor(cell.backing.read(loc), self.dtype if exact else None)
                          for name, loc in cell.where.items()}
                if exact:
                    buf[0][:, dst], buf[1][:, dst] = fields["k"][:, a:b], fields["v"][:, a:b]
                else:
                    self._decode(fields, cell.precision, cell.start + a, a, b, buf, dst)
                cell.state = rules.apply(Event.WRITE_BACK, State.RECOVERING, State.PERSISTED)
        return buf[0].to(dtype), buf[1].to(dtype)

    def _decode(self, data, precision, first, a, b, buf, dst):
        codec = self.codec(precision_widths(precision))
        rows = {name: t[:, a:b] for name, t in data.items()}
        for i, t in enumerate("kv"):
            codec.decode(rows, t, buf[i][:, dst], first)

    def meta(self):
        return {} if self.calibration is None else {"key_calibration": self.calibration.digest}

    # -- lifecycle -----------------------------------------------------------------------------
    def release(self):
        if self.geometry.window is not None:  # keep the last `window` rows, like window/v1
            horizon = self.end - self.geometry.window
            while self.first_live < len(self.cells) and self.cells[self.first_live].end <= horizon \
                    and self.cells[self.first_live].n == self.manager.cell_size:
                self.evict(self.cells[self.first_live])
                self.first_live += 1

    def evict(self, cell: Cell) -> None:
        cell.state = self.manager.rules.apply(Event.EVICT, cell.state, State.EVICTED)
        cell.data = cell.where = cell.backing = None

    def _demoted(self, cell: Cell) -> State | None:
        """The state one MEMORY_PRESSURE step down takes `cell` to, as the rules allow (None: none)."""
        rules, mp = self.manager.rules, Event.MEMORY_PRESSURE
        if cell.state == State.ACTIVE:
            prefer = (State.QUANTIZED, State.PERSISTED) if rules.policy.may_quantize(self.geometry.index) \
                else (State.PERSISTED,)
            return rules.target(mp, State.ACTIVE, prefer)
        if cell.state == State.QUANTIZED:
            return rules.target(mp, State.QUANTIZED, (State.PERSISTED,))
        return None

    def demotable(self, cell: Cell) -> bool:
        return self._demoted(cell) is not None

    def demote(self, cell: Cell) -> bool:
        """One MEMORY_PRESSURE step down for `cell`, as the rules allow. False: nothing allowed."""
        rules, mp = self.manager.rules, Event.MEMORY_PRESSURE
        dst = self._demoted(cell)
        if dst is None:
            return False
        if dst == State.QUANTIZED:
            codec = self.codec(rules.policy.widths(self.geometry.index))
            cell.data, cell.precision = codec.encode(cell.data["k"][:, :cell.n].float(),
                                                     cell.data["v"][:, :cell.n].float(), cell.start), codec.label
        else:
            arrays = {name: to_numpy(t[:, :cell.n]) for name, t in cell.data.items()} if cell.state == State.ACTIVE \
                else {name: t.numpy() for name, t in cell.data.items()}
            cell.where, cell.backing, cell.data = self.manager.spill.write(arrays), self.manager.spill, None
        cell.state = rules.apply(mp, cell.state, dst)
        return True

    # -- persistence ---------------------------------------------------------------------------
    def export(self):
        out = []
        for c in self.cells[self.first_live:]:
            meta = {"set": "main", "start": c.start, "n": c.n, "state": c.state.value, "precision": c.precision}
            if c.state == State.ACTIVE:
                arrays = {t: to_numpy(c.data[t][:, :c.n].contiguous().cpu()) for t in ("k", "v")}
            elif c.state == State.QUANTIZED:
                arrays = {name: t.contiguous().cpu().numpy() for name, t in c.data.items()}
            else:
                arrays = {name: c.backing.read(loc) for name, loc in c.where.items()}
            out.append((meta, arrays))
        return out

    def restore(self, end, records):
        c_size = self.manager.cell_size
        self.cells = []
        for meta, arrays in sorted(records, key=lambda r: r[0]["start"]):
            start, n = meta["start"], meta["n"]
            if meta["set"] != "main" or start % c_size or start != len(self.cells) * c_size and self.cells \
                    or n < 1 or n > c_size:
                raise ValueError(f"layer {self.geometry.index}: cell at {start} (n={n}) does not fit cells of {c_size}")
            while len(self.cells) * c_size < start:  # cells below the horizon were evicted before saving
                gone = Cell(len(self.cells) * c_size)
                gone.n, gone.state = c_size, State.EVICTED
                self.cells.append(gone)
            cell = Cell(start)
            cell.n, cell.state, cell.precision = n, State(meta["state"]), meta["precision"]
            exact = cell.state in (State.ACTIVE, State.PERSISTED) and cell.precision in KV_DTYPES
            if exact and cell.precision != self.geometry.kv_dtype:
                raise ValueError(f"layer {self.geometry.index}: cell at {start} holds {cell.precision} rows, this "
                                 f"state keeps {self.geometry.kv_dtype}")
            if cell.state == State.ACTIVE:
                cell.data = {t: torch.zeros(self.geometry.n_kv_heads, c_size, self.geometry.head_dim, dtype=self.dtype)
                             for t in ("k", "v")}
                for t in ("k", "v"):
                    cell.data[t][:, :n] = from_numpy(np.array(arrays[t]), self.dtype)
            elif cell.state == State.QUANTIZED:
                try:
                    precision_widths(cell.precision)
                except ValueError:
                    raise ValueError(f"layer {self.geometry.index}: cell at {start} has precision "
                                     f"{cell.precision!r}") from None
                cell.data = {name: torch.from_numpy(np.array(a)) for name, a in arrays.items()}
            elif cell.state == State.PERSISTED:
                cell.backing, cell.where = meta["_where"]  # stays in the state file, read through mmap
            else:
                raise ValueError(f"layer {self.geometry.index}: a saved cell cannot be {cell.state.value}")
            self.cells.append(cell)
        self.first_live = sum(1 for c in self.cells if c.state == State.EVICTED)
        if (self.cells[-1].end if self.cells else 0) != end:
            raise ValueError(f"layer {self.geometry.index}: saved cells end at "
                             f"{self.cells[-1].end if self.cells else 0}, not {end}")
        if self.cells and self.cells[-1].state != State.ACTIVE:
            raise ValueError(f"layer {self.geometry.index}: the newest saved cell is not ACTIVE")
        self.end = end

    def can_trim(self, end):
        if end > self.end or self.retained()[0] > self.geometry.read_start(end):
            return False
        cell = self.cells[end // self.manager.cell_size] if end < self.end else None
        return cell is None or cell.state == State.ACTIVE  # a coded or persisted cell is not cut

    def trim(self, end):
        keep = -(-end // self.manager.cell_size)
        for c in self.cells[keep:]:
            if c.state != State.EVICTED:
                self.evict(c)
        self.cells = self.cells[:keep]
        if self.cells:
            self.cells[-1].n = end - self.cells[-1].start
        self.end = end

    def retained(self):
        live = self.cells[self.first_live:] if self.cells else []
        return (live[0].start if live else self.end), self.end

    def resident_bytes(self):
        return sum(c.resident_bytes() for c in self.cells[self.first_live:])

    def cell_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.cells:
            out[c.state.value] = out.get(c.state.value, 0) + 1
        return out


def new_cells_state(provider, geometries, device: torch.device) -> EngineState:
    if provider.rules.policy.calib:
        require_calibration(geometries, f"cells/v1 (the rules in {provider.rules.source} set calib: on)")
    if provider.options.get("calib") == "on":
        require_calibration(geometries, "cells/v1 calib=on")
    policy = dataclasses.replace(provider.rules.policy, calib=provider.calibrated(geometries))
    rules = dataclasses.replace(provider.rules, policy=policy, counts=Counter())  # each sequence counts its own
    manager = CellManager(rules, provider.options.get("budget"), device)
    manager.stores = [CellStore(g, device, manager) for g in geometries]
    state = EngineState(provider.identity, provider.resolved(geometries), manager.stores, shared=[manager])
    if manager.budget is not None:
        state.max_chunk = rules.cell_size  # hold the budget between blocks of one cell
    return state

