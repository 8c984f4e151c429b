"""`larqlpy bench ladder|consistency|needle`: measurements of every engine on a real model."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape
from rich.table import Table

from larqlpy.cli.common import (ALLOW_UNUSED, CONTINUATION, CONTINUATION_OPTION, DEVICE, DTYPE, MONITOR, MONITOR_PLOT,
                                PRE_TOKENIZER, WEIGHTS, check_paths, err, fmt_bytes, load_model, monitored, one_engine,
                                out, size_flag)
from larqlpy.errors import LarqlError
from larqlpy.files import check_output

bench_app = typer.Typer(no_args_is_help=True, help="Measurements on a real model.")


@bench_app.command("ladder")
def bench_ladder(
    model: Path = typer.Argument(..., help="model directory or .gguf file"),
    positions: str = typer.Option("512,2048,8192", "--positions", help="comma-separated context lengths"),
    engine: Optional[str] = typer.Option(None, "--engine", help="one engine, V2 spelling"),
    continuation: Optional[str] = CONTINUATION,
    continuation_option: List[str] = CONTINUATION_OPTION,
    steps: int = typer.Option(8, "--steps", help="decode steps per length (teacher-forced)"),
    budget: Optional[str] = typer.Option(None, "--budget", help="instead: run each engine "
                                         "until its memory grew by this"),
    max_positions: int = typer.Option(16384, "--max-positions", help="with --budget: stop here if it still fits"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write a PNG: bytes against positions, log scale"),
    as_json: bool = typer.Option(False, "--json"),
    monitor: Optional[Path] = MONITOR,
    monitor_plot: Optional[Path] = MONITOR_PLOT,
    device: str = DEVICE,
    dtype: str = DTYPE,
    weights: Optional[str] = WEIGHTS,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
):
    """Each engine at several lengths: live KV bytes, speed, row cosine and KL against canonical/v1."""
    from larqlpy.tools.ladder import ladder
    from larqlpy.tools.ladder import plot as draw

    lengths = _lengths(positions, steps)
    specs = one_engine("bench ladder", engine, continuation, continuation_option)
    if plot is not None and plot.suffix.lower() != ".png":
        raise LarqlError(f"--plot: expected a .png path, got {plot}")
    if plot is not None:
        check_output(plot, "--plot")
    check_paths(monitor, monitor_plot)
    if budget is not None:
        with monitored(monitor, monitor_plot):
            return _ladder_budget(model, budget, specs, max_positions, as_json,
                                  dict(device=device, dtype=dtype, weights=weights,
                                       allow_unused_tensors=allow_unused_tensors, pre_tokenizer=pre_tokenizer))
    with monitored(monitor, monitor_plot) as mon:
        loaded = load_model(model, device=device, dtype=dtype, weights=weights,
                            allow_unused_tensors=allow_unused_tensors, pre_tokenizer=pre_tokenizer)
        result = ladder(loaded, lengths, specs, steps, on_length=lambda n: setattr(mon, "position", n))
    if plot is not None:
        draw(result, plot)
        result["plot"] = str(plot)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    t = Table(title=f"{model}: {steps} teacher-forced decode steps after each length")
    for col in ("engine", "positions", "resident KV", "bytes/pos", "prefill tok/s", "decode tok/s", "row cosine",
                "next-token KL"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for r in result["rows"]:
        t.add_row(escape(r["engine"]), f"{r['positions']:,}", fmt_bytes(r["resident_kv_bytes"]),
                  f"{r['bytes_per_position']:,.0f}", f"{r['prefill_tokens_per_s']:.1f}",
                  f"{r['decode_tokens_per_s']:.2f}", f"{r['row_cosine']:.4f}", f"{r['next_token_kl']:.4f}")
    out.print(t)
    for sk in result["skipped"]:
        err.print(f"skipped {sk['engine']}: {sk['reason']}", markup=False)
    if plot is not None:
        err.print(f"wrote {plot}", markup=False)


def _lengths(positions: str, steps: int) -> list[int]:
    try:
        lengths = [int(p) for p in positions.split(",")]
    except ValueError:
        raise LarqlError(f"--positions: expected comma-separated integers, got {positions!r}") from None
    if not lengths or min(lengths) < 1 or steps < 1:
        raise LarqlError("--positions and --steps must be positive")
    return lengths


def _ladder_budget(model: Path, budget: str, specs, max_positions: int, as_json: bool, load: dict):
    """Confirm `residency --budget` by running: each engine grows a context until the process's
    memory grew by the budget."""
    from larqlpy.engines import preset_spec
    from larqlpy.engines.presets import LADDER
    from larqlpy.tools.ladder import until_budget
    from larqlpy.tools.residency import capacity

    nbytes = size_flag(budget, "--budget")
    if max_positions < 1:
        raise LarqlError("--max-positions must be >= 1")
    specs = specs or [preset_spec(p) for p in LADDER]
    loaded = load_model(model, **load)
    accounted = capacity(str(model), nbytes, specs)["engines"]
    rows = []
    for spec, acc in zip(specs, accounted):
        r = until_budget(loaded, spec, nbytes, max_positions=max_positions)
        r["accounted_positions"] = acc["max_positions"]
        rows.append(r)
    if as_json:
        sys.stdout.write(json.dumps({"model": str(model), "budget": nbytes, "rows": rows}) + "\n")
        return
    t = Table(title=f"{model}: the longest context in {fmt_bytes(nbytes)}, accounted and run (peak anonymous memory)")
    for col in ("engine", "accounted positions", "ran to", "peak growth", "KV at the end"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for r in rows:
        ran = f"{r['fits_positions']:,}" + ("" if r["reached_budget"] else "+ (cap)")
        t.add_row(escape(r["engine"]), f"{r['accounted_positions']:,}", ran, fmt_bytes(r["peak_growth_bytes"]),
                  fmt_bytes(r["resident_kv_bytes_at_end"]))
    out.print(t)


@bench_app.command("consistency")
def bench_consistency(
    model: Path = typer.Argument(..., help="model directory or .gguf file"),
    questions: Optional[Path] = typer.Argument(None, help="JSON lines of {id, question}; default: the shipped set"),
    engine: Optional[str] = typer.Option(None, "--engine", help="one engine, V2 spelling"),
    continuation: Optional[str] = CONTINUATION,
    continuation_option: List[str] = CONTINUATION_OPTION,
    max_tokens: int = typer.Option(16, "-n", "--max-tokens", help="answer length"),
    as_json: bool = typer.Option(False, "--json"),
    monitor: Optional[Path] = MONITOR,
    monitor_plot: Optional[Path] = MONITOR_PLOT,
    device: str = DEVICE,
    weights: Optional[str] = WEIGHTS,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
):
    """A fixed question set answered greedily by each engine, against canonical/v1."""
    from larqlpy.engines import preset_spec
    from larqlpy.engines.presets import LADDER
    from larqlpy.tools.observe import consistency, load_questions

    if max_tokens < 1:
        raise LarqlError("--max-tokens must be >= 1")
    specs = one_engine("bench consistency", engine, continuation, continuation_option) or [
        preset_spec(p) for p in LADDER[1:]]
    items = load_questions(questions)
    check_paths(monitor, monitor_plot)
    with monitored(monitor, monitor_plot):
        loaded = load_model(model, device=device, weights=weights, allow_unused_tensors=allow_unused_tensors,
                            pre_tokenizer=pre_tokenizer)
        r = consistency(loaded, items, specs, max_tokens)
    if as_json:
        sys.stdout.write(json.dumps(r) + "\n")
        return
    t = Table(title=f"{len(items)} questions, {max_tokens} greedy tokens each, against canonical/v1")
    for col in ("engine", "exact match", "mean common prefix", "mean next-token KL"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for e in r["engines"]:
        t.add_row(escape(e["engine"]), f"{e['exact_match_rate']:.0%}", f"{e['mean_common_prefix']:.1f}",
                  f"{e['mean_kl']:.4f}")
    out.print(t)


@bench_app.command("needle")
def bench_needle(
    model: Path = typer.Argument(..., help="model directory or .gguf file"),
    positions: str = typer.Option("4096,16384", "--positions", help="comma-separated context lengths (tokens)"),
    depths: str = typer.Option("0.1,0.5,0.9", "--depths", help="where the key hides: 0 the start, 1 the end"),
    engines: List[str] = typer.Option([], "--engines", help="an engine and its options, e.g. 'codec/v1 bits=3' "
                                      "(repeat; default: canonical/v1, codec/v1 bits=4, codec/v1 bits=3)"),
    kv_budget: str = typer.Option("1/8", "--kv-budget", help="cells/v1's budget: a share of canonical/v1's KV "
                                  "at each length (1/8) or a size (64MiB); 'none': no cells/v1 run"),
    capacity_budget: Optional[str] = typer.Option(None, "--capacity", help="also: the longest context each "
                                                  "engine's rows fit in this much memory (e.g. 256MiB)"),
    seed: int = typer.Option(0, "--seed", help="chooses the keys"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write a PNG: found or missed per engine and depth"),
    as_json: bool = typer.Option(False, "--json"),
    device: str = DEVICE,
    weights: Optional[str] = WEIGHTS,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
):
    """Pass-key retrieval: a key hidden in filler text, asked for, per engine, length and depth."""
    from larqlpy.tools import needle as nd

    lengths = _lengths(positions, 1)
    try:
        where = [float(d) for d in depths.split(",")]
    except ValueError:
        raise LarqlError(f"--depths: expected comma-separated numbers, got {depths!r}") from None
    if not where or not all(0 <= d <= 1 for d in where):
        raise LarqlError("--depths must lie in [0, 1]")
    chosen = [nd.parse_engine(e) for e in engines] or [nd.Engine("canonical/v1"), nd.Engine("codec/v1", ("bits=4",)),
                                                       nd.Engine("codec/v1", ("bits=3",))]
    if kv_budget != "none":
        chosen.append(_cells_engine(kv_budget))
    cap = None if capacity_budget is None else size_flag(capacity_budget, "--capacity")
    if plot is not None and plot.suffix.lower() != ".png":
        raise LarqlError(f"--plot: expected a .png path, got {plot}")
    if plot is not None:
        check_output(plot, "--plot")
    loaded = load_model(model, device=device, weights=weights, allow_unused_tensors=allow_unused_tensors,
                        pre_tokenizer=pre_tokenizer)
    show = None if as_json else (lambda r: err.print(
        f"{r['positions']:,} tokens, depth {r['depth']}: {r['engine']}: "
        f"{'refused' if r['found'] is None else 'found' if r['found'] else 'missed'}",
        markup=False))
    result = nd.needle(loaded, lengths, where, chosen, seed, on_row=show)
    if cap is not None:
        result["capacity"] = {"budget": cap, "engines": nd.capacity(loaded, chosen, cap,
                                                                   loaded.config.max_position_embeddings)}
    if plot is not None:
        nd.plot(result, plot)
        result["plot"] = str(plot)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    _needle_tables(model, result)


def _cells_engine(kv_budget: str):
    """--kv-budget: a share of canonical/v1's KV (1/8, 0.125) or a size (64MiB)."""
    from larqlpy.tools import needle as nd

    if "/" in kv_budget or kv_budget.startswith("0."):
        try:
            return nd.Engine("cells/v1", (), nd.parse_fraction(kv_budget))
        except LarqlError as e:
            raise LarqlError(f"--kv-budget: {e}") from None
    size_flag(kv_budget, "--kv-budget")
    return nd.Engine("cells/v1", (f"budget={kv_budget}",))


