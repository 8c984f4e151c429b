"""`larqlpy batch`: one request per JSON line, one result per line, in input order."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import typer

from larqlpy.cli.common import (ALLOW_UNUSED, DEVICE, DRAFT, DRAFT_TOKENS, DRAFT_WEIGHTS, DTYPE, KV_DTYPE, MONITOR,
                                MONITOR_PLOT, PRE_TOKENIZER, WEIGHTS, check_paths, err, model_home, monitored,
                                size_flag, speculation, started)
from larqlpy.engines.geometry import check_kv_dtype
from larqlpy.errors import LarqlError
from larqlpy.files import BATCH_LIMIT, atomic_write, check_output, read_bytes, read_limited


def batch(
    model: Path = typer.Argument(..., help="model directory or .gguf file"),
    infile: str = typer.Argument(..., help="JSON lines of requests, or - for stdin"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write results here (default stdout)"),
    parallel: Optional[int] = typer.Option(None, "--parallel", help="sequences decoded together in one process "
                                           "(default: 4 per core a process gets, at most 16; 16 on CUDA)"),
    workers: int = typer.Option(1, "--workers", help="processes, each mapping the same weights "
                                "and batching its own lines"),
    kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="KV all live sequences may hold together, "
                                            "e.g. 256MiB (split between the workers); lines wait for room"),
    resume_output: bool = typer.Option(False, "--resume-output", help="with -o: keep the records it already holds "
                                       "for unchanged lines, run the rest, append as they finish"),
    shard: Optional[str] = typer.Option(None, "--shard", help="I/N: only the lines whose number is I modulo N "
                                        "(a job array's task; merge with batch-merge)"),
    ray_address: Optional[str] = typer.Option(None, "--ray", help="run on Ray actors: local | auto | ADDRESS"),
    actors: int = typer.Option(1, "--actors", help="with --ray: actors, each loading the model once"),
    actor_cpus: int = typer.Option(1, "--actor-cpus", help="with --ray: CPUs per actor (its threads)"),
    worker_model: Optional[str] = typer.Option(None, "--worker-model", help="with --ray: MODEL's path as the "
                                               "workers see it (default: the same path)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
    monitor: Optional[Path] = MONITOR,
    monitor_plot: Optional[Path] = MONITOR_PLOT,
    device: str = DEVICE,
    dtype: str = DTYPE,
    weights: Optional[str] = WEIGHTS,
    kv_dtype: Optional[str] = KV_DTYPE,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
    draft: Optional[Path] = DRAFT,
    draft_tokens: Optional[int] = DRAFT_TOKENS,
    draft_weights: Optional[str] = DRAFT_WEIGHTS,
):
    """Run one request per input line; one result per output line, in input order.

    A line: {"prompt": ... or "messages": [...], "id": ..., "max_tokens": ..., "temperature"/"top_k"/
    "top_p"/"seed": ..., "stop": "..." or [...], "engine" or "continuation" + "options": {...},
    "kv_budget" (that line's cells/v1 budget), "resume", "save_state"}. Lines run continuously batched, --parallel at a
    time per process. A bad line yields a record with "error" and the rest go on; the exit code is
    1 when any line failed."""
    budget, part = checked(model, infile, output, workers, ray_address, actors, actor_cpus, worker_model,
                           resume_output, kv_budget, shard, parallel, monitor, monitor_plot, pre_tokenizer)
    check_kv_dtype(kv_dtype)
    speculation(draft, draft_tokens, 0, draft_weights=draft_weights)
    items = read_lines(infile, part)
    from larqlpy.batch.local import Setup, cores

    procs = actors if ray_address is not None else workers
    run = _Run(Setup(str(model), device, dtype, weights, kv_dtype, parallel, budget // procs if budget else None,
                     max(1, cores() // workers) if workers > 1 else None, allow_unused_tensors,
                     str(draft) if draft else None, draft_tokens, draft_weights, pre_tokenizer),
               workers, ray_address, actors, actor_cpus, worker_model)
    if resume_output:
        failed = run.resumed(output, items, quiet, monitor, monitor_plot)
    else:
        with atomic_text(output) if output else nullcontext(sys.stdout) as sink:
            failed = run.all(sink, items, {}, quiet, monitor, monitor_plot)
    if failed and not quiet:
        err.print(f"larqlpy: {failed} of {len(items)} lines failed", markup=False)
    raise typer.Exit(1 if failed else 0)


def checked(model, infile, output, workers, ray_address, actors, actor_cpus, worker_model, resume_output,
            kv_budget, shard, parallel, monitor, monitor_plot,
            pre_tokenizer) -> tuple[int | None, tuple[int, int] | None]:
    """Every refusal the flags can make, before any weights load; the KV budget in bytes and the shard."""
    from larqlpy.batch.lines import parse_shard
    from larqlpy.config import BatchConfig
    from larqlpy.model.families import read_config

    if workers < 1:
        raise LarqlError(f"--workers must be >= 1, got {workers}")
    if ray_address is None and (actors != 1 or actor_cpus != 1 or worker_model is not None):
        raise LarqlError("--actors, --actor-cpus and --worker-model go with --ray")
    if ray_address is not None and (workers != 1 or actors < 1 or actor_cpus < 1):
        raise LarqlError("--ray runs actors instead of --workers; --actors and --actor-cpus must be >= 1")
    if resume_output and output is None:
        raise LarqlError("--resume-output needs -o: it continues that file")
    budget = None if kv_budget is None else size_flag(kv_budget, "--kv-budget")
    part = parse_shard(shard) if shard is not None else None
    BatchConfig(parallel, budget)
    read_config(model_home(model, pre_tokenizer))  # a bad model directory is one line, not one error per request
    check_paths(monitor, monitor_plot)
    if output is not None:
        check_output(output, "-o", inputs=[] if infile == "-" else [infile])
    return budget, part


def read_lines(infile: str, part: tuple[int, int] | None) -> list:
    """The input's lines (each decoded on its own: one that is not UTF-8 is an error record, the
    others run), only this shard's."""
    from larqlpy.batch.lines import split_lines

    if infile == "-":
        data = read_limited(getattr(sys.stdin, "buffer", sys.stdin), BATCH_LIMIT, "stdin")
        data = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    else:
        data = read_bytes(infile, "", BATCH_LIMIT)
    items = split_lines(data)
    return items if part is None else [(n, line) for n, line in items if n % part[1] == part[0]]


@contextmanager
def atomic_text(path: Path):
    """The output file, written through a temp file: a killed run leaves the previous one intact."""
    with atomic_write(path, "-o") as f:
        text = io.TextIOWrapper(f, encoding="utf-8")
        yield text
        text.flush()
        text.detach()  # the binary file is closed by atomic_write, after it is fsynced


def write_sorted(path: Path, records: list[dict]) -> None:
    with atomic_text(path) as f:
        for r in sorted(records, key=lambda r: r["line"]):
            f.write(json.dumps(r) + "\n")


class _Run:
    """Every line's record into the sink, from this process, worker processes or Ray actors."""

    def __init__(self, setup, workers, ray_address=None, actors=1, actor_cpus=1, worker_model=None):
        started()  # the weights load with the first lines: the long-lived imports are in
        self.setup = setup
        self.workers, self.ray_address, self.actors, self.actor_cpus = workers, ray_address, actors, actor_cpus
        self.worker_model = worker_model

    def resumed(self, output: Path, items, quiet, monitor, monitor_plot) -> int:
        """--resume-output: keep OUT's records for unchanged lines (a record cut off mid-write and
        records of edited lines are dropped), append the rest as they finish, and end with every
        record in input order."""
        from larqlpy.batch.lines import matching, read_records

        kept = matching(read_records(output, strict=False)[0], items) if output.exists() else {}
        write_sorted(output, list(kept.values()))  # what is kept, nothing half-written, before the work
        todo = [(n, line) for n, line in items if n not in kept]
        with open(output, "a", encoding="utf-8") as sink:
            failed = self.all(sink, todo, {}, quiet, monitor, monitor_plot, ordered=False)
            os.fsync(sink.fileno())
        records, _ = read_records(output, strict=True)
        write_sorted(output, list(matching(records, items).values()))
        return failed + sum(r["error"] is not None for r in kept.values())

    def all(self, sink, items, ready, quiet, monitor, monitor_plot, ordered: bool = True) -> int:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        failed, next_line = 0, iter([n for n, _ in items])
        want = next(next_line, None)
        t0 = time.perf_counter()
        with monitored(monitor, monitor_plot) as mon, \
                Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[speed]}"),
                         TimeElapsedColumn(), console=err, disable=not (err.is_terminal and not quiet)) as bar:
            task = bar.add_task("batch", total=len(items), speed="")
            what = "actors" if self.ray_address else "processes"

            def show(live: int, tokens: int, alive: int):
                bar.update(task, speed=f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s, {live} live"
                                       + (f", {alive} {what}" if self.ray_address or self.workers > 1 else ""))

            def put(r):
                nonlocal failed
                failed += r["error"] is not None
                sink.write(json.dumps(r) + "\n")
                sink.flush()
                bar.advance(task)
                mon.position += 1  # lines done

            for lineno, rec in self.records(items, show):
                if not ordered:  # appended as they finish; sorted at the end
                    put(rec)
                    continue
                ready[lineno] = rec
                while want in ready:  # output follows the input
                    put(ready.pop(want))
                    want = next(next_line, None)
        return failed

    def records(self, items, show):
        from larqlpy.batch.local import local_records, worker_records

        if self.ray_address is not None:
            from larqlpy.batch.ray import ray_records

            setup = dataclasses.replace(self.setup, model=self.worker_model or str(Path(self.setup.model).resolve()))
            def replaced(name: str) -> None:
                err.print(f"larqlpy: Ray actor {name} died: replaced; the lines it held run again", markup=False)

            return ray_records(self.ray_address, setup, items, show, self.actors, self.actor_cpus, on_replace=replaced)
        if self.workers == 1:
            return local_records(self.setup, items, show)
        return worker_records(self.setup, self.workers, items, show)
