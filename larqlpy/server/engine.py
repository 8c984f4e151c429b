"""The server's engine: one thread stepping the scheduler for every request, the prefix cache of
kept states, and the bridge to asyncio (each request's events arrive on its own asyncio queue).

The scheduler and the cache are touched only by the engine thread, under `lock`, which /metrics
also takes to read them.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

from larqlpy.config import BatchConfig, GenerationConfig
from larqlpy.engines import EngineSpec
from larqlpy.prefix_cache import PrefixCache
from larqlpy.scheduler import Event, Job, Scheduler


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


@dataclass
class Pending:
    """One request inside the engine."""

    key: int
    ids: list[int]
    spec: EngineSpec
    gen: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cached: int = 0  # prompt tokens a kept state already held
    refused: str | None = None  # why a matching kept state was not reused
    generated: list[int] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    first_token_s: float | None = None


class ServeEngine:
    def __init__(self, loaded, cache: PrefixCache, parallel: int | None = None, queue_size: int = 64):
        self.loaded, self.cache, self.queue_size = loaded, cache, queue_size
        self.sched = Scheduler(loaded.model, parallel, None, BatchConfig.step_tokens, loaded.tokenizer)
        self.inbox: queue.Queue = queue.Queue()
        self.pending: dict[int, Pending] = {}
        self.lock = threading.Lock()
        self.keys = itertools.count(1)
        self.accepting, self.running = True, True
        self.counts = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        self.thread = threading.Thread(target=self._loop, name="larqlpy-engine", daemon=True)
        self.thread.start()

    # -- the asyncio side -----------------------------------------------------------------------
    def submit(self, ids: list[int], spec: EngineSpec, gen: GenerationConfig) -> Pending:
        if not self.accepting:
            raise ShuttingDown()
        if len(self.pending) >= self.sched.parallel + self.queue_size:
            raise QueueFull()
        p = Pending(next(self.keys), list(ids), spec, gen, asyncio.get_running_loop(), asyncio.Queue())
        self.pending[p.key] = p
        self.inbox.put(("new", p))
        return p

    def cancel(self, p: Pending) -> None:
        """The client went away: free its slot (its state is kept for a later request)."""
        if p.key in self.pending:
            self.inbox.put(("cancel", p))

    def live(self) -> int:
        return len(self.sched.live)

    def waiting(self) -> int:
        return max(0, len(self.pending) - len(self.sched.live))

    # -- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while self.running:
            try:
                item = self.inbox.get(timeout=0.05 if self.sched.idle() else 0.0)
            except queue.Empty:
                item = None
            with self.lock:
                while item is not None:
                    self._take(*item)
                    try:
                        item = self.inbox.get_nowait()
                    except queue.Empty:
                        item = None
                if self.sched.idle():
                    continue
                try:
                    events = self.sched.step()
                except Exception as e:  # every sequence of the failed step gets the error; the server stays up
                    for seq in list(self.sched.live):
                        self._deliver(self.pending.pop(seq.job.key), ("error", f"{type(e).__name__}: {e}"))
                    self.sched.live.clear()
                    continue
                for e in events:
                    self._event(e)

    def _take(self, what: str, p: Pending) -> None:
        if what == "cancel":
            if self.pending.pop(p.key, None) is not None:
                self._drop(p)
            return
        reuse = self.cache.take(p.ids, p.spec)
        p.cached, p.refused = reuse.reused, reuse.refused
        self.counts["prompt_tokens"] += len(p.ids)
        self.counts["cached_tokens"] += reuse.reused
        self.sched.submit(Job(p.ids, p.spec, p.gen, frozenset(self.loaded.tokenizer.stop_ids), reuse.state,
                              reuse.logits, p.key))

    def _event(self, e: Event) -> None:
        p = self.pending.get(e.key)
        if p is None:
            return
        if e.token is not None:
            p.generated.append(e.token.id)
            self.counts["completion_tokens"] += 1
            if p.first_token_s is None:
                p.first_token_s = time.perf_counter() - p.t0
            self._deliver(p, ("token", e.token))
        if e.done:
            del self.pending[e.key]
            if e.error is not None:
                self._deliver(p, ("error", e.error))
                return
            self.cache.put(p.ids + p.generated, p.spec, e.state)
            self._deliver(p, ("done", None))

    def _drop(self, p: Pending) -> None:
        """Out of the scheduler before it finished; the positions it processed are kept."""
        state = self.sched.cancel(p.key)
        if state is not None:
            self.cache.put(p.ids + p.generated, p.spec, state)

    @staticmethod
    def _deliver(p: Pending, item) -> None:
        try:
            p.loop.call_soon_threadsafe(p.events.put_nowait, item)
        except RuntimeError:  # its event loop is gone (shutdown)
            pass

    # -- shutdown -------------------------------------------------------------------------------
    def stop(self, grace_s: float) -> None:
        """No new requests; in-flight ones finish within `grace_s`, the rest are cut off with their
        states kept; then the kept states go to disk (with a state directory)."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.lock:
            for p in list(self.pending.values()):
                self._drop(p)
                self._deliver(p, ("error", "the server is shutting down"))
            self.pending.clear()
            self.running = False
        self.thread.join(timeout=5)
        with self.lock:
            if self.cache.state_dir is not None:
                self.cache.save_all()
            self.cache.close()
