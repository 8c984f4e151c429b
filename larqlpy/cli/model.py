"""Model directories: `info`, `convert-gguf`, `calibrate`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from larqlpy.cli.common import ALLOW_UNUSED, DEVICE, PRE_TOKENIZER, cli_text, err, load_model, model_home, out, started
from larqlpy.errors import LarqlError
from larqlpy.files import PROMPT_LIMIT, check_output, read_text


def info(model: Path = typer.Argument(..., help="model directory or .gguf file"),
         as_json: bool = typer.Option(False, "--json"), pre_tokenizer: Optional[str] = PRE_TOKENIZER):
    """Architecture, layers and their kinds, parameter count, dtype."""
    from larqlpy.weights.info import describe

    d = describe(model, pre_tokenizer)
    d["key_calibration"] = cli_text(d["key_calibration"])
    if as_json:
        out.print_json(json.dumps(d))
        return
    t = Table(title=str(model), show_header=False)
    for k in ("model_type", "parameters", "dtypes", "layers", "hidden_size", "heads", "kv_heads", "head_dim",
              "sliding_window", "vocab_size", "rope", "final_logit_softcapping", "experts", "key_calibration",
              "unused_tensors", "pre_tokenizer"):
        v = d[k]
        t.add_row(k, f"{v:,}" if isinstance(v, int) else str(v))
    if d["float_fallback"] is not None:
        t.add_row("float fallback", d["float_fallback"]["text"])
    t.add_row("layer kinds",
              " ".join("G" if k == "global" else "s" for k in d["layer_kinds"]) + "  (s sliding, G global)")
    out.print(t)


def convert_gguf(src: Path = typer.Argument(..., help="a .gguf file (gemma3, llama, qwen2, qwen3, granite, "
                                                      "starcoder2; no experts, no gpt2)"),
                 dest: Path = typer.Argument(..., help="output directory (HF layout)"),
                 force: bool = typer.Option(False, "--force", help="overwrite DEST if it exists"),
                 dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 | float32 (exact): the "
                                           "quantized matrices' precision in DEST"),
                 allow_unused_tensors: bool = ALLOW_UNUSED, pre_tokenizer: Optional[str] = PRE_TOKENIZER):
    """Dequantize a GGUF into safetensors + config.json + tokenizer.json (+ its chat template). `run`
    and every other command also take the .gguf file itself, with no conversion."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from larqlpy.convert.gguf import convert_gguf as convert

    started()
    with Progress(TextColumn("{task.description:<40}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, disable=not err.is_terminal) as bar:
        task = bar.add_task("reading", total=None)

        def step(what: str, done: int, total: int) -> None:
            bar.update(task, description=what[:40], completed=done, total=total)

        convert(src, dest, step, force=force, dtype=dtype, allow_unused_tensors=allow_unused_tensors,
                pre_tokenizer=pre_tokenizer)
    err.print(f"wrote {dest}")


def calibrate(
    model: Path = typer.Argument(..., help="model directory or .gguf file"),
    text: Optional[Path] = typer.Option(None, "--text", help="calibration text (default: the packaged one)"),
    if_needed: bool = typer.Option(False, "--if-needed", help="do nothing when MODEL has a usable calibration"),
    device: str = DEVICE,
    allow_unused_tensors: bool = ALLOW_UNUSED,
    pre_tokenizer: Optional[str] = PRE_TOKENIZER,
):
    """Measure the keys' mean and per-channel scale (what codec calib=on quantizes with) and write
    kv_calibration.safetensors into MODEL (a .gguf file's: into its metadata cache)."""
    from larqlpy.weights import calibration_file
    from larqlpy.model.families import read_config
    from larqlpy.weights.gguf_checkpoint import checkpoint

    home = model_home(model, pre_tokenizer)
    if if_needed:
        cfg = read_config(home)
        pairs, problem = calibration_file.read(home, cfg.num_hidden_layers, *calibration_file.head_shapes(cfg),
                                               checkpoint(model, cfg, allow_unused_tensors).fingerprint)
        if pairs is not None and calibration_file.format_of(home) == calibration_file.FORMAT:
            err.print(f"{model}: already calibrated", markup=False)
            return
        if pairs is not None:
            err.print(f"{model}: calibrating again: its calibration is an older format (no means turning with RoPE)",
                      markup=False)
        if problem:
            err.print(f"{model}: calibrating again: {cli_text(problem)}", markup=False, soft_wrap=True)

    if text is not None and not text.exists():
        raise LarqlError(f"--text {text}: no such file")
    body = None if text is None else read_text(text, "--text", PROMPT_LIMIT)
    read_config(home)
    check_output(home / calibration_file.FILE, "MODEL")  # before the measurement, not after

    from larqlpy.calibration import calibrate as measure

    t0 = time.perf_counter()
    loaded = load_model(model, device=device, key_calibration=False, allow_unused_tensors=allow_unused_tensors,
                        pre_tokenizer=pre_tokenizer)
    cals, meta = measure(loaded, body)
    path = calibration_file.save(home, cals, meta)
    t = Table(title=f"{model}: key calibration over {int(meta['tokens']):,} tokens")
    for col in ("layer", "kind", "mean share of key energy", "scale min", "scale max"):
        t.add_column(col, justify="right")
    for g, c, share in zip(loaded.model.geometries(), cals, map(float, meta["mean_share"].split(","))):
        t.add_row(str(g.index), g.kind, f"{share:.2f}", f"{c.scale.min().item():.2f}", f"{c.scale.max().item():.2f}")
    out.print(t)
    err.print(f"wrote {path} ({time.perf_counter() - t0:.1f} s)", markup=False)
