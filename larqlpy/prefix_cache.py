"""States kept after their request, for later requests that share a prefix of token ids: a chat's
next turn, a shared system prompt or document (the design's cross-session continuation).

A kept state moves through the cells lifecycle's states, counted per transition:

    ACTIVE      in memory, as its engine left it
    QUANTIZED   its cold cells demoted to codes by its engine's rules (`EngineState.shrink`: cells/v1);
                still in memory
    PERSISTED   saved as a state file (versioned, checksummed: state/format.py), memory freed
    RECOVERING  being loaded back for a request that matches it (then ACTIVE, in that request's hands)
    EVICTED     its file removed: past the disk budget, least recently used first

Memory pressure (resident bytes of the kept states over `kv_budget`) demotes the least recently used
first: QUANTIZED where its engine can, else PERSISTED. Matching is on token ids; a state that holds
more than the request shares is trimmed back where the engine allows (`session.align`). A state made
under another engine, options, weights or model is refused for reuse with the reason (the request
is then prefilled afresh).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from larqlpy.engines import EngineSpec
from larqlpy.engines.stores.base import EngineState
from larqlpy.errors import LarqlError
from larqlpy.session import align, numerics, resume, save
from larqlpy.state.format import check_compatible, common_prefix, load_state

SUFFIX = ".lqkv"
MIN_MATCH = 16  # shared tokens worth reusing a state for (a system prompt; not a lone BOS)
STAGES = ("ACTIVE", "QUANTIZED", "PERSISTED")


@dataclass
class Kept:
    name: str  # the file name it persists under (server-made: no request names a path)
    tokens: list[int]  # its history; the state holds tokens[:position]
    position: int
    spec: EngineSpec | None  # None: read from a file, checked when it is recovered
    state: EngineState | None = None
    path: Path | None = None
    stage: str = "ACTIVE"
    used: float = field(default_factory=time.monotonic)
    refused: str | None = None  # why this server cannot use it (a file made with other weights, ...)

    def nbytes(self) -> int:
        if self.state is not None:
            return self.state.resident_bytes()
        return self.path.stat().st_size if self.path is not None and self.path.exists() else 0


@dataclass
class Reuse:
    """What a request gets from the cache: a state holding `reused` of its ids (None: prefill afresh)."""

    state: EngineState | None = None
    logits: torch.Tensor | None = None
    reused: int = 0
    refused: str | None = None  # why a matching state could not be used


class PrefixCache:
    def __init__(self, loaded, kv_budget: int | None = None, disk_budget: int | None = None,
                 state_dir: str | Path | None = None, min_match: int = MIN_MATCH):
        self.loaded, self.kv_budget, self.disk_budget = loaded, kv_budget, disk_budget
        self.min_match = min_match
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.dir = self.state_dir or Path(tempfile.mkdtemp(prefix="larqlpy-kept-"))
        self.entries: list[Kept] = []
        self.transitions: Counter = Counter()  # "ACTIVE->PERSISTED" -> count
        self.hits = self.misses = self.refusals = 0
        self.reused_tokens = 0
        if self.state_dir is not None:
            self._load_dir()

    def _load_dir(self) -> None:
        """Every state file the directory holds, as PERSISTED entries (checked again on recovery)."""
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                saved = load_state(path)
            except LarqlError:
                continue  # a damaged or foreign file is never reused; it stays for a person to look at
            tokens = list(saved.tokens)
            self.entries.append(Kept(path.stem, tokens, saved.processed, None,
                                     path=path, stage="PERSISTED"))

    # -- a request takes, a finished one puts -----------------------------------------------------
    def _longest(self, entries: list[Kept], ids: list[int]) -> tuple[Kept | None, int]:
        best, common = None, 0
        for e in entries:
            n = common_prefix(e.tokens[:e.position], ids)
            if n > common:
                best, common = e, n
        return (best, common) if common >= self.min_match else (None, 0)

    def take(self, ids: list[int], spec: EngineSpec) -> Reuse:
        """The kept state sharing the longest prefix with `ids` among those of this engine (files
        read at start are checked when they are recovered); a match only under another engine is a
        refusal, with the reason."""
        usable = [e for e in self.entries if e.refused is None and (e.spec is None or e.spec == spec)]
        best, _ = self._longest(usable, ids)
        if best is None:
            other, _ = self._longest([e for e in self.entries if e not in usable], ids)
            if other is None:
                self.misses += 1
                return Reuse()
            self.refusals += 1
            return Reuse(refused=other.refused or f"the kept state was made with {other.spec.describe()}, this "
                                                  f"request runs {spec.describe()}")
        self.entries.remove(best)
        if best.state is None:  # PERSISTED: RECOVERING, checked against this model, weights and engine
            self._move(best, "RECOVERING")
            try:
                check_compatible(load_state(best.path), model_fingerprint=self.loaded.fingerprint,
                                 tokenizer_fingerprint=self.loaded.tokenizer.fingerprint, identity=spec.identity,
                                 options=spec.options_dict, numerics=numerics(self.loaded))
            except LarqlError as e:  # kept, never loaded again by this server
                self.entries.append(best)
                best.stage, best.refused = "PERSISTED", str(e)
                self.refusals += 1
                return Reuse(refused=best.refused)
            try:
                plan, _ = resume(self.loaded, best.path, ids, spec)
            except LarqlError:  # this prompt parts from it where the engine cannot go back: others may match
                self.entries.append(best)
                best.stage = "PERSISTED"
                self.misses += 1
                return Reuse()
            self._drop_file(best)
            best.stage = "ACTIVE"
            self.transitions["RECOVERING->ACTIVE"] += 1
            state, logits, reused = plan.state, plan.logits, plan.reused
            if reused == 0:
                self.misses += 1
                return Reuse()
        else:
            state = best.state
            fit = align(state, best.tokens, ids, state.last_logits)
            if fit is None:  # the engine cannot go back to the shared prefix: keep it for others
                self.entries.append(best)
                self.misses += 1
                return Reuse()
            state.unshrink()
            logits, reused = fit.logits, fit.reused
        self.hits += 1
        self.reused_tokens += reused
        return Reuse(state, logits, reused)

    def put(self, tokens: list[int], spec: EngineSpec, state: EngineState) -> None:
        """Keep a finished request's state (holding tokens[:state.position])."""
        if state is None or state.position == 0:
            return
        self.entries.append(Kept(secrets.token_hex(8), list(tokens), state.position, spec, state))
        self.transitions["NONE->ACTIVE"] += 1
        self.enforce()

    # -- budgets ----------------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        return sum(e.nbytes() for e in self.entries if e.state is not None)

    def disk_bytes(self) -> int:
        return sum(e.nbytes() for e in self.entries if e.state is None)

    def enforce(self) -> None:
        """Least recently used first: QUANTIZED where the engine can, else PERSISTED, until the kept
        states fit `kv_budget`; then EVICTED until the files fit `disk_budget`."""
        if self.kv_budget is not None:
            for e in sorted((e for e in self.entries if e.state is not None), key=lambda e: e.used):
                excess = self.resident_bytes() - self.kv_budget
                if excess <= 0:
                    break
                if e.stage == "ACTIVE" and e.state.shrink(max(0, e.nbytes() - excess)):
                    self._move(e, "QUANTIZED")
                    if self.resident_bytes() <= self.kv_budget:
                        break
                self.persist(e)
        if self.disk_budget is not None:
            for e in sorted((e for e in self.entries if e.state is None), key=lambda e: e.used):
                if self.disk_bytes() <= self.disk_budget:
                    break
                self._drop_file(e)
                self.entries.remove(e)
                self._move(e, "EVICTED")

    def persist(self, e: Kept) -> None:
        path = self.dir / f"{e.name}{SUFFIX}"
        save(self.loaded, path, e.state, e.tokens)
        e.state, e.path = None, path
        self._move(e, "PERSISTED")

    def save_all(self) -> None:
        """At shutdown with a state directory: every kept state to disk, to be found at the next start."""
        for e in [e for e in self.entries if e.state is not None]:
            self.persist(e)

    def close(self) -> None:
        if self.state_dir is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _drop_file(self, e: Kept) -> None:
        if e.path is not None:
            e.path.unlink(missing_ok=True)
            e.path = None

    def _move(self, e: Kept, stage: str) -> None:
        self.transitions[f"{e.stage}->{stage}"] += 1
        e.stage = stage

    # -- what /metrics shows ----------------------------------------------------------------------
    def stats(self) -> dict:
        by_stage = {s: 0 for s in STAGES}
        count = {s: 0 for s in STAGES}
        for e in self.entries:
            by_stage[e.stage] += e.nbytes()
            count[e.stage] += 1
        cells: Counter = Counter()
        for e in self.entries:
            if e.state is not None:
                cells.update(e.state.report().get("cells", {}))
        return {"bytes": by_stage, "states": count, "cells": dict(cells), "transitions": dict(self.transitions),
                "hits": self.hits, "misses": self.misses, "refusals": self.refusals,
                "reused_tokens": self.reused_tokens}
