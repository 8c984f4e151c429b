"""One budget of KV bytes for a process: what `batch --kv-budget` and `serve --kv-budget` set.

Live sequences reserve, when they join, the KV they may grow to (their engine's accounting at
prompt + max_tokens positions; their states preallocate it, so resident KV never passes what was
reserved); kept states (a server's prefix cache) live in what the reservations leave, and are pushed
out -- quantized, persisted -- as live sequences join. A request's own `kv_budget` is another thing:
the budget of its cells/v1 state (pipeline/request.py).
"""

from __future__ import annotations

from typing import Any, Callable

from larqlpy.errors import LarqlError


class KVBudget:
    def __init__(self, limit: int | None = None):
        if limit is not None and limit < 1:
            raise LarqlError(f"`kv_budget` must be positive, got {limit}")
        self.limit = limit
        self.live: dict[Any, int] = {}  # owner -> bytes reserved
        self.on_reserve: Callable[[], None] | None = None  # the kept states make room (PrefixCache.enforce)

    def reserved(self) -> int:
        return sum(self.live.values())

    def refusal(self, peak: int, positions: int) -> str | None:
        """Why a sequence of `peak` bytes can never join (more than the whole budget), or None."""
        if self.limit is None or peak <= self.limit:
            return None
        return (f"needs {peak:,} bytes of KV at {positions:,} positions, more than the whole budget of "
                f"{self.limit:,} bytes")

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit beside what the live sequences reserved."""
        return self.limit is None or self.reserved() + nbytes <= self.limit

    def reserve(self, owner: Any, nbytes: int) -> None:
        self.live[owner] = nbytes
        if self.on_reserve is not None:
            self.on_reserve()

    def release(self, owner: Any) -> None:
        self.live.pop(owner, None)

    def left(self) -> int | None:
        """What kept states may hold now (None: no limit)."""
        return None if self.limit is None else max(0, self.limit - self.reserved())
