"""`larqlpy state inspect`: a saved attention state file, every checksum verified."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.table import Table

from larqlpy.cli.common import fmt_bytes, out

state_app = typer.Typer(no_args_is_help=True, help="Saved attention state files.")


@state_app.command("inspect")
def state_inspect(path: Path = typer.Argument(..., help="a state file written by --save-state"),
                  as_json: bool = typer.Option(False, "--json")):
    """Header, cells by state and layer, sizes. Verifies every checksum."""
    from larqlpy.state.format import load_state, summarize

    summary = summarize(load_state(path))
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    e = summary["engine"]
    opts = ",".join(f"{k}={v}" for k, v in sorted(e["options"].items()))
    out.print(f"{path}: {fmt_bytes(summary['bytes'])}, format {summary['format']}, engine {e['identity']}"
              f"{' [' + opts + ']' if opts else ''}", markup=False)
    out.print(f"tokens {summary['tokens']} (processed {summary['processed']}), model {summary['model_fingerprint']} "
              f"(--weights {summary['weights']} --kv-dtype {summary['kv_dtype']}), "
              f"tokenizer {summary['tokenizer_fingerprint']}", markup=False)
    t = Table()
    for col in ("layer", "kind", "retained", "cells (state precision: cells / positions / bytes)"):
        t.add_column(col)
    for layer in summary["layers"]:
        cells = "; ".join(f"{k}: {v['cells']} / {v['positions']} / {fmt_bytes(v['bytes'])}"
                          for k, v in layer["cells"].items())
        t.add_row(str(layer["index"]), layer["kind"], f"{layer['retained'][0]}-{layer['retained'][1]}", cells)
    out.print(t)
