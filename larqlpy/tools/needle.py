"""Pass-key retrieval (Mohtashami and Jaggi, 2023), the long-context proof of `larqlpy bench needle`.

A five-digit key is hidden at a depth of a filler text of about N tokens and the model is asked for
it, through its chat template where it has one and as a plain continuation where it has not. Every
engine answers the same prompts through the one request pipeline (runner.execute), greedily: found
or not, the resident KV bytes at the end, prefill and decode speed, and for cells/v1 its cell
transitions (cold cells leave memory and come back, RECOVERING, when read). The capacity table is
the seed's other experiment: the longest context each engine's rows fit in one budget (accounted,
tools/residency.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from larqlpy.config import GenerationConfig
from larqlpy.engines import build_provider, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write
from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute
from larqlpy.weights.loader import LoadedModel

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
ASK_CHAT = "What is the pass key? Answer with the number only."
ASK_PLAIN = "What is the pass key? The pass key is"
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n\n")
ANSWER_TOKENS = 12


@dataclass(frozen=True)
class Engine:
    """One engine of the bench: its spelling (identity and options), or cells/v1 under a budget that
    is a fraction of canonical/v1's KV at each length (`fraction`)."""

    identity: str
    options: tuple[str, ...] = ()
    fraction: float | None = None

    def label(self) -> str:
        extra = [f"budget=1/{round(1 / self.fraction)} of canonical" if self.fraction else ""]
        return " ".join([self.identity, *self.options, *filter(None, extra)])


def parse_engine(text: str) -> Engine:
    """`codec/v1 bits=4` -> Engine; refused (LarqlError) here, before any work, when invalid."""
    identity, *options = text.split()
    parse_engine_spec(None, identity, options).stateful("be measured by a needle run")
    return Engine(identity, tuple(options))


def parse_fraction(text: str) -> float:
    """`1/8` or `0.125` -> 0.125 (a budget as a share of canonical/v1's KV)."""
    try:
        num, _, den = text.partition("/")
        value = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise LarqlError(f"expected a fraction such as 1/8, got {text!r}") from None
    if not 0 < value <= 1:
        raise LarqlError(f"a budget fraction must be in (0, 1], got {text!r}")
    return value


def kv_bytes(loaded: LoadedModel, identity: str, options: Sequence[str], positions: int) -> int:
    """What an engine's rows for `positions` positions take (accounted)."""
    provider = build_provider(parse_engine_spec(None, identity, list(options)))
    return sum(provider.layer_bytes(g, positions) for g in loaded.model.geometries())


def prompt(loaded: LoadedModel, positions: int, depth: float, key: int) -> Request:
    """About `positions` tokens of filler with the key at `depth` (0: the start, 1: the end), asked
    for through the chat template when the model has one."""
    tok = loaded.tokenizer
    chat = bool(tok.config.get("chat_template"))
    per = len(tok.encode(FILLER * 10, add_bos=False)) / 10
    n = max(1, int((positions - 60) / per))
    at = round(depth * n)
    hay = INTRO + FILLER * at + NEEDLE.format(key=key) + FILLER * (n - at)
    gen = GenerationConfig.from_dict({"max_tokens": ANSWER_TOKENS, "temperature": 0.0})
    if chat:
        return Request(messages=({"role": "user", "content": hay + "\n" + ASK_CHAT},), gen=gen)
    return Request(prompt=hay + "\n" + ASK_PLAIN, gen=gen)


def run_one(loaded: LoadedModel, engine: Engine, req: Request, budget: int | None) -> dict:
    options = (*engine.options, f"budget={budget}") if budget is not None else engine.options
    r = execute(loaded, replace(req, continuation=engine.identity, options=tuple(options)))
    s = r["stats"]
    row = {"prompt_tokens": r["prompt_tokens"], "answer": r["text"], "resident_kv_bytes": s["resident_kv_bytes"],
           "prefill_tokens_per_s": s["prefill_tokens_per_s"], "decode_tokens_per_s": s["decode_tokens_per_s"]}
    if "transitions" in r:  # cells/v1: how its cells moved, and what it spilled
        row["cells"] = {k: r[k] for k in ("transitions", "cells", "spilled_bytes") if k in r}
    return row


