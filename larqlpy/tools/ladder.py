"""The measured ladder: each engine at several context lengths on a real model, against canonical/v1.

For every length N: prefill the same N tokens of a fixed text, then decode `steps` tokens
teacher-forced with canonical's greedy continuation. Per engine: live resident KV bytes, bytes per
position, prefill and decode tokens/s, the mean per-row cosine of the rows it holds against
canonical's rows for the same positions (K and V, every layer), and the mean next-token KL against
canonical over the decode steps.
"""

from __future__ import annotations

import ctypes
import gc
import time
from pathlib import Path
from typing import Sequence

import psutil
import torch

from larqlpy.engines import EngineSpec, build_provider, new_state, preset_spec
from larqlpy.engines.presets import LADDER
from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write
from larqlpy.model.decoder import prefill
from larqlpy.tools.quality import kl
from larqlpy.weights.loader import LoadedModel

TEXT = Path(__file__).resolve().parent.parent / "data" / "long.txt"


def ladder_ids(tokenizer, n: int) -> list[int]:
    text = TEXT.read_text()
    ids = tokenizer.encode(text)
    while len(ids) < n + 1:
        ids = ids + tokenizer.encode(text)[1:]
    return ids[:n]


def _run(model, spec: EngineSpec, ids: list[int], steps: int, forced: list[int] | None):
    state = new_state(spec, model.geometries(), model.device)
    t0 = time.perf_counter()
    logits = prefill(model, state, ids, 1024)[-1]
    t_prefill = time.perf_counter() - t0
    resident = state.resident_bytes()
    out, toks = [logits], []
    t0 = time.perf_counter()
    for i in range(steps):
        tok = forced[i] if forced is not None else int(out[-1].argmax())
        toks.append(tok)
        out.append(model(torch.tensor([tok]), state)[-1])
    t_decode = time.perf_counter() - t0
    return state, torch.stack(out[:-1]), toks, t_prefill, t_decode, resident


@torch.inference_mode()
def row_cosine(state, ref_state) -> float:
    """Mean cosine of each retained K and V row against canonical's row at the same position."""
    total, count = 0.0, 0
    for store, ref in zip(state.layers, ref_state.layers):
        base, end = store.retained()
        k, v = store.read(base, torch.float32)
        rk, rv = ref.read(base, torch.float32)
        for a, b in ((k, rk), (v, rv)):
            a, b = a.reshape(-1, a.shape[-1]).double(), b.reshape(-1, b.shape[-1]).double()
            # identical rows are exactly 1 (the formula can round to an ulp below it)
            cos = torch.where((a == b).all(-1), 1.0, torch.nn.functional.cosine_similarity(a, b, dim=-1))
            total += cos.sum().item()
            count += cos.numel()
    return total / count if count else 1.0


def ladder(loaded: LoadedModel, positions: Sequence[int], specs: Sequence[EngineSpec] | None = None, steps: int = 8,
           on_length=None) -> dict:
    model = loaded.model
    skipped = []
    if specs is None:  # the default set: leave out engines this model's geometry refuses, and say so
        specs = []
        for preset in LADDER:
            spec = preset_spec(preset)
            try:
                build_provider(spec).check_geometry(model.geometries())
                specs.append(spec)
            except LarqlError as e:
                skipped.append({"engine": spec.describe(), "reason": str(e)})
    canonical = EngineSpec()
    rows = []
    for n in positions:
        if on_length is not None:
            on_length(n)
        ids = ladder_ids(loaded.tokenizer, n)
        ref_state, ref_logits, ref_toks, *_ = _run(model, canonical, ids, steps, None)
        for spec in specs:
            state, logits, _, t_pre, t_dec, resident = _run(model, spec, ids, steps, ref_toks)
            rows.append({
                "engine": spec.describe(), "positions": n, "resident_kv_bytes": resident,
                "bytes_per_position": resident / n, "prefill_tokens_per_s": n / t_pre,
                "decode_tokens_per_s": steps / t_dec if t_dec else 0.0,
                "row_cosine": row_cosine(state, ref_state),
                "next_token_kl": kl(ref_logits, logits).mean().item(),
            })
    return {"model": str(loaded.path), "steps": steps, "rows": rows, "skipped": skipped}


def plot(result: dict, path: str | Path) -> None:
    """Resident KV bytes against positions, one line per engine, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    engines = list(dict.fromkeys(r["engine"] for r in result["rows"]))
    for e in engines:
        pts = sorted((r["positions"], r["resident_kv_bytes"]) for r in result["rows"] if r["engine"] == e)
        ax.plot([p for p, _ in pts], [b / 2**20 for _, b in pts], marker="o", label=e)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("positions")
    ax.set_ylabel("resident KV (MiB, live allocations)")
    ax.set_title(f"KV residency by engine: {Path(result['model']).name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_write(path, "`plot`") as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def _anon_bytes() -> int:
    """This process's anonymous resident memory (the mapped weights are file-backed: not counted)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    m = psutil.Process().memory_info()
    return m.rss - getattr(m, "shared", 0)


def _release_free_heap() -> None:
    """Hand freed heap pages back to the OS, so the next engine's growth is its own (glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def until_budget(loaded: LoadedModel, spec: EngineSpec, budget: int, chunk: int = 128,
                 max_positions: int = 16384) -> dict:
    """Grow a context in chunks of `chunk` until the process's anonymous memory has grown by more
    than `budget` over where it stood before the engine's first row (the real peak, sampled after
    every chunk: KV rows plus every transient the engine and the forward pass need)."""
    ids = ladder_ids(loaded.tokenizer, max_positions)
    warm = new_state(EngineSpec(), loaded.model.geometries(), loaded.device)
    prefill(loaded.model, warm, ids[:chunk], chunk)  # touch the weights and warm the kernels
    del warm
    _release_free_heap()
    base = _anon_bytes()
    state = new_state(spec, loaded.model.geometries(), loaded.device)
    peak, fits, n = 0, None, 0
    while n < max_positions:
        prefill(loaded.model, state, ids[n:n + chunk], chunk)
        peak = max(peak, _anon_bytes() - base)
        if peak > budget:
            fits = n  # the length before this chunk was the last that fitted
            break
        n = min(max_positions, n + chunk)
    resident = state.resident_bytes()
    del state
    _release_free_heap()
    return {"engine": spec.describe(), "budget": budget, "fits_positions": fits if fits is not None else n,
            "reached_budget": fits is not None, "peak_growth_bytes": peak, "resident_kv_bytes_at_end": resident}
