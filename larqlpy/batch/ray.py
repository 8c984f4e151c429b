"""A batch on a Ray cluster: actors that each load the model once and run batched decode over
chunks of lines; the driver streams their records back to the one writer.

An actor that dies (a node lost, `ray.kill`, out of memory) is replaced and the chunks it held are
run again, at most `retries` times; after that their lines become error records. A chunk's records
are taken once, when its call returns: nothing is lost and nothing is written twice. Ray is an
optional dependency (`pip install 'larqlpy[ray]'`), imported only here.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Iterator

from larqlpy.batch.lines import Item, error_records, line_records
from larqlpy.batch.local import Setup, Show
from larqlpy.errors import LarqlError

NAMESPACE = "larqlpy"


class LineActor:
    """One model in one actor process: runs chunks of lines, continuously batched."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.loaded = setup.load()
        self.slots = setup.slots(self.loaded, setup.threads or 1)

    def run(self, items: list[Item]) -> list[tuple[int, dict]]:
        return list(line_records(self.loaded, items, self.slots, self.setup.kv_budget))


def ray_records(ray_address: str, setup: Setup, items: list[Item], show: Show, actors: int = 1,
                actor_cpus: int = 1, retries: int = 2, chunk: int | None = None,
                on_replace: Callable[[str], None] = lambda name: None) -> Iterator[tuple[int, dict]]:
    """(line, record) for every item, from `actors` Ray actors of `actor_cpus` CPUs each;
    `on_replace(name)` hears of each actor that died and was replaced.
    `ray_address`: "local" starts a cluster in this process, "auto" joins the one this machine belongs
    to, anything else is a cluster address (host:port, or ray://host:port)."""
    ray, died = connect(ray_address, actors * actor_cpus)
    setup = dataclasses.replace(setup, threads=setup.threads or actor_cpus)
    size = chunk or max(1, 2 * (setup.parallel or 4 * setup.threads))
    pool = _Pool(ray, setup, actors, actor_cpus, deque((items[i:i + size], 0) for i in range(0, len(items), size)))
    tokens = 0
    try:
        for slot in range(actors):
            pool.feed(slot)
        while pool.inflight:
            ready, _ = ray.wait(list(pool.inflight), num_returns=1)
            slot, gen, part, tries = pool.inflight.pop(ready[0])
            try:
                results = ray.get(ready[0])
            except died:
                if gen == pool.generation[slot]:  # the first of its calls to fail: replace the actor once
                    on_replace(pool.replace(slot))
                if tries + 1 > retries:
                    yield from error_records(part, f"its Ray actor died {tries + 1} times running it")
                else:
                    pool.chunks.appendleft((part, tries + 1))
                pool.feed(slot)
                continue
            for lineno, rec in results:
                tokens += len(rec["tokens"] or ())
                yield lineno, rec
            show(len(pool.inflight), tokens, actors)
            pool.feed(slot)
    finally:
        pool.close()


def connect(address: str, cpus: int):
    """Ray, connected (a cluster of `cpus` started here for "local"), and the errors of a lost actor."""
    try:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError
    except ImportError:
        raise LarqlError("`ray_address`: running on Ray needs Ray: pip install 'larqlpy[ray]'") from None
    if not ray.is_initialized():
        # a local cluster's workers at the driver's priority: Ray's default (nice 15) gives the model's
        # processes a thirtieth of a core's share beside any other busy process, the client's included
        kw = {"num_cpus": cpus, "_system_config": {"worker_niceness": 0}} if address == "local" else \
            {"address": address}
        try:
            ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, **kw)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise LarqlError(f"`ray_address` {address}: cannot reach a Ray cluster ({e})") from None
    return ray, (RayActorError, ActorDiedError, ActorUnavailableError, WorkerCrashedError)


class _Pool:
    """The actors, one per slot, and the chunks of lines they hold: one running and one queued each."""

    def __init__(self, ray, setup: Setup, actors: int, actor_cpus: int, chunks: deque):
        self.ray, self.setup, self.chunks = ray, setup, chunks
        self.remote = ray.remote(num_cpus=actor_cpus, max_restarts=0, max_task_retries=0)(LineActor)
        self.generation = [0] * actors
        self.actors = [self._start(i) for i in range(actors)]
        self.inflight: dict = {}  # ref -> (slot, generation, chunk, tries)

    def _start(self, slot: int):
        self.generation[slot] += 1
        return self.remote.options(name=f"batch-{slot}-{self.generation[slot]}").remote(self.setup)

    def replace(self, slot: int) -> str:
        """A new actor in the slot of one that died; the name of the one it replaces."""
        name = f"batch-{slot}-{self.generation[slot]}"
        self.ray.kill(self.actors[slot], no_restart=True)
        self.actors[slot] = self._start(slot)
        return name

    def feed(self, slot: int) -> None:
        while self.chunks and sum(1 for s, *_ in self.inflight.values() if s == slot) < 2:
            part, tries = self.chunks.popleft()
            self.inflight[self.actors[slot].run.remote(part)] = (slot, self.generation[slot], part, tries)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a, no_restart=True)
