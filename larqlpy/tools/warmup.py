"""Compile and measure ahead what a run on this machine uses (`larqlpy warmup`), for images and CI.

numba compiles each kernel the first time a process calls it with a new signature and no cache
holds it, and kernels/weights/choice.py times each product's shape once: on a fresh machine the
first run pays both. `warmup` runs tiny generations through the paths a user may hit -- each weights
mode, the exact and the codec engine, a prompt past one tile of prefill attention and past one
chunk of decode attention, two sequences decoded in one batch -- so that later runs load every
kernel from numba's cache and every choice from its file. What it compiled, step by step, comes
back as `Step`s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from larqlpy.engines.presets import RECOMMENDED
from larqlpy.kernels import ahead, compiles
from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute, execute_many
from larqlpy.weights.loader import LoadedModel, load

SHORT = "The quick brown fox jumps over the lazy dog."
LONG = 320  # tokens: past one tile of prefill attention (256 queries) and two chunks of decode attention (128 rows)


@dataclass(frozen=True)
class Step:
    name: str  # "int4 codec/v1"
    seconds: float  # wall, compiles included
    compiled: tuple[tuple[str, float], ...]  # (kernel, seconds), outermost compiles and measured choices


def modes(path: Path) -> tuple[str | None, ...]:
    """The weights modes a user may run: what the files hold (native for a .gguf), int8, int4; and
    native beside a directory's float weights when it holds the GGUF's codes too."""
    extra = ("native",) if path.is_dir() and (path / "native.safetensors").is_file() else ()
    return (None, "int8", "int4", *extra)


def warmup(path: str | Path, on_step: Callable[[Step], None] | None = None,
           loader: Callable[..., LoadedModel] = load) -> list[Step]:
    """Every step's compiles on `path`'s model, on the CPU; `on_step` hears each as it ends.
    `loader`: how a weights mode loads (`weights.loader.load`'s parameters)."""
    compiles.watch()
    steps: list[Step] = []
    for weights in modes(Path(path)):
        for step in _mode(Path(path), weights, loader):
            steps.append(step)
            if on_step is not None:
                on_step(step)
    if ahead.started():  # its compiles beside the first load kept the prefetch distance from being measured
        steps.append(_timed("default: load again, measured", lambda: loader(Path(path), device="cpu")))
        if on_step is not None:
            on_step(steps[-1])
    return steps


def _mode(path: Path, weights: str | None, loader) -> Iterator[Step]:
    holder: list[LoadedModel] = []
    label = weights or "default"

    def loading():
        holder.append(loader(path, device="cpu", weights=weights))

    yield _timed(f"{label}: load", loading)
    loaded = holder[0]
    label = loaded.weights
    yield _timed(f"{label} canonical/v1", lambda: _one(loaded, SHORT, 4))
    codec = dict(continuation=RECOMMENDED[0], options=[f"{k}={v}" for k, v in RECOMMENDED[1]])
    yield _timed(f"{label} codec/v1", lambda: _one(loaded, SHORT, 4, **codec))
    yield _timed(f"{label} long prompt", lambda: _long(loaded))
    yield _timed(f"{label} 2 sequences batched", lambda: _batched(loaded))


def _one(loaded: LoadedModel, prompt: str, n: int, **engine) -> None:
    execute(loaded, Request.from_dict(dict(prompt=prompt, max_tokens=n, **engine)))


def _long(loaded: LoadedModel) -> None:
    """A prompt of LONG tokens (fewer where the context is shorter), as ids."""
    n = max(1, min(LONG, loaded.model.cfg.max_position_embeddings - 8))
    base = loaded.tokenizer.encode(SHORT)
    execute(loaded, Request.from_api((base * (n // len(base) + 1))[:n], max_tokens=3))


def _batched(loaded: LoadedModel) -> None:
    reqs = [(i, Request.from_dict(dict(prompt=p, max_tokens=4)))
            for i, p in enumerate((SHORT, "Once upon a time"))]
    for _ in execute_many(loaded, reqs, parallel=2):
        pass


def _timed(name: str, work: Callable[[], None]) -> Step:
    seen: list[compiles.Progress] = []
    t0 = time.perf_counter()
    with compiles.on_progress(seen.append):
        work()
    done = tuple((p.kernel, p.seconds) for p in seen if p.seconds is not None)
    return Step(name, time.perf_counter() - t0, done)
