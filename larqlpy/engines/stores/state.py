"""A sequence's attention state: every layer's store, the parts they share (a decode buffer, a cell
manager), and the logical position. The model calls `end_block` once after its layer loop."""

from __future__ import annotations

from typing import Sequence

import torch

from larqlpy.engines.stores.base import LayerStore


class Shared:
    """Something every layer of one sequence's state shares (a decode buffer, a cell manager).
    The model calls `end_block` once after its layer loop; the defaults do nothing."""

    def nbytes(self) -> int:
        return 0

    def end_block(self) -> None:
        """After every layer has attended a block."""

    def report(self) -> dict:
        """Engine-specific figures (e.g. cell transitions) for the run's statistics."""
        return {}

    def shrink(self, target: int) -> bool:
        """Memory pressure from outside (a kept state over a server's budget): bring the state's
        resident bytes toward `target` by the engine's own rules; whether anything moved."""
        return False

    def unshrink(self) -> None:
        """The pressure is over (the state is in use again): back to the engine's own settings."""

    def quiet_rows(self, n: int, end: int) -> int:
        """Of `n` rows appended from position `end` on, how many can be with no decision of the
        engine's at their ends (`EngineState.quiet_rows`); by default all."""
        return n


class Scratch(Shared):
    """One decode buffer for a whole engine state, reused by every layer (grows to the largest) and
    freed after each block: decode steps that attend on codes need none."""

    def __init__(self, device: torch.device):
        self.buf = torch.empty(0, dtype=torch.float32, device=device)

    def get(self, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        if n > self.buf.numel():
            self.buf = torch.empty(n, dtype=torch.float32, device=self.buf.device)
        return self.buf[:n].view(*shape)

    def nbytes(self) -> int:
        return self.buf.untyped_storage().nbytes()

    def end_block(self) -> None:
        self.buf = torch.empty(0, dtype=torch.float32, device=self.buf.device)


class EngineState:
    """All layers' stores for one sequence, what they share, and the logical position counter."""

    def __init__(self, identity: str, options: dict, stores: Sequence[LayerStore], shared: Sequence[Shared] = ()):
        self.identity = identity
        self.options = dict(options)
        self.layers = list(stores)
        self.shared = list(shared)
        self.max_chunk: int | None = None  # an engine that must act between blocks caps the block size

    @property
    def position(self) -> int:
        return self.layers[0].end if self.layers else 0

    def reserve(self, positions: int) -> None:
        for s in self.layers:
            s.reserve(positions)

    def fork_from(self, parent: "EngineState") -> None:
        """Become a branch of `parent` (this a fresh state's twin, `parent` holding a prompt): every
        layer forks (`LayerStore.fork`)."""
        for mine, theirs in zip(self.layers, parent.layers):
            mine.fork(theirs)

    def keep_rollback(self, n: int) -> None:
        """Let every layer be trimmed back `n` positions (`LayerStore.keep_rollback`)."""
        for s in self.layers:
            s.keep_rollback(n)

    def quiet_rows(self, n: int) -> int:
        """How many of the next `n` rows can be appended with no decision of the engine's at any of
        their ends (cells/v1: a cell demoted under the budget, or evicted below a window). Trimmed
        back among such rows, a state is exactly the state plain decode leaves there: speculation
        proposes only that far."""
        return min((part.quiet_rows(n, self.position) for part in self.shared), default=n)

    def can_trim(self, end: int) -> bool:
        return all(s.can_trim(end) for s in self.layers)

    def trim(self, end: int) -> None:
        """Forget positions from `end` on, in every layer (`can_trim` said it can)."""
        for s in self.layers:
            s.trim(end)

    def shrink(self, target: int) -> bool:
        return any([part.shrink(target) for part in self.shared])

    def unshrink(self) -> None:
        for part in self.shared:
            part.unshrink()

    def end_block(self) -> None:
        """The model's hook after its layer loop: shared parts act once per block."""
        for part in self.shared:
            part.end_block()

    def resident_bytes(self) -> int:
        return sum(s.resident_bytes() for s in self.layers) + sum(p.nbytes() for p in self.shared)

    def resident_by_kind(self) -> dict[str, int]:
        """Rows' bytes per layer kind, plus shared buffers under "scratch" when there are any."""
        out: dict[str, int] = {}
        for s in self.layers:
            out[s.geometry.kind] = out.get(s.geometry.kind, 0) + s.resident_bytes()
        if self.shared:
            out["scratch"] = sum(p.nbytes() for p in self.shared)
        return out

    def retained_rows(self) -> int:
        return sum(end - base for base, end in (s.retained() for s in self.layers))

    def report(self) -> dict:
        out: dict = {}
        for part in self.shared:
            out.update(part.report())
        return out
