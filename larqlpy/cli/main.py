"""`larqlpy` command line. typer and rich live here only; everything else is plain Python."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from larqlpy.errors import LarqlError
from larqlpy.generate import GenerationConfig

try:  # recent typer vendors click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException, NoArgsIsHelpError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Gemma 3 inference with pluggable KV engines.")
NO_COLOR = "NO_COLOR" in os.environ
err = Console(stderr=True, no_color=NO_COLOR, highlight=False)
out = Console(no_color=NO_COLOR, highlight=False, width=None if sys.stdout.isatty() else 160)  # pipes: no wrapping

DEVICE = typer.Option("auto", "--device", help="auto | cpu | cuda")
DTYPE = typer.Option("float32", "--dtype", help="float32 | bfloat16")
MONITOR = typer.Option(None, "--monitor", help="sample memory and position into FILE (.csv/.json)")
MONITOR_PLOT = typer.Option(None, "--monitor-plot", help="draw the --monitor samples into a PNG")
WEIGHTS = typer.Option("f32", "--weights", help="f32 | bf16 | int8 | int4: weight precision, packed at load")


def read_prompt(prompt: str) -> str:
    if prompt == "-":
        return sys.stdin.read()
    return prompt


@app.command()
def run(
    model: Path = typer.Argument(..., help="model directory (HF layout)"),
    prompt: str = typer.Argument(..., help="prompt text, or - to read stdin ('' with --resume: continue)"),
    max_tokens: int = typer.Option(64, "-n", "--max-tokens", help="tokens to generate at most"),
    engine: Optional[str] = typer.Option(None, "--engine", help="V2 spelling: standard | no-cache | name:k=v,..."),
    continuation: Optional[str] = typer.Option(None, "--continuation", help="provider identity, e.g. canonical/v1"),
    continuation_option: List[str] = typer.Option([], "--continuation-option", help="key=value (repeatable)"),
    kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="resident KV budget, e.g. 64MiB (cells/v1)"),
    save_state: Optional[Path] = typer.Option(None, "--save-state", help="write the attention state here after the run"),
    resume_from: Optional[Path] = typer.Option(None, "--resume", help="continue from a saved state file"),
    reprefill: bool = typer.Option(False, "--reprefill", help="with --resume: prefill afresh if the state cannot be trimmed"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off"),
    top_p: float = typer.Option(1.0, "--top-p", help="1 = off"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    prefill_chunk: int = typer.Option(GenerationConfig.prefill_chunk, "--prefill-chunk", help="tokens per prefill block"),
    stats: bool = typer.Option(False, "--stats", help="print engine, speeds and KV bytes to stderr"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming"),
    monitor: Optional[Path] = MONITOR,
    monitor_plot: Optional[Path] = MONITOR_PLOT,
    device: str = DEVICE,
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
):
    """Generate a continuation of PROMPT."""
    from larqlpy.model.loader import load
    from larqlpy.runner import Request, execute

    req = Request.from_dict(dict(
        prompt=read_prompt(prompt), engine=engine, continuation=continuation, options=list(continuation_option),
        kv_budget=kv_budget, resume=str(resume_from) if resume_from else None,
        save_state=str(save_state) if save_state else None, reprefill=reprefill, max_tokens=max_tokens,
        prefill_chunk=prefill_chunk, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
    req.spec()  # every refusal before the weights load
    check_paths(monitor, monitor_plot)
    with monitored(monitor, monitor_plot) as mon:
        loaded = load(model, device=device, dtype=dtype, weights=weights)

        def stream(tok):
            mon.position = tok.metrics.position + 1
            if not as_json:
                sys.stdout.write(tok.text)
                sys.stdout.flush()

        result = execute(loaded, req, stream)
    result.pop("id")
    result.pop("error")
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        sys.stdout.write("\n")
    sys.stdout.flush()
    if stats:
        print_stats(result)


def print_stats(result: dict) -> None:
    m, session = result["stats"], result.get("session", {})
    extra = ""
    if session.get("resumed_from"):
        extra += f" | resumed {session['reused_tokens']} tok from {session['resumed_from']}"
    if session.get("saved_to"):
        extra += f" | saved {_bytes(session['saved_bytes'])} to {session['saved_to']}"
    err.print(f"engine {result['engine']} | weights {result.get('weights', 'f32')} | prompt {result['prompt_tokens']} tok | prefill "
              f"{m.get('prefill_tokens_per_s', 0):.1f} tok/s | decode {m.get('decode_tokens_per_s', 0):.1f} tok/s | "
              f"resident KV {_bytes(m.get('resident_kv_bytes', 0))} | finish {result['finish_reason']}{extra}",
              soft_wrap=True, markup=False)
    if "transitions" in result:
        cells = ", ".join(f"{k} {v}" for k, v in sorted(result["cells"].items()))
        moves = ", ".join(f"{t['event']} {t['from']}->{t['to']} x{t['count']}" for t in result["transitions"])
        err.print(f"cells: {cells} | transitions: {moves}", soft_wrap=True, markup=False)


_WORKER: dict = {}


def _worker_init(model: str, device: str, dtype: str, weights: str) -> None:
    from larqlpy.model.loader import load

    _WORKER["loaded"] = load(model, device=device, dtype=dtype, weights=weights)  # float32 on CPU maps the file: pages are shared


def _run_line(item: tuple[int, str]) -> dict:
    from larqlpy.runner import Request, execute

    lineno, line = item
    rid = None
    try:
        raw = json.loads(line)
        rid = raw.get("id", lineno) if isinstance(raw, dict) else lineno
        return {**execute(_WORKER["loaded"], Request.from_dict({**raw, "id": rid})), "line": lineno}
    except json.JSONDecodeError as e:
        msg = f"line {lineno}: not valid JSON ({e.msg})"
    except LarqlError as e:
        msg = f"line {lineno}: {e}"
    except Exception as e:  # one bad line must not take the others down
        msg = f"line {lineno}: {type(e).__name__}: {e}"
    return {"id": rid if rid is not None else lineno, "line": lineno, "text": None, "tokens": None,
            "stats": None, "error": msg}


@app.command()
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
    import multiprocessing as mp

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from larqlpy.model.loader import read_config

    if workers < 1:
        raise LarqlError(f"--workers must be >= 1, got {workers}")
    read_config(model)  # a bad model directory is one line, not one error per request
    check_paths(monitor, monitor_plot)
    if infile == "-":
        lines = sys.stdin.read().splitlines()
    else:
        try:
            lines = Path(infile).read_text().splitlines()
        except OSError as e:
            raise LarqlError(f"{infile}: {e.strerror or e}") from None
    items = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    sink = open(output, "w") if output else sys.stdout
    failed = 0
    show = err.is_terminal and not quiet
    try:
        with monitored(monitor, monitor_plot) as mon, \
                Progress(TextColumn("batch"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                         console=err, disable=not show) as bar:
            task = bar.add_task("batch", total=len(items))
            if workers == 1:
                _worker_init(str(model), device, dtype, weights)
                results = map(_run_line, items)
                pool = None
            else:
                pool = mp.get_context("spawn").Pool(workers, _worker_init, (str(model), device, dtype, weights))
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
    finally:
        if output:
            sink.close()
    if failed and not quiet:
        err.print(f"larqlpy: {failed} of {len(items)} lines failed", markup=False)
    raise typer.Exit(1 if failed else 0)


@app.command()
def info(model: Path = typer.Argument(..., help="model directory"),
         as_json: bool = typer.Option(False, "--json")):
    """Architecture, layers and their kinds, parameter count, dtype."""
    from larqlpy.model.loader import describe

    d = describe(model)
    if as_json:
        out.print_json(json.dumps(d))
        return
    t = Table(title=str(model), show_header=False)
    for k in ("model_type", "parameters", "dtypes", "layers", "hidden_size", "heads", "kv_heads", "head_dim",
              "sliding_window", "vocab_size", "rope", "final_logit_softcapping", "key_calibration"):
        v = d[k]
        t.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    t.add_row("layer kinds", " ".join("G" if k == "global" else "s" for k in d["layer_kinds"]) + "  (s sliding, G global)")
    out.print(t)


@app.command("convert-gguf")
def convert_gguf_cmd(src: Path = typer.Argument(..., help="a Gemma 3 .gguf file"),
                     dest: Path = typer.Argument(..., help="output directory (HF layout)"),
                     force: bool = typer.Option(False, "--force", help="overwrite DEST if it exists")):
    """Dequantize a Gemma 3 GGUF into safetensors + config.json + tokenizer.json."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from larqlpy.convert.gguf import convert_gguf

    with Progress(TextColumn("{task.description:<40}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, disable=not err.is_terminal) as bar:
        task = bar.add_task("reading", total=None)

        def step(what: str, done: int, total: int) -> None:
            bar.update(task, description=what[:40], completed=done, total=total)

        convert_gguf(src, dest, step, force=force)
    err.print(f"wrote {dest}")


@app.command()
def calibrate(
    model: Path = typer.Argument(..., help="model directory"),
    text: Optional[Path] = typer.Option(None, "--text", help="calibration text (default: the packaged one)"),
    device: str = DEVICE,
):
    """Measure the keys' mean and per-channel scale (what codec calib=on quantizes with) and write
    MODEL/kv_calibration.safetensors."""
    import time

    from larqlpy import calibration
    from larqlpy.model.loader import load

    if text is not None and not text.is_file():
        raise LarqlError(f"--text {text}: no such file")
    body = None
    if text is not None:
        try:
            body = text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LarqlError(f"--text {text}: cannot read it as UTF-8 text ({e})") from None
    t0 = time.perf_counter()
    loaded = load(model, device=device, key_calibration=False)
    cals, meta = calibration.calibrate(loaded, body)
    path = calibration.save(model, cals, meta)
    t = Table(title=f"{model}: key calibration over {int(meta['tokens']):,} tokens")
    for col in ("layer", "kind", "mean share of key energy", "scale min", "scale max"):
        t.add_column(col, justify="right")
    for g, c, share in zip(loaded.model.geometries(), cals, map(float, meta["mean_share"].split(","))):
        t.add_row(str(g.index), g.kind, f"{share:.2f}", f"{c.scale.min().item():.2f}", f"{c.scale.max().item():.2f}")
    out.print(t)
    err.print(f"wrote {path} ({time.perf_counter() - t0:.1f} s)", markup=False)


@app.command()
def residency(
    model: str = typer.Argument(..., help="model directory or named geometry (gemma3-270m, -1b, -4b, -12b, -27b)"),
    positions: Optional[int] = typer.Option(None, "--positions", help="sequence length to account for"),
    budget: Optional[str] = typer.Option(None, "--budget", help="instead: the longest context each engine fits in this, e.g. 2GiB"),
    engine: Optional[str] = typer.Option(None, "--engine", help="V2 spelling of one engine"),
    continuation: Optional[str] = typer.Option(None, "--continuation", help="one engine by identity"),
    continuation_option: List[str] = typer.Option([], "--continuation-option", help="key=value (repeatable)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Rows and bytes per layer kind each engine keeps after N positions (no weights needed);
    with --budget, the longest context each engine fits in that many bytes."""
    from larqlpy.engines.cells import parse_size
    from larqlpy.engines.codec import RECOMMENDED, recommended_flags
    from larqlpy.residency import capacity
    from larqlpy.residency import residency as account

    specs = one_engine("residency", engine, continuation, continuation_option)
    if (positions is None) == (budget is None):
        raise LarqlError("residency: give exactly one of --positions N or --budget SIZE")
    if budget is not None:
        try:
            nbytes = parse_size(budget)
        except ValueError as e:
            raise LarqlError(f"--budget: {e}") from None
        c = capacity(model, nbytes, specs)
        if as_json:
            sys.stdout.write(json.dumps(c) + "\n")
            return
        t = Table(title=f"{c['geometry']}: the longest context that fits in {_bytes(nbytes)} of KV")
        for col in ("engine", "max positions", "KV bytes there"):
            t.add_column(col, justify="left" if col == "engine" else "right")
        for e in c["engines"]:
            name = e["engine"] + "".join(f" {k}={v}" for k, v in e["options"].items())
            t.add_row(escape(name), "unbounded" if e["max_positions"] is None else f"{e['max_positions']:,}",
                      _bytes(e["bytes_at_max"]) if "bytes_at_max" in e else "")
        out.print(t)
        rec = next((e for e in c["engines"] if (e["engine"], tuple(sorted(e["options"].items()))) == RECOMMENDED), None)
        if rec is not None:
            fits = "any length" if rec["max_positions"] is None else f"{rec['max_positions']:,} positions"
            out.print(escape(f"recommended approximate configuration ({fits} here): {recommended_flags()}"))
        return
    r = account(model, positions, specs)
    if as_json:
        sys.stdout.write(json.dumps(r) + "\n")
        return
    t = Table(title=f"{r['geometry']} at {r['positions']:,} positions "
                    f"({r['kinds']['sliding']} sliding + {r['kinds']['global']} global layers)")
    for col in ("engine", "sliding rows", "sliding bytes", "global rows", "global bytes", "total rows", "total"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for e in r["engines"]:
        name = e["engine"] + "".join(f" {k}={v}" for k, v in e["options"].items())
        sl, gl = e["by_kind"].get("sliding", {}), e["by_kind"].get("global", {})
        t.add_row(name, f"{sl.get('rows', 0):,}", _bytes(sl.get("bytes", 0)), f"{gl.get('rows', 0):,}",
                  _bytes(gl.get("bytes", 0)), f"{e['rows']:,}", _bytes(e["bytes"]))
    out.print(t)


@app.command("kv-stats")
def kv_stats_cmd(
    model: Path = typer.Argument(..., help="model directory"),
    prompt: str = typer.Argument(..., help="a text file, - for stdin, or the text itself"),
    max_positions: int = typer.Option(2048, "--max-positions", help="use at most this many tokens"),
    min_cosine: float = typer.Option(0.995, "--min-cosine", help="a layer whose rows fall below this at 4 bits stays exact"),
    rules_out: Optional[Path] = typer.Option(None, "--rules-out", help="write the suggested cells/v1 rules here"),
    as_json: bool = typer.Option(False, "--json"),
    device: str = DEVICE,
    weights: str = WEIGHTS,
):
    """Per layer, K and V: range, quantiles, outlier channels, and the per-row cosine each codec reaches."""
    from larqlpy.model.loader import load
    from larqlpy.observe import QUANTILES, QUERIES, WIDER, kv_stats

    if max_positions < 1 or not 0 < min_cosine <= 1:
        raise LarqlError("--max-positions must be >= 1 and --min-cosine in (0, 1]")
    text = read_prompt(prompt) if prompt == "-" or not Path(prompt).is_file() else Path(prompt).read_text()
    loaded = load(model, device=device, weights=weights)
    ids = loaded.tokenizer.encode(text)[:max_positions]
    r = kv_stats(loaded, ids, min_cosine)
    if rules_out is not None:
        rules_out.write_text(r["rules"])
    if as_json:
        sys.stdout.write(json.dumps(r) + "\n")
        return
    t = Table(title=f"{model}: K/V over {r['positions']:,} positions (per-row cosine: mean / min; attention KL "
                    f"of the newest {QUERIES} queries with K at tq4 / tq3{', calibrated' if r['calibrated'] else ''})")
    for col in ("layer", "", "min", "max", f"q{QUANTILES[0]}", f"q{QUANTILES[-1]}", "outlier ch.", "tq4", "tq3",
                "int4g32", "attention KL", "verdict"):
        t.add_column(col, justify="right")
    for e in r["layers"]:
        for name in ("K", "V"):
            st = e[name]
            cos = {c: f"{v['mean']:.4f} / {v['min']:.3f}" for c, v in st["cosine"].items()}
            t.add_row(f"{e['layer']} {e['kind'][0]}" if name == "K" else "", name, f"{st['min']:.2f}", f"{st['max']:.2f}",
                      f"{st['quantiles'][str(QUANTILES[0])]:.2f}", f"{st['quantiles'][str(QUANTILES[-1])]:.2f}",
                      str(st["outlier_channels"]), cos.get("tq4", ""), cos.get("tq3", ""), cos.get("int4g32", ""),
                      f"{e['attention_kl']['tq4']:.4f} / {e['attention_kl']['tq3']:.4f}" if name == "K" else "",
                      ("keep exact" if e["quantizes_badly"] else "quantize") if name == "K" else "")
    out.print(t)
    err.print(f"suggested policy: quantize_layers = "
              f"{'all' if not r['keep_exact'] else [i for i in range(len(r['layers'])) if i not in r['keep_exact']]}"
              + (f" (rules written to {rules_out})" if rules_out else ""), markup=False)
    err.print("suggested codec/v1 option: " + (f"--continuation-option layer_bits={r['layer_bits']}" if r["layer_bits"]
              else f"none (no layer's attention KL is {WIDER:g}x the median)")
              + ("" if r["calibrated"] else "; with calib=on (`larqlpy calibrate`) keys quantize far better"), markup=False)


bench_app = typer.Typer(no_args_is_help=True, help="Measurements on a real model.")
app.add_typer(bench_app, name="bench")


@bench_app.command("ladder")
def bench_ladder(
    model: Path = typer.Argument(..., help="model directory"),
    positions: str = typer.Option("512,2048,8192", "--positions", help="comma-separated context lengths"),
    engine: Optional[str] = typer.Option(None, "--engine", help="one engine, V2 spelling"),
    continuation: Optional[str] = typer.Option(None, "--continuation", help="one engine by identity"),
    continuation_option: List[str] = typer.Option([], "--continuation-option", help="key=value (repeatable)"),
    steps: int = typer.Option(8, "--steps", help="decode steps per length (teacher-forced)"),
    budget: Optional[str] = typer.Option(None, "--budget", help="instead: run each engine until its memory grew by this"),
    max_positions: int = typer.Option(16384, "--max-positions", help="with --budget: stop here if it still fits"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write a PNG: bytes against positions, log scale"),
    as_json: bool = typer.Option(False, "--json"),
    monitor: Optional[Path] = MONITOR,
    monitor_plot: Optional[Path] = MONITOR_PLOT,
    device: str = DEVICE,
    dtype: str = DTYPE,
    weights: str = WEIGHTS,
):
    """Each engine at several lengths: live KV bytes, speed, row cosine and KL against canonical/v1."""
    from larqlpy.ladder import ladder, plot as draw
    from larqlpy.model.loader import load

    try:
        lengths = [int(p) for p in positions.split(",")]
    except ValueError:
        raise LarqlError(f"--positions: expected comma-separated integers, got {positions!r}") from None
    if not lengths or min(lengths) < 1 or steps < 1:
        raise LarqlError("--positions and --steps must be positive")
    specs = one_engine("bench ladder", engine, continuation, continuation_option)
    if plot is not None and plot.suffix.lower() != ".png":
        raise LarqlError(f"--plot: expected a .png path, got {plot}")
    check_paths(monitor, monitor_plot)
    if budget is not None:
        with monitored(monitor, monitor_plot):
            return _ladder_budget(model, budget, specs, max_positions, as_json, device, dtype, weights)
    with monitored(monitor, monitor_plot) as mon:
        loaded = load(model, device=device, dtype=dtype, weights=weights)
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
        t.add_row(escape(r["engine"]), f"{r['positions']:,}", _bytes(r["resident_kv_bytes"]), f"{r['bytes_per_position']:,.0f}",
                  f"{r['prefill_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s']:.2f}", f"{r['row_cosine']:.4f}",
                  f"{r['next_token_kl']:.4f}")
    out.print(t)
    for sk in result["skipped"]:
        err.print(f"skipped {sk['engine']}: {sk['reason']}", markup=False)
    if plot is not None:
        err.print(f"wrote {plot}", markup=False)


def _ladder_budget(model: Path, budget: str, specs, max_positions: int, as_json: bool, device: str, dtype: str,
                   weights: str):
    """Confirm `residency --budget` by running: each engine grows a context until the process's
    memory grew by the budget."""
    from larqlpy.engines import parse_engine_spec
    from larqlpy.engines.cells import parse_size
    from larqlpy.ladder import DEFAULT_ENGINES, until_budget
    from larqlpy.model.loader import load
    from larqlpy.residency import capacity

    try:
        nbytes = parse_size(budget)
    except ValueError as e:
        raise LarqlError(f"--budget: {e}") from None
    if max_positions < 1:
        raise LarqlError("--max-positions must be >= 1")
    specs = specs or [parse_engine_spec(continuation=c, continuation_options=o) for c, o in DEFAULT_ENGINES]
    loaded = load(model, device=device, dtype=dtype, weights=weights)
    accounted = capacity(str(model), nbytes, specs)["engines"]
    rows = []
    for spec, acc in zip(specs, accounted):
        r = until_budget(loaded, spec, nbytes, max_positions=max_positions)
        r["accounted_positions"] = acc["max_positions"]
        rows.append(r)
    if as_json:
        sys.stdout.write(json.dumps({"model": str(model), "budget": nbytes, "rows": rows}) + "\n")
        return
    t = Table(title=f"{model}: the longest context in {_bytes(nbytes)}, accounted and run (peak anonymous memory)")
    for col in ("engine", "accounted positions", "ran to", "peak growth", "KV at the end"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for r in rows:
        ran = f"{r['fits_positions']:,}" + ("" if r["reached_budget"] else "+ (cap)")
        t.add_row(escape(r["engine"]), f"{r['accounted_positions']:,}", ran, _bytes(r["peak_growth_bytes"]),
                  _bytes(r["resident_kv_bytes_at_end"]))
    out.print(t)


@bench_app.command("consistency")
def bench_consistency(
    model: Path = typer.Argument(..., help="model directory"),
    questions: Optional[Path] = typer.Argument(None, help="JSON lines of {id, question}; default: the shipped set"),
    engine: Optional[str] = typer.Option(None, "--engine", help="one engine, V2 spelling"),
    continuation: Optional[str] = typer.Option(None, "--continuation", help="one engine by identity"),
    continuation_option: List[str] = typer.Option([], "--continuation-option", help="key=value (repeatable)"),
    max_tokens: int = typer.Option(16, "-n", "--max-tokens", help="answer length"),
    as_json: bool = typer.Option(False, "--json"),
    monitor: Optional[Path] = MONITOR,
    monitor_plot: Optional[Path] = MONITOR_PLOT,
    device: str = DEVICE,
    weights: str = WEIGHTS,
):
    """A fixed question set answered greedily by each engine, against canonical/v1."""
    from larqlpy.engines import parse_engine_spec
    from larqlpy.ladder import DEFAULT_ENGINES
    from larqlpy.model.loader import load
    from larqlpy.observe import consistency, load_questions

    if max_tokens < 1:
        raise LarqlError("--max-tokens must be >= 1")
    specs = one_engine("bench consistency", engine, continuation, continuation_option) or [
        parse_engine_spec(continuation=c, continuation_options=o) for c, o in DEFAULT_ENGINES[1:]]
    items = load_questions(questions)
    check_paths(monitor, monitor_plot)
    with monitored(monitor, monitor_plot):
        loaded = load(model, device=device, weights=weights)
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


state_app = typer.Typer(no_args_is_help=True, help="Saved attention state files.")
app.add_typer(state_app, name="state")


@state_app.command("inspect")
def state_inspect(path: Path = typer.Argument(..., help="a state file written by --save-state"),
                  as_json: bool = typer.Option(False, "--json")):
    """Header, cells by state and layer, sizes. Verifies every checksum."""
    from larqlpy.state.store import load_state

    saved = load_state(path)
    h = saved.header
    by_layer: dict[int, dict[str, list[int]]] = {}
    for c in h["cells"]:
        slot = by_layer.setdefault(c["layer"], {}).setdefault(f"{c['state']} {c['precision']}", [0, 0, 0])
        slot[0] += 1
        slot[1] += c["n"]
        slot[2] += sum(f["length"] for f in c["fields"].values())
    summary = {"path": str(path), "bytes": path.stat().st_size, "format": h["format"], "larqlpy": h.get("larqlpy"),
               "model_fingerprint": h["model_fingerprint"], "tokenizer_fingerprint": h["tokenizer_fingerprint"],
               "weights": h.get("weights", "f32"),
               "engine": h["engine"], "tokens": len(h["tokens"]), "processed": h["processed"],
               "layers": [{"index": l["index"], "kind": l["kind"], "retained": l["retained"],
                           "cells": {k: {"cells": v[0], "positions": v[1], "bytes": v[2]}
                                     for k, v in sorted(by_layer.get(l["index"], {}).items())}}
                          for l in h["layers"]]}
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    opts = ",".join(f"{k}={v}" for k, v in sorted(h["engine"]["options"].items()))
    out.print(f"{path}: {_bytes(summary['bytes'])}, format {h['format']}, engine {h['engine']['identity']}"
              f"{' [' + opts + ']' if opts else ''}", markup=False)
    out.print(f"tokens {len(h['tokens'])} (processed {h['processed']}), model {h['model_fingerprint']} "
              f"(--weights {summary['weights']}), tokenizer {h['tokenizer_fingerprint']}", markup=False)
    t = Table()
    for col in ("layer", "kind", "retained", "cells (state precision: cells / positions / bytes)"):
        t.add_column(col)
    for l in summary["layers"]:
        cells = "; ".join(f"{k}: {v['cells']} / {v['positions']} / {_bytes(v['bytes'])}" for k, v in l["cells"].items())
        t.add_row(str(l["index"]), l["kind"], f"{l['retained'][0]}-{l['retained'][1]}", cells, )
    out.print(t)


class _NoMonitor:
    position = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def monitored(path: Optional[Path], plot: Optional[Path]):
    """A Monitor when --monitor was given, else a stand-in that only holds a position."""
    from larqlpy.monitor import Monitor

    return Monitor(path, plot=plot) if path is not None else _NoMonitor()


def check_paths(data: Optional[Path], plot: Optional[Path]) -> None:
    from larqlpy.monitor import check_paths as check

    check(data, plot)


def one_engine(command: str, engine, continuation, options) -> list | None:
    """The single engine a command was narrowed to (None: all of them). no-cache holds no rows."""
    from larqlpy.engines import parse_engine_spec

    if engine is None and continuation is None and not options:
        return None
    spec = parse_engine_spec(engine, continuation, options)
    if spec.replay:
        raise LarqlError(f"{command}: no-cache keeps no KV rows between steps; name a continuation")
    return [spec]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def main() -> None:
    """Entry point: bad input is one line on stderr and exit 2, never a traceback."""
    try:
        rv = app(standalone_mode=False)
    except LarqlError as e:
        err.print(f"larqlpy: error: {e}", markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except NoArgsIsHelpError as e:
        err.print(e.ctx.get_help() if e.ctx else "usage: larqlpy --help", markup=False)
        sys.exit(2)
    except ClickException as e:
        err.print(f"larqlpy: error: {e.format_message()}", markup=False, soft_wrap=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err.print("larqlpy: interrupted", markup=False)
        sys.exit(130)
    except BrokenPipeError:
        sys.stderr.close()  # the reader went away (e.g. `| head`): not an error worth a traceback
        sys.exit(0)
    except OSError as e:
        err.print(f"larqlpy: error: {e}", markup=False, soft_wrap=True)
        sys.exit(2)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
