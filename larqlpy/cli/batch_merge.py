"""`larqlpy batch-merge`: the shards of a batch (`batch --shard I/N`) as one output, in input order."""

from __future__ import annotations

from pathlib import Path
from typing import List

import typer

from larqlpy.cli.common import err
from larqlpy.errors import LarqlError


def batch_merge(
    shards: List[Path] = typer.Argument(..., help="the shards' outputs"),
    output: Path = typer.Option(..., "-o", "--output", help="the merged output"),
    infile: Path = typer.Option(..., "--input", help="the input the shards were cut from: "
                                "every line must be answered once"),
):
    """Merge shard outputs in input order, checking that every input line has exactly one record
    (matched by line number and line hash). Exit 1 when a record is an error, as batch does."""
    from larqlpy.batch.lines import line_hash, read_records, split_lines
    from larqlpy.cli.batch import write_sorted
    from larqlpy.files import BATCH_LIMIT, check_output, read_bytes

    check_output(output, "-o", inputs=[*shards, infile])
    items = split_lines(read_bytes(infile, "--input", BATCH_LIMIT))
    want = {n: line_hash(line) for n, line in items}
    seen: dict[int, tuple[Path, dict]] = {}
    for path in shards:
        if not path.is_file():
            raise LarqlError(f"{path}: no such shard output")
        for rec in read_records(path, strict=True)[0]:
            n = rec["line"]
            if n in seen:
                raise LarqlError(f"line {n} has a record in both {seen[n][0]} and {path}")
            if want.get(n) != rec["line_hash"]:
                raise LarqlError(f"{path}: the record of line {n} answers another line than {infile}'s line {n}")
            seen[n] = (path, rec)
    missing = [n for n in want if n not in seen]
    if missing:
        head = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise LarqlError(f"{len(missing)} of {len(want)} lines of {infile} have no record in these shards "
                         f"(lines {head}): a shard is missing or did not finish")
    records = [rec for _, rec in seen.values()]
    write_sorted(output, records)
    failed = sum(r["error"] is not None for r in records)
    if failed:
        err.print(f"larqlpy: {failed} of {len(records)} lines failed", markup=False)
    raise typer.Exit(1 if failed else 0)
