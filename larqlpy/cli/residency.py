"""`larqlpy residency`: what each engine keeps after N positions, or the longest context a budget
fits -- accounted, no weights needed."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from larqlpy.cli.common import CONTINUATION, CONTINUATION_OPTION, fmt_bytes, one_engine, out, preset_flags, size_flag
from larqlpy.engines.geometry import check_kv_dtype
from larqlpy.errors import LarqlError


def residency(
    model: str = typer.Argument(..., help="model directory, .gguf file or named geometry "
                                                   "(gemma3-270m ... qwen3-8b: see --help)"),
    positions: Optional[int] = typer.Option(None, "--positions", help="sequence length to account for"),
    budget: Optional[str] = typer.Option(None, "--budget", help="instead: the longest context "
                                         "each engine fits in this, e.g. 2GiB"),
    engine: Optional[str] = typer.Option(None, "--engine", help="V2 spelling of one engine"),
    continuation: Optional[str] = CONTINUATION,
    continuation_option: List[str] = CONTINUATION_OPTION,
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="f32 | f16 | bf16: exact rows' dtype; "
                                           "default: what a run of MODEL keeps (f32 for a named geometry)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Rows and bytes per layer kind each engine keeps after N positions (no weights needed);
    with --budget, the longest context each engine fits in that many bytes. Named geometries:
    gemma3-270m/1b/4b/12b/27b, gemma2-2b/9b, llama3.2-1b/3b, llama3.1-8b, qwen2.5-0.5b/1.5b/3b/7b,
    qwen3-0.6b/1.7b/4b/8b, mistral-7b-v0.1, smollm2-135m."""

    specs = one_engine("residency", engine, continuation, continuation_option)
    check_kv_dtype(kv_dtype)
    if (positions is None) == (budget is None):
        raise LarqlError("residency: give exactly one of --positions N or --budget SIZE")
    if budget is None:
        return show_residency(model, positions, specs, as_json, kv_dtype)
    nbytes = size_flag(budget, "--budget")
    show_capacity(model, nbytes, specs, as_json, kv_dtype)


def show_capacity(model: str, nbytes: int, specs, as_json: bool, kv_dtype: str | None) -> None:
    """The longest context each engine fits in `nbytes`."""
    from larqlpy.engines.presets import RECOMMENDED
    from larqlpy.tools.residency import capacity

    c = capacity(model, nbytes, specs, kv_dtype=kv_dtype)
    if as_json:
        sys.stdout.write(json.dumps(c) + "\n")
        return
    t = Table(title=f"{c['geometry']}: the longest context that fits in {fmt_bytes(nbytes)} of KV "
                    f"(exact rows in {c['kv_dtype']})")
    for col in ("engine", "max positions", "KV bytes there"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for e in c["engines"]:
        name = e["engine"] + "".join(f" {k}={v}" for k, v in e["options"].items())
        n = e["max_positions"]
        fits = "unbounded" if n is None else f"{n:,}"
        if n is None or n > c["context"]:
            fits += f" (past the {c['context']:,}-position context)"
        t.add_row(escape(name), fits, fmt_bytes(e["bytes_at_max"]) if "bytes_at_max" in e else "")
    out.print(t)
    rec = next((e for e in c["engines"] if (e["engine"], tuple(sorted(e["options"].items()))) == RECOMMENDED), None)
    if rec is not None:
        fits = "any length" if rec["max_positions"] is None else f"{rec['max_positions']:,} positions"
        out.print(escape(f"recommended approximate configuration ({fits} here): {preset_flags(RECOMMENDED)}"))


def _shared(n: int) -> str:
    return f", {n} reading earlier layers' K/V, stored once" if n else ""


def show_residency(model: str, positions: int, specs, as_json: bool, kv_dtype: str | None) -> None:
    """Rows and bytes per layer kind each engine keeps after `positions` positions."""
    from larqlpy.tools.residency import residency as account

    r = account(model, positions, specs, kv_dtype=kv_dtype)
    if as_json:
        sys.stdout.write(json.dumps(r) + "\n")
        return
    t = Table(title=f"{r['geometry']} at {r['positions']:,} positions "
                    f"({r['kinds']['sliding']} sliding + {r['kinds']['global']} global layers"
                    f"{_shared(r['shared'])}, exact rows in {r['kv_dtype']})")
    for col in ("engine", "sliding rows", "sliding bytes", "global rows", "global bytes", "total rows", "total"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for e in r["engines"]:
        name = e["engine"] + "".join(f" {k}={v}" for k, v in e["options"].items())
        sl, gl = e["by_kind"].get("sliding", {}), e["by_kind"].get("global", {})
        t.add_row(name, f"{sl.get('rows', 0):,}", fmt_bytes(sl.get("bytes", 0)), f"{gl.get('rows', 0):,}",
                  fmt_bytes(gl.get("bytes", 0)), f"{e['rows']:,}", fmt_bytes(e["bytes"]))
    out.print(t)
    if r["note"]:
        out.print(r["note"], markup=False)
