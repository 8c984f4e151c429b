"""`larqlpy kv-stats`: look before you quantize -- per-layer K/V statistics on a real text."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from larqlpy.cli.common import (ALLOW_UNUSED, DEVICE, PRE_TOKENIZER, WEIGHTS, err, load_model, model_home, out,
                                read_prompt)
from larqlpy.errors import LarqlError
from larqlpy.files import PROMPT_LIMIT, atomic_write, check_output, read_text


def kv_stats(
    model: Path = typer.Argument(..., help="model directory or .gguf file"),
    prompt: str = typer.Argument(..., help="a text file, - for stdin, or the text itself"),
    max_positions: Optional[int] = typer.Option(None, "--max-positions",
                                                help="use at most this many tokens (default 2048, or the context)"),
    min_cosine: float = typer.Option(0.995, "--min-cosine", help="a layer whose rows fall below this "
                                     "at 4 bits stays exact"),
    rules_out: Optional[Path] = typer.Option(None, "--rules-out", help="write the suggested cells/v1 rules here"),
    as_json: bool = typer.Option(False, "--json"),
    device: str = DEVICE,
    weights: Optional[str] = WEIGHTS,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
):
    """Per layer, K and V: range, quantiles, outlier channels, and the per-row cosine each codec reaches."""
    from larqlpy.model.families import read_config
    from larqlpy.tools.observe import QUANTILES, QUERIES, WIDER
    from larqlpy.tools.observe import kv_stats as measure

    max_positions = _positions(read_config(model_home(model, pre_tokenizer)).max_position_embeddings, max_positions)
    if not 0 < min_cosine <= 1:
        raise LarqlError("--min-cosine must be in (0, 1]")
    if rules_out is not None:
        check_output(rules_out, "--rules-out")
    named = prompt != "-" and _names_a_file(prompt)
    text = read_text(prompt, "PROMPT_OR_FILE", PROMPT_LIMIT) if named else read_prompt(prompt)
    loaded = load_model(model, device=device, weights=weights, allow_unused_tensors=allow_unused_tensors,
                        pre_tokenizer=pre_tokenizer)
    ids = loaded.tokenizer.encode(text)[:max_positions]
    r = measure(loaded, ids, min_cosine)
    if rules_out is not None:
        with atomic_write(rules_out, "--rules-out") as f:
            f.write(r["rules"].encode())
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
            t.add_row(f"{e['layer']} {e['kind'][0]}" if name == "K" else "", name,
                      f"{st['min']:.2f}", f"{st['max']:.2f}",
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
              + ("" if r["calibrated"] else "; with calib=on (`larqlpy calibrate MODEL_DIR`) keys quantize far better"),
              markup=False)


bench_app = typer.Typer(no_args_is_help=True, help="Measurements on a real model.")


def _positions(context: int, given: int | None) -> int:
    """--max-positions, checked against the model's context (default: 2048, or the context)."""
    n = min(2048, context) if given is None else given
    if n < 1:
        raise LarqlError("--max-positions must be >= 1")
    if n > context:
        raise LarqlError(f"--max-positions {n:,} is past the model's context of {context:,} positions")
    return n


def _names_a_file(text: str) -> bool:
    """Whether PROMPT_OR_FILE is a file's path (a long text or one with a NUL byte is not)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):
        return False