def needle(loaded: LoadedModel, positions: Sequence[int], depths: Sequence[float], engines: Sequence[Engine],
           seed: int = 0, on_row: Callable[[dict], None] | None = None) -> dict:
    """Every (length, depth) against every engine: found or not, and what it cost."""
    context = loaded.config.max_position_embeddings
    rows, skipped = [], []
    rng = random.Random(seed)
    for n in positions:
        if n + ANSWER_TOKENS >= context:
            skipped.append({"positions": n, "reason": f"the model's context is {context:,} positions"})
            continue
        for depth in depths:
            key = rng.randrange(10000, 100000)
            req = prompt(loaded, n, depth, key)
            for engine in engines:
                budget = None
                if engine.fraction is not None:
                    budget = int(engine.fraction * kv_bytes(loaded, "canonical/v1", (), n))
                row = {"engine": engine.label(), "positions": n, "depth": depth, "key": key,
                       **({"budget_bytes": budget} if budget is not None else {})}
                try:
                    row.update(run_one(loaded, engine, req, budget))
                    row["found"] = str(key) in row["answer"]
                except LarqlError as e:  # this engine refuses this length (a budget below its floor): said, not fatal
                    row.update(error=str(e), found=None)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return {"model": str(loaded.path), "rows": rows, "skipped": skipped}


def capacity(loaded: LoadedModel, engines: Sequence[Engine], budget: int, limit: int) -> list[dict]:
    """The longest context (up to `limit`) each engine's rows fit in `budget` bytes, accounted;
    cells/v1 holds any length in any budget (its cold cells leave memory), so its figure is the
    length whose rows it keeps resident, reported as such."""
    out = []
    for e in engines:
        if e.fraction is not None:
            out.append({"engine": e.identity + " (a budget)", "max_positions": None,
                        "note": "holds any length: cold cells leave memory"})
            continue
        lo, hi = 0, limit
        while lo < hi:  # the largest n with kv_bytes(n) <= budget
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if kv_bytes(loaded, e.identity, e.options, mid) <= budget else (lo, mid - 1)
        out.append({"engine": e.label(), "max_positions": lo, "bytes_at_max": kv_bytes(loaded, e.identity,
                                                                                         e.options, lo)})
    return out


def plot(result: dict, path: str | Path) -> None:
    """One panel per length: found (filled) or missed (open) per engine and depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["positions"] for r in result["rows"]})
    engines = list(dict.fromkeys(r["engine"] for r in result["rows"]))
    fig, axes = plt.subplots(1, max(1, len(lengths)), figsize=(4 + 3 * len(lengths), 1 + 0.5 * len(engines)),
                             dpi=120, squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for y, e in enumerate(engines):
            for r in (r for r in result["rows"] if r["engine"] == e and r["positions"] == n):
                if r["found"] is None:  # refused (a budget below the engine's floor)
                    ax.scatter([r["depth"]], [y], s=60, marker="x", color="tab:gray")
                else:
                    ax.scatter([r["depth"]], [y], s=90, marker="o", edgecolors="tab:green" if r["found"] else "tab:red",
                               facecolors="tab:green" if r["found"] else "none")
        ax.set_title(f"{n:,} tokens")
        ax.set_xlabel("depth of the key")
        ax.set_xlim(-0.05, 1.05)
        ax.set_yticks(range(len(engines)))
        ax.set_yticklabels(engines if ax is axes[0][0] else [""] * len(engines), fontsize=7)
        ax.set_ylim(-0.5, len(engines) - 0.5)
    fig.suptitle(f"pass-key retrieval: {Path(result['model']).name} "
                 "(green: found, red circle: missed, gray x: refused)", fontsize=9)
    fig.tight_layout()
    with atomic_write(path, "`plot`") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
