"""Where a batch's records come from: this process, or worker processes on this machine (Ray: see
ray_batch.py). Each yields (line, record) as lines finish, in any order, and reports progress
through `show(live sequences, tokens generated, processes alive)`."""

from __future__ import annotations

import multiprocessing as mp
import queue
from dataclasses import dataclass
from typing import Callable, Iterator

from larqlpy.batch.lines import Item, line_records
from larqlpy.config import default_parallel
from larqlpy.errors import LarqlError
from larqlpy.kernels.threads import cores, use_cores
from larqlpy.weights.loader import LoadedModel, load_with_draft

Show = Callable[[int, int, int], None]


@dataclass(frozen=True)
class Setup:
    """How each process loads the model and batches its lines."""

    model: str
    device: str = "auto"
    dtype: str = "float32"
    weights: str | None = None  # None: what the files hold
    kv_dtype: str | None = None  # None: the weights' default (engines.geometry.default_kv_dtype)
    parallel: int | None = None
    kv_budget: int | None = None  # per process
    threads: int | None = None  # torch and numba threads; None: all this process may use
    allow_unused_tensors: bool = False
    draft: str | None = None  # a draft model for speculative decoding
    draft_tokens: int | None = None  # its proposals a step, for lines that do not say
    draft_weights: str | None = None  # its weights (None: what its files hold)
    pre_tokenizer: str | None = None  # a GGUF's text split as this llama.cpp name does

    def load(self):
        use_cores(self.threads)  # worker processes share the cores this one may use
        return load_with_draft(self.model, self.draft, self.draft_tokens, self.draft_weights, device=self.device,
                               dtype=self.dtype, weights=self.weights, kv_dtype=self.kv_dtype,
                               allow_unused_tensors=self.allow_unused_tensors, pre_tokenizer=self.pre_tokenizer)

    def slots(self, loaded: LoadedModel, cores: int) -> int:
        return self.parallel or default_parallel(cores, 1, loaded.device.type)


def local_records(setup: Setup, items: list[Item], show: Show) -> Iterator[tuple[int, dict]]:
    loaded = setup.load()

    def tick(sched):
        show(len(sched.live), sched.generated, 1)

    yield from line_records(loaded, items, setup.slots(loaded, setup.threads or cores()), setup.kv_budget, tick)


def _worker(wid: int, setup: Setup, tasks, results) -> None:
    """One worker process: pulls lines from `tasks` while it has free slots, puts records and
    progress ticks on `results`."""
    try:
        loaded = setup.load()
    except Exception as e:  # the parent reports it once
        results.put(("failed", wid, str(e) if isinstance(e, LarqlError) else f"{type(e).__name__}: {e}"))
        return

    def lines():
        while (item := tasks.get()) is not None:
            yield item

    def tick(sched):
        results.put(("tick", wid, (len(sched.live), sched.generated)))

    for lineno, rec in line_records(loaded, lines(), setup.slots(loaded, setup.threads or 1), setup.kv_budget, tick):
        results.put(("record", lineno, rec))
    results.put(("done", wid, None))


def worker_records(setup: Setup, workers: int, items: list[Item], show: Show) -> Iterator[tuple[int, dict]]:
    """`workers` processes, each mapping the same weights, taking lines from one shared queue when a
    slot of theirs is free."""
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for item in items:
        tasks.put(item)
    for _ in range(workers):
        tasks.put(None)
    procs = [ctx.Process(target=_worker, args=(w, setup, tasks, results), daemon=True) for w in range(workers)]
    for p in procs:
        p.start()
    done, live = 0, {}
    try:
        while done < workers:
            try:
                kind, a, b = results.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise LarqlError("a worker process died (out of memory?); the lines it held have no record")
                continue
            if kind == "record":
                yield a, b
            elif kind == "tick":
                live[a] = b
                show(sum(v[0] for v in live.values()), sum(v[1] for v in live.values()), workers - done)
            elif kind == "failed":
                raise LarqlError(b)
            else:
                done += 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