def _needle_tables(model: Path, result: dict) -> None:
    t = Table(title=f"{model}: pass-key retrieval")
    for col in ("engine", "tokens", "depth", "found", "answer", "resident KV", "prefill tok/s", "decode tok/s",
                "recovered"):
        t.add_column(col, justify="left" if col in ("engine", "answer") else "right")
    for r in result["rows"]:
        if r["found"] is None:
            t.add_row(escape(r["engine"]), f"~{r['positions']:,}", f"{r['depth']:g}", "refused", escape(r["error"]))
            continue
        moved = {(x["event"], x["to"]): x["count"] for x in r.get("cells", {}).get("transitions", [])}
        t.add_row(escape(r["engine"]), f"{r['prompt_tokens']:,}", f"{r['depth']:g}", "yes" if r["found"] else "NO",
                  escape(r["answer"].strip()[:24]), fmt_bytes(r["resident_kv_bytes"]),
                  f"{r['prefill_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.2f}",
                  f"{moved.get(('CACHE_MISS', 'RECOVERING'), 0):,}" if "cells" in r else "")
    out.print(t)
    for sk in result["skipped"]:
        err.print(f"skipped {sk['positions']:,} tokens: {sk['reason']}", markup=False)
    if "capacity" in result:
        c = Table(title=f"the longest context each engine's rows fit in {fmt_bytes(result['capacity']['budget'])}")
        for col in ("engine", "positions"):
            c.add_column(col, justify="left" if col == "engine" else "right")
        for e in result["capacity"]["engines"]:
            c.add_row(escape(e["engine"]), f"{e['max_positions']:,}" if e["max_positions"] is not None else e["note"])
        out.print(c)
    if "plot" in result:
        err.print(f"wrote {result['plot']}", markup=False)
