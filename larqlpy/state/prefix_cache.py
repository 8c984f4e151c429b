"""States kept after their request, for later requests that share a prefix of token ids: a chat's
next turn, a shared system prompt or document (the design's cross-session continuation). A
`StateSource`: a request's sequence takes its state from here when it starts.

A kept state moves through the cells lifecycle's states, counted per transition:

    ACTIVE      in memory, as its engine left it
    QUANTIZED   its cold cells demoted to codes by its engine's rules (`EngineState.shrink`: cells/v1);
                still in memory
    PERSISTED   saved as a state file (versioned, checksummed: state/format.py), memory freed
    RECOVERING  being loaded back for a request that matches it (then ACTIVE, in that request's hands)
    EVICTED     its file removed: past the disk budget, least recently used first

Memory: the kept states live in what the process's KV budget (budget.py) leaves beside the live
sequences' reservations; past it the least recently used go first, QUANTIZED where their engine
can, else PERSISTED. Matching is on token ids; a state that holds more than the request shares is
trimmed back where the engine allows (`session.align`). A state made under another engine, options,
weights or model is refused for reuse with the reason (the request is then prefilled afresh).

Replicas sharing one state directory (`replica`: this one's name; server/ray_serve.py) each write
under `<state_dir>/replicas/<replica>/` and read the others' files there. A replica writes a state's
file as it keeps it (write-through, on the engine thread: a later turn that lands on another replica,
its own gone, resumes from it) and keeps the file while the state is in use, until a newer state of
the same tokens supersedes it. On every `take` it lists the other replicas' directories and reads
the token ids of files it has not seen (their headers only); it reads such a file whole only when a
request takes it, and never deletes one: each replica evicts only its own files.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from larqlpy.budget import KVBudget
from larqlpy.engines import EngineSpec
from larqlpy.engines.lifecycle import State
from larqlpy.errors import LarqlError
from larqlpy.files import remove_stale
from larqlpy.state.format import common_prefix, load_state, read_tokens
from larqlpy.state.saved import restore, save
from larqlpy.state.sources import Held, Reuse, align
from larqlpy.weights.loader import LoadedModel

SUFFIX = ".lqkv"
MIN_MATCH = 16  # shared tokens worth reusing a state for (a system prompt; not a lone BOS)
STAGES = (State.ACTIVE, State.QUANTIZED, State.PERSISTED)  # where a kept state can stay
REPLICAS = "replicas"  # under a shared state directory: one directory per replica


@dataclass
class Kept:
    """One kept state: in memory (`held`) or in its file (`path`)."""

    name: str  # the file name it persists under (server-made: no request names a path)
    tokens: list[int]  # its history; the state holds tokens[:position]
    position: int
    spec: EngineSpec | None  # None: read from a file, checked when it is recovered
    held: Held | None = None
    path: Path | None = None
    size: int = 0  # its file's bytes
    stage: State = State.ACTIVE
    # its last use: a hit hands the state to its request, whose state comes back as a new entry at its end
    used: float = field(default_factory=time.monotonic)
    refused: str | None = None  # why this server cannot use it (a file made with other weights, ...)
    foreign: bool = False  # a file another replica wrote: read, never deleted here

    def nbytes(self) -> int:
        return self.held.state.resident_bytes() if self.held is not None else self.size


class PrefixCache:
    def __init__(self, loaded: LoadedModel, budget: KVBudget | None = None, disk_budget: int | None = None,
                 state_dir: str | Path | None = None, min_match: int = MIN_MATCH, replica: str | None = None):
        self.loaded, self.budget, self.disk_budget = loaded, budget or KVBudget(), disk_budget
        self.budget.on_reserve = self.enforce  # a live sequence's reservation pushes kept states out
        self.min_match = min_match
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.dir = self.state_dir or Path(tempfile.mkdtemp(prefix="larqlpy-kept-"))
        self.shared: Path | None = None  # the replicas' directories, this one's among them
        self.seen: set[Path] = set()  # the other replicas' files already listed
        if replica is not None and self.state_dir is not None:
            self.shared = self.state_dir / REPLICAS
            self.dir = self.shared / replica
            self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: list[Kept] = []
        self.transitions: Counter = Counter()  # "ACTIVE->PERSISTED" -> count
        self.hits = self.misses = self.refusals = 0
        self.reused_tokens = 0
        if self.state_dir is not None:
            self._load_dir()

    def _load_dir(self) -> None:
        """Every state file the directory holds, as PERSISTED entries (checked again on recovery);
        the temp files of a server that died while it saved one are removed."""
        remove_stale(self.dir, f".*{SUFFIX}.*.tmp")
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                saved = load_state(path)
            except LarqlError:
                continue  # a damaged or foreign file is never reused; it stays for a person to look at
            self.entries.append(Kept(path.stem, list(saved.tokens), saved.processed, None, path=path,
                                     size=path.stat().st_size, stage=State.PERSISTED))

    # -- a request takes, a finished one puts -----------------------------------------------------
    def _longest(self, entries: list[Kept], ids: list[int]) -> Kept | None:
        best, common = None, 0
        for e in entries:
            n = common_prefix(e.tokens[:e.position], ids)
            if n > common:
                best, common = e, n
        return best if common >= self.min_match else None

    def _rescan(self) -> None:
        """The other replicas' files as PERSISTED entries: new ones listed, vanished ones dropped."""
        found = {p for p in self.shared.glob(f"*/*{SUFFIX}") if p.parent != self.dir}
        self.entries = [e for e in self.entries if not e.foreign or e.path in found]
        for path in found - self.seen:
            try:
                tokens, processed = read_tokens(path)
                size = path.stat().st_size
            except (LarqlError, OSError):
                continue  # gone meanwhile, or not a state file: never reused
            self.entries.append(Kept(path.stem, tokens, processed, None, path=path, size=size,
                                     stage=State.PERSISTED, foreign=True))
        self.seen = found

    def take(self, ids: list[int], spec: EngineSpec) -> Reuse:
        """The kept state sharing the longest prefix with `ids` among those of this engine (files
        read at start are checked when they are recovered); a match only under another engine is a
        refusal, with the reason."""
        if self.shared is not None:
            self._rescan()
        usable = [e for e in self.entries if e.refused is None and (e.spec is None or e.spec == spec)]
        best = self._longest(usable, ids)
        if best is None:
            other = self._longest([e for e in self.entries if e not in usable], ids)
            if other is None:
                self.misses += 1
                return Reuse()
            self.refusals += 1
            return Reuse(info={"refused": other.refused or f"the kept state was made with {other.spec.describe()}, "
                                                           f"this request runs {spec.describe()}"})
        self.entries.remove(best)
        fit = self._recover(best, ids, spec) if best.held is None else align(best.held, ids)
        if isinstance(fit, str):
            return Reuse(info={"refused": fit})
        if fit is None or fit.state.position == 0:  # it parts from ids where its engine cannot go back
            self.entries.append(best)
            self.misses += 1
            return Reuse()
        if self.shared is not None and best.path is not None:  # its file stays till a newer state supersedes it
            self.entries.append(Kept(best.name, best.tokens, best.position, best.spec, path=best.path,
                                     size=best.size, stage=State.PERSISTED, foreign=best.foreign))
        fit.state.unshrink()
        self.hits += 1
        self.reused_tokens += fit.state.position
        return Reuse(fit)

    def _recover(self, e: Kept, ids: list[int], spec: EngineSpec) -> Held | str | None:
        """A PERSISTED entry, RECOVERING: its file read once, checked against this model, weights and
        engine, fitted to `ids`; a refusal's reason (kept, never loaded again by this server)."""
        self._move(e, State.RECOVERING)
        try:
            held = restore(self.loaded, load_state(e.path), spec)
        except LarqlError as err:
            self.entries.append(e)
            e.stage, e.refused = State.PERSISTED, str(err)
            self.refusals += 1
            return e.refused
        fit = align(held, ids)
        if fit is None or fit.state.position == 0:
            e.stage = State.PERSISTED
            return None
        if self.shared is None:
            self._drop_file(e)
        self._move(e, State.ACTIVE)
        return fit

    def put(self, held: Held | None) -> None:
        """Keep a finished request's state."""
        if held is None or held.state.position == 0:
            return
        e = Kept(secrets.token_hex(8), list(held.tokens), held.state.position, held.spec, held)
        self.entries.append(e)
        self.transitions["NONE->ACTIVE"] += 1
        if self.shared is not None:
            self._write_through(e)
        self.enforce()

    def _write_through(self, e: Kept) -> None:
        """`e`'s file written now, `e` staying in memory; this replica's files of states whose
        tokens it extends are superseded (removed)."""
        e.path = self.dir / f"{e.name}{SUFFIX}"
        e.size = save(self.loaded, e.path, e.held)
        for old in [o for o in self.entries if o.held is None and not o.foreign and o.path is not None
                    and o.position <= e.position and o.tokens[:o.position] == e.tokens[:o.position]]:
            self._drop_file(old)
            self.entries.remove(old)

    # -- budgets ----------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return sum(e.nbytes() for e in self.entries if e.held is not None)

    def disk_bytes(self) -> int:
        return sum(e.size for e in self.entries if e.path is not None and not e.foreign)

    def enforce(self) -> None:
        """Least recently used first: QUANTIZED where the engine can, else PERSISTED, until the kept
        states fit what the budget leaves them; then EVICTED until the files fit `disk_budget`."""
        room = self.budget.left()
        if room is not None:
            for e in sorted((e for e in self.entries if e.held is not None), key=lambda e: e.used):
                excess = self.resident_bytes() - room
                if excess <= 0:
                    break
                if e.stage is State.ACTIVE and e.held.state.shrink(max(0, e.nbytes() - excess)):
                    self._move(e, State.QUANTIZED)
                    if self.resident_bytes() <= room:
                        break
                self.persist(e)
        if self.disk_budget is not None:
            for e in sorted((e for e in self.entries if e.held is None and not e.foreign), key=lambda e: e.used):
                if self.disk_bytes() <= self.disk_budget:
                    break
                self._drop_file(e)
                self.entries.remove(e)
                self._move(e, State.EVICTED)

    def persist(self, e: Kept) -> None:
        path = self.dir / f"{e.name}{SUFFIX}"
        if e.path is None:  # written through already otherwise
            e.size = save(self.loaded, path, e.held)
        e.held, e.path = None, path
        self._move(e, State.PERSISTED)

    def save_all(self) -> None:
        """At shutdown with a state directory: every kept state to disk, to be found at the next start."""
        for e in [e for e in self.entries if e.held is not None]:
            self.persist(e)

    def close(self) -> None:
        if self.state_dir is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _drop_file(self, e: Kept) -> None:
        if e.path is not None:
            e.path.unlink(missing_ok=True)
            e.path, e.size = None, 0

    def _move(self, e: Kept, stage: State) -> None:
        self.transitions[f"{e.stage.value}->{stage.value}"] += 1
        e.stage = stage

    # -- what /metrics shows ----------------------------------------------------------------------
    @property
    def version(self) -> tuple:
        """Changes whenever `stats()` may: an entry comes or goes, moves between stages, or a request
        asks (kept states change bytes only by a counted transition)."""
        return len(self.entries), sum(self.transitions.values()), self.hits, self.misses, self.refusals

    def stats(self) -> dict:
        by_stage = {s.value: 0 for s in STAGES}
        count = {s.value: 0 for s in STAGES}
        cells: Counter = Counter()
        for e in (e for e in self.entries if not e.foreign):  # another replica's files are its to count
            by_stage[e.stage.value] += e.nbytes()
            count[e.stage.value] += 1
            if e.held is not None:
                cells.update(e.held.state.report().get("cells", {}))
        return {"bytes": by_stage, "states": count, "cells": dict(cells), "transitions": dict(self.transitions),
                "hits": self.hits, "misses": self.misses, "refusals": self.refusals,
                "reused_tokens": self.reused_tokens}
