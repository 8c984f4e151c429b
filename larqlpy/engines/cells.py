"""cells/v1: attention state as KV cells with a lifecycle, driven by YAML rules and a memory budget.

A cell is `cell_size` consecutive positions of one layer. New rows go into the newest cell (ACTIVE,
f32). After every block, cells below the layer's horizon are EVICTED, and while the resident bytes
of all cells exceed the budget, MEMORY_PRESSURE moves the coldest cell (lowest positions first)
one step down as the rules allow: ACTIVE -> QUANTIZED (TurboQuant codes, on layers the policy lets
quantize) -> PERSISTED (bytes in an append-only spill file, read back through mmap, not resident).
The newest `keep_active_recent` positions and the newest cell of each layer stay ACTIVE. Reading a
PERSISTED cell is CACHE_MISS (-> RECOVERING) then WRITE_BACK (-> PERSISTED): its rows are decoded
into the shared scratch for the read and nothing stays in memory.

With no budget, or rules that only ever persist f32 cells, cells/v1 is exact (bit-identical to
canonical/v1: the same rows in the same order reach attention).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import tempfile
import warnings
from collections import Counter

import numpy as np
import torch

from larqlpy.engines.base import EngineState, LayerGeometry, LayerStore, Provider
from larqlpy.engines.codec import Scratch
from larqlpy.engines.spec import OptionSpec
from larqlpy.calibration import require_calibration
from larqlpy.errors import LarqlError
from larqlpy.kernels.rowcodec import TurboQuantCodec
from larqlpy.state.rules import Event, Rules, State, load_rules

SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB|TiB|K|M|G)?\s*$", re.IGNORECASE)
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20,
         "g": 2**30, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    m = SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"expected a size like 64MiB, 2GiB or 1000000, got {text!r}")
    n = float(m.group(1)) * UNITS[(m.group(2) or "b").lower()]
    if n < 1:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(n)


class Backing:
    """Where PERSISTED bytes live: an append-only spill file, or a loaded state file; read via mmap."""

    def __init__(self, fileobj, writable: bool):
        self.f, self.writable = fileobj, writable
        self.size = os.fstat(fileobj.fileno()).st_size
        self.map: mmap.mmap | None = None

    @classmethod
    def spill(cls, directory: str | None = None) -> "Backing":
        return cls(tempfile.TemporaryFile(prefix="larqlpy-spill-", dir=directory), True)

    def write(self, arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, int, str, tuple[int, ...]]]:
        where = {}
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            self.f.seek(self.size)
            self.f.write(a.tobytes())
            where[name] = (self.size, a.nbytes, a.dtype.str, a.shape)
            self.size += a.nbytes
        self.f.flush()
        return where

    def read(self, loc: tuple[int, int, str, tuple[int, ...]]) -> np.ndarray:
        offset, length, dtype, shape = loc
        if self.map is None or offset + length > len(self.map):
            self.map = mmap.mmap(self.f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(self.map, dtype=np.dtype(dtype), count=length // np.dtype(dtype).itemsize,
                             offset=offset).reshape(shape)


class Cell:
    __slots__ = ("start", "n", "state", "precision", "data", "where", "backing")

    def __init__(self, start: int):
        self.start, self.n = start, 0
        self.state = State.NONE
        self.precision = "f32"
        self.data: dict[str, torch.Tensor] | None = None  # in memory (ACTIVE: capacity rows; QUANTIZED: n rows)
        self.where: dict | None = None  # PERSISTED: field -> (offset, length, dtype, shape) in `backing`
        self.backing: Backing | None = None

    @property
    def end(self) -> int:
        return self.start + self.n

    def resident_bytes(self) -> int:
        if self.state in (State.ACTIVE, State.QUANTIZED) and self.data:
            return sum(t.untyped_storage().nbytes() for t in self.data.values())
        return 0


class CellStore(LayerStore):
    def __init__(self, geometry: LayerGeometry, device: torch.device, manager: "CellManager"):
        super().__init__(geometry, device)
        self.m = manager
        # the layer's key calibration when the rules ask for it (policy `calib: on`), else None
        cal = geometry.key_calibration if manager.rules.policy.calib else None
        self.calibration = None if cal is None else cal.to(device)
        self.cells: list[Cell] = []  # index i covers [i * C, (i + 1) * C); evicted cells stay as markers
        self.first_live = 0  # index of the oldest non-evicted cell

    # -- writing -------------------------------------------------------------------------------
    def append(self, k, v):
        c_size, hkv, d = self.m.cell_size, self.geometry.n_kv_heads, self.geometry.head_dim
        t, done = k.shape[1], 0
        while done < t:
            cell = self.cells[-1] if self.cells else None
            if cell is None or cell.n == c_size:
                cell = Cell(len(self.cells) * c_size)
                cell.state = self.m.rules.apply(Event.TOKEN_APPEND, State.NONE, State.ACTIVE)
                cell.data = {name: torch.empty(hkv, c_size, d, dtype=torch.float32, device=self.device)
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
        hkv, d, n = self.geometry.n_kv_heads, self.geometry.head_dim, self.end - start
        buf = self.m.scratch.get(2, hkv, n, d)
        c_size = self.m.cell_size
        for cell in self.cells[start // c_size:]:
            lo, hi = max(start, cell.start), cell.end
            if lo >= hi:
                continue
            if cell.state == State.EVICTED:
                raise RuntimeError(f"layer {self.geometry.index}: read of evicted cell at {cell.start}")
            a, b, dst = lo - cell.start, hi - cell.start, slice(lo - start, hi - start)
            if cell.state == State.ACTIVE:
                self.m.rules.apply(Event.READ_REQUEST, State.ACTIVE, State.ACTIVE)
                buf[0][:, dst], buf[1][:, dst] = cell.data["k"][:, a:b], cell.data["v"][:, a:b]
            elif cell.state == State.QUANTIZED:
                self.m.rules.apply(Event.READ_REQUEST, State.QUANTIZED, State.QUANTIZED)
                self._decode_codes(cell.data, a, b, buf, dst, cell.precision)
            else:  # PERSISTED: bring it back for this read only
                cell.state = self.m.rules.apply(Event.CACHE_MISS, State.PERSISTED, State.RECOVERING)
                fields = {name: _readonly_tensor(cell.backing.read(loc)) for name, loc in cell.where.items()}
                if cell.precision == "f32":
                    buf[0][:, dst], buf[1][:, dst] = fields["k"][:, a:b], fields["v"][:, a:b]
                else:
                    self._decode_codes(fields, a, b, buf, dst, cell.precision)
                cell.state = self.m.rules.apply(Event.WRITE_BACK, State.RECOVERING, State.PERSISTED)
        return buf[0].to(dtype), buf[1].to(dtype)

    def _decode_codes(self, data, a, b, buf, dst, precision):
        hkv = self.geometry.n_kv_heads
        for i, (t, bits) in enumerate(zip(("k", "v"), precision_widths(precision))):
            codec = self.m.codec(self.geometry.head_dim, bits)
            f = {"norm": data[f"{t}_norm"][:, a:b].reshape(-1),
                 "code": data[f"{t}_code"][:, a:b].reshape(hkv * (b - a), -1)}
            x = codec.decode(f).view(hkv, b - a, -1)
            if t == "k" and self.calibration is not None:  # codes of (k - mean) * scale
                x = self.calibration.undo(x)
            buf[i][:, dst] = x

    def meta(self):
        return {} if self.calibration is None else {"key_calibration": self.calibration.digest}

    # -- lifecycle -----------------------------------------------------------------------------
    def release(self):
        if self.geometry.window is not None:  # keep the last `window` rows, like window/v1
            horizon = self.end - self.geometry.window
            while self.first_live < len(self.cells) and self.cells[self.first_live].end <= horizon \
                    and self.cells[self.first_live].n == self.m.cell_size:
                self.evict(self.cells[self.first_live])
                self.first_live += 1
        if self is self.m.stores[-1]:  # after the last layer of the block: hold the budget
            self.m.enforce()
            self.m.scratch.release()

    def evict(self, cell: Cell) -> None:
        cell.state = self.m.rules.apply(Event.EVICT, cell.state, State.EVICTED)
        cell.data = cell.where = cell.backing = None

    def demote(self, cell: Cell) -> bool:
        """One MEMORY_PRESSURE step down for `cell`, as the rules allow. False: nothing allowed."""
        rules, mp = self.m.rules, Event.MEMORY_PRESSURE
        if cell.state == State.ACTIVE:
            prefer = (State.QUANTIZED, State.PERSISTED) if rules.policy.may_quantize(self.geometry.index) \
                else (State.PERSISTED,)
            dst = rules.target(mp, State.ACTIVE, prefer)
        elif cell.state == State.QUANTIZED:
            dst = rules.target(mp, State.QUANTIZED, (State.PERSISTED,))
        else:
            return False
        if dst is None:
            return False
        if dst == State.QUANTIZED:
            hkv, n = self.geometry.n_kv_heads, cell.n
            widths = rules.policy.widths(self.geometry.index)
            data = {}
            for t, bits in zip(("k", "v"), widths):
                codec = self.m.codec(self.geometry.head_dim, bits)
                x = cell.data[t][:, :n]
                if t == "k" and self.calibration is not None:
                    x = self.calibration.apply(x)
                enc = codec.encode(x.reshape(hkv * n, -1))
                data.update({f"{t}_{name}": val.view(hkv, n, *val.shape[1:]).clone() for name, val in enc.items()})
            cell.data, cell.precision = data, precision_label(*widths)
        else:
            arrays = {name: t[:, :cell.n].numpy() for name, t in cell.data.items()} if cell.precision == "f32" \
                else {name: t.numpy() for name, t in cell.data.items()}
            cell.where, cell.backing, cell.data = self.m.spill.write(arrays), self.m.spill, None
        cell.state = rules.apply(mp, cell.state, dst)
        return True

    # -- persistence ---------------------------------------------------------------------------
    def export(self):
        out = []
        for c in self.cells[self.first_live:]:
            meta = {"set": "main", "start": c.start, "n": c.n, "state": c.state.value, "precision": c.precision}
            if c.state == State.ACTIVE:
                arrays = {t: c.data[t][:, :c.n].contiguous().cpu().numpy() for t in ("k", "v")}
            elif c.state == State.QUANTIZED:
                arrays = {name: t.contiguous().cpu().numpy() for name, t in c.data.items()}
            else:
                arrays = {name: c.backing.read(loc) for name, loc in c.where.items()}
            out.append((meta, arrays))
        return out

    def restore(self, end, records):
        c_size = self.m.cell_size
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
            if cell.state == State.ACTIVE:
                cell.data = {t: torch.zeros(self.geometry.n_kv_heads, c_size, self.geometry.head_dim) for t in ("k", "v")}
                for t in ("k", "v"):
                    cell.data[t][:, :n] = torch.from_numpy(np.array(arrays[t]))
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
        cell = self.cells[end // self.m.cell_size] if end < self.end else None
        return cell is None or cell.state == State.ACTIVE  # a coded or persisted cell is not cut

    def trim(self, end):
        c_size = self.m.cell_size
        keep = -(-end // c_size)
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


class CellManager:
    """What the layers share: rules and their counters, the budget, the spill file, the scratch."""

    def __init__(self, rules: Rules, budget: int | None, device: torch.device, spill_dir: str | None = None):
        self.rules, self.budget, self.device = rules, budget, device
        self.cell_size = rules.cell_size
        self.scratch = Scratch(device)
        self.spill = Backing.spill(spill_dir)
        self.stores: list[CellStore] = []
        self._codecs: dict[tuple[int, int], TurboQuantCodec] = {}

    def codec(self, d: int, bits: int) -> TurboQuantCodec:
        if (d, bits) not in self._codecs:
            self._codecs[(d, bits)] = TurboQuantCodec(d, bits, self.device)
        return self._codecs[(d, bits)]

    def resident(self) -> int:
        return sum(s.resident_bytes() for s in self.stores)

    def enforce(self) -> None:
        if self.budget is None:
            return
        excess = self.resident() - self.budget
        if excess <= 0:
            return
        protect_from = max(0, self.stores[0].end - self.rules.policy.keep_active_recent)
        candidates = sorted(((c.start, s.geometry.index, s, c) for s in self.stores
                             for c in s.cells[s.first_live:-1]  # never the newest cell
                             if c.state in (State.ACTIVE, State.QUANTIZED) and c.end <= protect_from),
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

    def nbytes(self) -> int:  # the scratch, reported beside the cells
        return self.scratch.nbytes()

    def transitions(self) -> list[dict]:
        return self.rules.counted()

    def report(self) -> dict:
        cells: dict[str, int] = {}
        for s in self.stores:
            for k, v in s.cell_counts().items():
                cells[k] = cells.get(k, 0) + v
        return {"transitions": self.transitions(), "cells": cells, "budget": self.budget,
                "spilled_bytes": self.spill.size}


class Cells(Provider):
    identity = "cells/v1"
    summary = "KV cells with a lifecycle (YAML rules) under a memory budget; exact unless cells quantize"
    exact = False

    @classmethod
    def option_specs(cls):
        return (OptionSpec("budget", parse_size, help="resident KV budget, e.g. 64MiB"),
                OptionSpec("rules", str, help="rules YAML file (default: the packaged rules)"),
                OptionSpec("bits", lambda s: _bits(s), help="override the rules' codec width (3 or 4)"))

    def __init__(self, options):
        super().__init__(options)
        self.rules = load_rules(self.options.get("rules"))
        if "bits" in self.options:
            self.rules.policy = dataclasses.replace(self.rules.policy, bits=int(self.options["bits"]))

    def cell_bytes(self, g: LayerGeometry) -> int:
        return self.rules.cell_size * g.row_bytes_f32

    def check_geometry(self, geometries):
        budget = self.options.get("budget")
        if budget is None:
            return
        if not self.rules.can_reach_disk():
            raise LarqlError(f"cells/v1: the rules in {self.rules.source} cannot keep resident KV under a budget: "
                             "no MEMORY_PRESSURE path takes an ACTIVE cell to PERSISTED")
        keep_cells = -(-self.rules.policy.keep_active_recent // self.rules.cell_size) + 1
        floor = sum(min(keep_cells, -(-(g.window or 10**12) // self.rules.cell_size) + 1) * self.cell_bytes(g)
                    for g in geometries)
        slack = sum(self.cell_bytes(g) for g in geometries)
        if floor - slack > budget:
            raise LarqlError(f"cells/v1: budget {budget:,} B is below what the rules keep ACTIVE "
                             f"({floor - slack:,} B for keep_active_recent={self.rules.policy.keep_active_recent} "
                             f"on {len(geometries)} layers)")

    @classmethod
    def check_options(cls, options, where):
        load_rules(options.get("rules"))  # a bad rules file is refused before any weights load

    def new_state(self, geometries, device):
        self.check_geometry(geometries)
        if self.rules.policy.calib:
            require_calibration(geometries, f"cells/v1 (the rules in {self.rules.source} set calib: on)")
        rules = dataclasses.replace(self.rules, counts=Counter())  # each sequence counts its own
        manager = CellManager(rules, self.options.get("budget"), device)
        manager.stores = [CellStore(g, device, manager) for g in geometries]
        state = EngineState(self.identity, self.options, manager.stores, extras=[manager])
        if manager.budget is not None:
            state.max_chunk = self.rules.cell_size  # hold the budget between blocks of one cell
        return state

    def retained_rows(self, geometry, positions):
        return positions if geometry.window is None else min(positions, geometry.window)


def precision_label(k_bits: int, v_bits: int) -> str:
    """A QUANTIZED cell's precision: tq4 (K and V at 4 bits) or tq5/3 (K at 5, V at 3)."""
    return f"tq{k_bits}" if k_bits == v_bits else f"tq{k_bits}/{v_bits}"


def precision_widths(label: str) -> tuple[int, int]:
    k, _, v = label.removeprefix("tq").partition("/")
    return int(k), int(v or k)


def _readonly_tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor over mmap'd bytes (only ever read from), without torch's non-writable warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _bits(text: str) -> int:
    if text not in ("3", "4"):
        raise ValueError(f"must be one of 3, 4, got {text}")
    return int(text)
