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

from larqlpy.batch_lines import Item, error_records, line_records
from larqlpy.errors import LarqlError
from larqlpy.tools.batch_run import Setup, Show

NAMESPACE = "larqlpy"


class LineActor:
    """One model in one actor process: runs chunks of lines, continuously batched."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.loaded = setup.load()
        self.slots = setup.slots(self.loaded, setup.threads or 1)

    def run(self, items: list[Item]) -> list[tuple[int, dict]]:
        return list(line_records(self.loaded, items, self.slots, self.setup.kv_budget))


def ray_records(address: str, setup: Setup, items: list[Item], show: Show, actors: int = 1,
                actor_cpus: int = 1, retries: int = 2, chunk: int | None = None,
                on_replace: Callable[[str], None] = lambda name: None) -> Iterator[tuple[int, dict]]:
    """(line, record) for every item, from `actors` Ray actors of `actor_cpus` CPUs each;
    `on_replace(name)` hears of each actor that died and was replaced.
    `address`: "local" starts a cluster in this process, "auto" joins the one this machine belongs
    to, anything else is a cluster address (host:port, or ray://host:port)."""
    try:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, WorkerCrashedError
    except ImportError:
        raise LarqlError("--ray needs Ray: pip install 'larqlpy[ray]'") from None
    setup = dataclasses.replace(setup, threads=setup.threads or actor_cpus)
    died = (RayActorError, ActorDiedError, ActorUnavailableError, WorkerCrashedError)
    if not ray.is_initialized():
        kw = {"num_cpus": actors * actor_cpus} if address == "local" else {"address": address}
        try:
            ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, **kw)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise LarqlError(f"--ray {address}: cannot reach a Ray cluster ({e})") from None
    remote = ray.remote(num_cpus=actor_cpus, max_restarts=0, max_task_retries=0)(LineActor)
    size = chunk or max(1, 2 * (setup.parallel or 4 * setup.threads))
    chunks = deque((items[i:i + size], 0) for i in range(0, len(items), size))
    generation = [0] * actors

    def start(slot: int):
        generation[slot] += 1
        return remote.options(name=f"batch-{slot}-{generation[slot]}").remote(setup)

    pool = [start(i) for i in range(actors)]
    inflight: dict = {}  # ref -> (slot, generation, chunk, tries)
    tokens = 0

    def feed(slot: int) -> None:
        while chunks and sum(1 for s, *_ in inflight.values() if s == slot) < 2:  # one running, one queued
            part, tries = chunks.popleft()
            inflight[pool[slot].run.remote(part)] = (slot, generation[slot], part, tries)

    try:
        for slot in range(actors):
            feed(slot)
        while inflight:
            ready, _ = ray.wait(list(inflight), num_returns=1)
            ref = ready[0]
            slot, gen, part, tries = inflight.pop(ref)
            try:
                results = ray.get(ref)
            except died:
                if gen == generation[slot]:  # the first of its calls to fail: replace the actor once
                    ray.kill(pool[slot], no_restart=True)
                    on_replace(f"batch-{slot}-{gen}")
                    pool[slot] = start(slot)
                if tries + 1 > retries:
                    yield from error_records(part, f"its Ray actor died {tries + 1} times running it")
                else:
                    chunks.appendleft((part, tries + 1))
                feed(slot)
                continue
            for lineno, rec in results:
                tokens += len(rec["tokens"] or ())
                yield lineno, rec
            show(sum(1 for _ in inflight), tokens, actors)
            feed(slot)
    finally:
        for a in pool:
            ray.kill(a, no_restart=True)
