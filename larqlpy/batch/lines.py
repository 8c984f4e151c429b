"""Batch lines: one JSON request per line, one record per line. What a local batch, its worker
processes and Ray actors share: parsing a line, running lines continuously batched, and reading
back the records an output file already holds (to resume, or to merge shards).

A record carries `line` (its 1-based line number in the input) and `line_hash` (of the line's
bytes), so a record is matched to the very line it answers: an edited input line is run again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from larqlpy.errors import LarqlError
from larqlpy.files import check_fields, utf8
from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import error_record, execute_many
from larqlpy.weights.loader import LoadedModel

Item = tuple[int, bytes]  # (line number, the line's bytes)


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line.rstrip(b"\r")).hexdigest()[:16]


def split_lines(data: bytes) -> list[Item]:
    """The non-blank lines, numbered from 1 as they stand in the input."""
    return [(i + 1, line) for i, line in enumerate(data.splitlines()) if line.strip()]


def parse_line(lineno: int, line: bytes) -> tuple[Any, Request | str]:
    """A line as (id, Request), or (id, the refusal) when it is not a valid request."""
    rid = None
    try:
        raw = json.loads(utf8(line, "the line"))
        if isinstance(raw, dict):
            rid = raw.get("id", lineno)
            raw = {**raw, "id": rid}
            check_fields(raw)
        return rid, Request.from_dict(raw)
    except json.JSONDecodeError as e:
        msg = f"line {lineno}: not valid JSON ({e.msg})"
    except RecursionError:
        msg = f"line {lineno}: not valid JSON (nested too deeply)"
    except LarqlError as e:
        msg = f"line {lineno}: {e}"  # batch lines speak the library's names (the JSON keys)
    return rid if rid is not None else lineno, msg


def line_records(loaded: LoadedModel, items: Iterable[Item], parallel: int | None, kv_budget: int | None,
                 on_step: Callable | None = None) -> Iterator[tuple[int, dict]]:
    """(line, record) for each (line, bytes) as it finishes, continuously batched."""
    ids: dict[int, tuple[Any, str]] = {}

    def keyed():
        for lineno, line in items:
            rid, req = parse_line(lineno, line)
            ids[lineno] = (rid, line_hash(line))
            yield lineno, req

    for lineno, rec in execute_many(loaded, keyed(), parallel, kv_budget, on_step=on_step):
        yield lineno, _stamp(rec, lineno, *ids.pop(lineno))


def error_records(items: Iterable[Item], message: str) -> list[tuple[int, dict]]:
    """Records for lines that could not be run at all (e.g. the process running them kept dying)."""
    return [(lineno, _stamp(error_record(None, message), lineno, parse_line(lineno, line)[0], line_hash(line)))
            for lineno, line in items]


def _stamp(rec: dict, lineno: int, rid: Any, digest: str) -> dict:
    """A record as a batch writes it: its id, line and line hash, its error naming the line."""
    if rec["error"] is not None and not rec["error"].startswith(f"line {lineno}:"):
        rec = {**rec, "error": f"line {lineno}: {rec['error']}"}
    return {**rec, "id": rid if rid is not None else lineno, "line": lineno, "line_hash": digest}


def read_records(path: str | os.PathLike, strict: bool) -> tuple[list[dict], int]:
    """The complete records of a batch output file, and the byte length they cover. A last line
    without its newline is a record cut off mid-write: dropped (`strict`: refused). A line that is
    not a record is refused either way: the file is not a batch output."""
    data = Path(path).read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data) and strict:
        raise LarqlError(f"{path}: its last record is incomplete (the run that wrote it did not finish)")
    records = []
    for n, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LarqlError(f"{path}: line {n} is not a JSON record; is this a batch output?") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("line"), int) or \
                not isinstance(rec.get("line_hash"), str):
            raise LarqlError(f"{path}: line {n} has no \"line\" and \"line_hash\"; is this a batch output?")
        records.append(rec)
    return records, end


def matching(records: list[dict], items: list[Item]) -> dict[int, dict]:
    """The records that answer these input lines as they are now (same number, same hash)."""
    want = {lineno: line_hash(line) for lineno, line in items}
    return {r["line"]: r for r in records if want.get(r["line"]) == r["line_hash"]}


def parse_shard(text: str) -> tuple[int, int]:
    """"I/N" -> (I, N): the lines whose number is I modulo N."""
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise LarqlError(f"`shard`: expected I/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise LarqlError(f"`shard`: I/N needs N >= 1 and 0 <= I < N, got {text!r}")
    return i, n
