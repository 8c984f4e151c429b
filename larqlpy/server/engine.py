"""The server's engine: one thread stepping the scheduler for every request, the prefix cache of
kept states, and the bridge to asyncio (each request's events arrive on its own asyncio queue).

The scheduler and the cache are touched only by the engine thread. After every step it publishes a
`Snapshot` of what /health and /metrics show; they read that, never the scheduler.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from larqlpy.budget import KVBudget
from larqlpy.decode.scheduler import Event, Scheduler
from larqlpy.decode.sequence import Sequence
from larqlpy.state.prefix_cache import PrefixCache
from larqlpy.weights.loader import LoadedModel


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Handle:
    """One request inside the server: its sequence, and the asyncio queue its events arrive on --
    ("token", Token) ..., then ("done", the sequence), ("error", message) or, at shutdown, ("cut",
    the sequence)."""

    def __init__(self, seq: Sequence, loop: asyncio.AbstractEventLoop):
        self.seq, self.loop, self.events = seq, loop, asyncio.Queue()
        self.t0 = time.perf_counter()


@dataclass(frozen=True)
class Snapshot:
    """What the engine thread publishes after each step."""

    live: int = 0  # sequences decoding or prefilling
    waiting: int = 0  # requests inside the server that are not live yet
    live_kv_by_kind: dict = field(default_factory=dict)
    kept: dict = field(default_factory=dict)  # PrefixCache.stats()

    @property
    def live_kv_bytes(self) -> int:
        return sum(self.live_kv_by_kind.values())


class ServeEngine:
    def __init__(self, loaded: LoadedModel, cache: PrefixCache, budget: KVBudget, parallel: int | None = None,
                 queue_size: int = 64):
        self.loaded, self.cache, self.queue_size = loaded, cache, queue_size
        self.sched = Scheduler(loaded.model, parallel, budget)
        self.parallel = self.sched.parallel
        self.inbox: queue.Queue = queue.Queue()
        self.handles: dict[Sequence, Handle] = {}
        self.lock = threading.Lock()  # the engine thread's work against shutdown's
        self.accepting, self.running = True, True
        self.snapshot = Snapshot(kept=cache.stats())
        self.kept_version = cache.version
        self.thread = threading.Thread(target=self._loop, name="larqlpy-engine", daemon=True)
        self.thread.start()

    # -- the asyncio side -----------------------------------------------------------------------
    def submit(self, seq: Sequence) -> Handle:
        if not self.accepting:
            raise ShuttingDown()
        if len(self.handles) >= self.parallel + self.queue_size:
            raise QueueFull()
        h = Handle(seq, asyncio.get_running_loop())
        self.handles[seq] = h
        self.inbox.put(("new", h))
        return h

    def cancel(self, h: Handle) -> None:
        """The client went away: free its slot (its state is kept for a later request)."""
        if h.seq in self.handles:
            self.inbox.put(("cancel", h))

    def drain(self) -> None:
        """Shutting down: no new requests; those in flight go on."""
        self.accepting = False

    def cut_off(self) -> None:
        """The drain's time is up: every request still in flight ends now ("cut"), its state kept."""
        self.inbox.put(("cut", None))

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
                if not self.sched.idle():
                    for e in self.sched.step():
                        self._event(e)
                self._publish()

    def _take(self, what: str, h: Handle | None) -> None:
        if what == "new":
            self.sched.submit(h.seq)
        elif what == "cut":
            for h in list(self.handles.values()):
                self._drop(h.seq)
                self._deliver(h, ("cut", h.seq))
            self.handles.clear()
        elif self.handles.pop(h.seq, None) is not None:
            self._drop(h.seq)

    def _event(self, e: Event) -> None:
        h = self.handles.get(e.seq)
        if h is None:
            return
        if e.token is not None:
            self._deliver(h, ("token", e.token))
            return
        del self.handles[e.seq]
        if e.seq.error is not None:
            self._deliver(h, ("error", e.seq.error))
            return
        self.cache.put(e.seq.held())
        self._deliver(h, ("done", e.seq))

    def _drop(self, seq: Sequence) -> None:
        """Out of the scheduler before it finished; the positions it processed are kept."""
        if self.sched.cancel(seq) and seq.state is not None:
            self.cache.put(seq.held())

    def _publish(self) -> None:
        by_kind: Counter = Counter()
        for s in self.sched.live:
            by_kind.update(s.state.resident_by_kind())
        kept = self.snapshot.kept
        if self.cache.version != self.kept_version:  # the kept states' figures only when they moved
            kept, self.kept_version = self.cache.stats(), self.cache.version
        self.snapshot = Snapshot(len(self.sched.live), max(0, len(self.handles) - len(self.sched.live)),
                                 dict(by_kind), kept)

    @staticmethod
    def _deliver(h: Handle, item) -> None:
        try:
            h.loop.call_soon_threadsafe(h.events.put_nowait, item)
        except RuntimeError:  # its event loop is gone (shutdown)
            pass

    # -- shutdown -------------------------------------------------------------------------------
    def stop(self, grace_s: float) -> None:
        """No new requests; in-flight ones finish within `grace_s`, the rest are cut off with their
        states kept; then the kept states go to disk (with a state directory)."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while self.handles and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.lock:
            for h in list(self.handles.values()):
                self._drop(h.seq)
                self._deliver(h, ("error", "the server is shutting down"))
            self.handles.clear()
            self.running = False
        self.thread.join(timeout=5)
        with self.lock:
            if self.cache.state_dir is not None:
                self.cache.save_all()
            self.cache.close()
