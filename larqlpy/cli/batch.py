"""`larqlpy batch`: one request per JSON line, one result per line, in input order."""

from __future__ import annotations

import io
import json
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional

import typer

from larqlpy.cli.common import DEVICE, DTYPE, MONITOR, MONITOR_PLOT, WEIGHTS, check_paths, err, monitored
from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write, check_output, read_bytes, utf8

_WORKER: dict = {}


def _worker_init(model: str, device: str, dtype: str, weights: str) -> None:
    from larqlpy.model.loader import load

    _WORKER["loaded"] = load(model, device=device, dtype=dtype, weights=weights)  # float32 on CPU maps the file: pages are shared


def _run_line(item: tuple[int, bytes]) -> dict:
    from larqlpy.request import Request
    from larqlpy.runner import execute

    lineno, line = item
    rid = None
    try:
        raw = json.loads(utf8(line, "the line"))
        if isinstance(raw, dict):
            rid = raw.get("id", lineno)
            raw = {**raw, "id": rid}
        return {**execute(_WORKER["loaded"], Request.from_dict(raw)), "line": lineno}
    except json.JSONDecodeError as e:
        msg = f"line {lineno}: not valid JSON ({e.msg})"
    except RecursionError:
        msg = f"line {lineno}: not valid JSON (nested too deeply)"
    except LarqlError as e:
        msg = f"line {lineno}: {e}"  # batch lines speak the library's names (the JSON keys)
    except Exception as e:  # one bad line must not take the others down
        msg = f"line {lineno}: {type(e).__name__}: {e}"
    return {"id": rid if rid is not None else lineno, "line": lineno, "text": None, "tokens": None,
            "stats": None, "error": msg}


def batch(
    model: Path = typer.Argument(..., help="model directory"),
    infile: str = typer.Argument(..., help="JSON lines of requests, or - for stdin"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write results here (default stdout)"),
    workers: int = typer.Option(1, "--workers", help="processes, each mapping the same weights"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
    monitor: Optional[Path] = MONITOR,
    monitor_plot: Optional[Path] = MONITOR_PLOT,
    device: str = DEVICE,
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
):
    """Run one request per input line; one result per output line, in input order.

    A line: {"prompt": ..., "id": ..., "max_tokens": ..., "temperature"/"top_k"/"top_p"/"seed": ...,
    "engine" or "continuation" + "options": {...}, "kv_budget", "resume", "save_state"}. A bad line
    yields a record with "error" and the rest go on; the exit code is 1 when any line failed."""
    from larqlpy.model.families import read_config

    if workers < 1:
        raise LarqlError(f"--workers must be >= 1, got {workers}")
    read_config(model)  # a bad model directory is one line, not one error per request
    check_paths(monitor, monitor_plot)
    if output is not None:
        check_output(output, "-o", inputs=[] if infile == "-" else [infile])
    if infile == "-":
        data = getattr(sys.stdin, "buffer", sys.stdin).read()
        data = data.encode("utf-8", "surrogateescape") if isinstance(data, str) else data
    else:
        data = read_bytes(infile)
    # each line is decoded on its own: one that is not UTF-8 is an error record, the others run
    items = [(i + 1, line) for i, line in enumerate(data.splitlines()) if line.strip()]
    with atomic_text(output) if output else nullcontext(sys.stdout) as sink:
        failed = _run(sink, items, str(model), workers, quiet, monitor, monitor_plot, device, dtype, weights)
    if failed and not quiet:
        err.print(f"larqlpy: {failed} of {len(items)} lines failed", markup=False)
    raise typer.Exit(1 if failed else 0)


@contextmanager
def atomic_text(path: Path):
    """The output file, written through a temp file: a killed run leaves the previous one intact."""
    with atomic_write(path, "-o") as f:
        text = io.TextIOWrapper(f, encoding="utf-8")
        yield text
        text.flush()
        text.detach()  # the binary file is closed by atomic_write, after it is fsynced


def _run(sink, items, model, workers, quiet, monitor, monitor_plot, device, dtype, weights) -> int:
    """Every line's record into `sink`, in input order; returns how many failed."""
    import multiprocessing as mp

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    failed = 0
    with monitored(monitor, monitor_plot) as mon, \
            Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                     console=err, disable=not (err.is_terminal and not quiet)) as bar:
        task = bar.add_task("batch", total=len(items))
        if workers == 1:
            _worker_init(model, device, dtype, weights)
            results, pool = map(_run_line, items), None
        else:
            pool = mp.get_context("spawn").Pool(workers, _worker_init, (model, device, dtype, weights))
            results = pool.imap(_run_line, items)  # ordered: output follows the input
        try:
            for r in results:
                failed += r["error"] is not None
                sink.write(json.dumps(r) + "\n")
                sink.flush()
                bar.advance(task)
                mon.position += 1  # lines done
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    return failed
