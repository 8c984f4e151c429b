"""Where a sequence's first state comes from, as one protocol: a `StateSource` hands over a state
that holds a prefix of the prompt (`Reuse`), and `Held` is a state with the tokens it stands for --
what a sequence starts from and what it leaves. The sources: a state file (state/saved.py), a
server's kept states (state/prefix_cache.py), the branches of one prompt (state/branches.py), and a
state a caller already holds (`Given`: a chat's previous turn)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from larqlpy.engines import EngineSpec
from larqlpy.engines.stores.state import EngineState
from larqlpy.state.format import common_prefix


@dataclass
class Held:
    """An attention state and the tokens it stands for: it holds tokens[:state.position]. `logits`
    are the model's output at its newest position, when known (a request that continues from
    exactly the held tokens samples from them)."""

    tokens: list[int]
    state: EngineState
    logits: torch.Tensor | None = None

    @property
    def spec(self) -> EngineSpec:
        return EngineSpec(self.state.identity, tuple(sorted(self.state.options.items())))


@dataclass(frozen=True)
class Reuse:
    """What a state source gives a sequence when it starts: a state holding a prefix of its ids
    (None: it starts afresh), and what to report of it (resumed_from, reused_tokens, trimmed_from,
    refused: why a matching state could not serve)."""

    held: Held | None = None
    info: dict = field(default_factory=dict)


class StateSource(Protocol):
    """Where a sequence's first state may come from: a state file, a server's kept states, a chat's
    previous turn. `take` hands over a state that holds a prefix of `ids`, cut back to it where
    needed; the source keeps it no longer."""

    def take(self, ids: list[int], spec: EngineSpec) -> Reuse: ...


class Given:
    """The source of one state a caller already has (a chat's previous turn, a state handed to
    `stream_generate`): fitted to the prompt as `align` fits it, once."""

    def __init__(self, held: Held | None):
        self.held = held

    def take(self, ids: list[int], spec: EngineSpec) -> Reuse:
        held, self.held = self.held, None
        return Reuse(align(held, ids) if held is not None else None)


def align(held: Held, ids: list[int]) -> Held | None:
    """`held` made to serve `ids`: its state keeps the prefix they share, cut back to it where the
    engine can (and one position further when it holds all of `ids` without their logits). None:
    the engine cannot go back there."""
    state, processed = held.state, held.state.position
    common = common_prefix(held.tokens[:processed], ids)
    if common == processed and (len(ids) > processed or (len(ids) == processed and held.logits is not None)):
        return Held(list(ids), state, held.logits)
    target = min(common, len(ids) - 1)
    if state.can_trim(target):
        state.trim(target)
        return Held(list(ids), state, None)
    return None
