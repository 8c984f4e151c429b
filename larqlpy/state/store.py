"""Saving an engine state to a state file (format.py describes it) and restoring one into a fresh
engine state."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch

from larqlpy.engines.stores.state import EngineState
from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write
from larqlpy.state.format import ALIGN, MAGIC, PAGE, PREFIX, VERSION, SavedState, align, jsonable


def save_state(path: str | Path, state: EngineState, *, model_fingerprint: str, tokenizer_fingerprint: str,
               tokens: list[int], logits: torch.Tensor | None, extra: dict | None = None,
               what: str = "`save_state`") -> int:
    """Write `state` to `path` atomically (`what` names the path in a refusal). Returns the file size."""
    path = Path(path)
    blobs: list[bytes] = []
    offset = 0
    cells, layers = [], []

    def put(a: np.ndarray) -> dict:
        nonlocal offset
        raw = np.ascontiguousarray(a).tobytes()
        entry = {"dtype": np.dtype(a.dtype).str, "shape": list(a.shape), "offset": offset, "length": len(raw),
                 "crc32": zlib.crc32(raw)}
        pad = align(len(raw), ALIGN) - len(raw)
        blobs.append(raw + b"\0" * pad)
        offset += len(raw) + pad
        return entry

    for store in state.layers:
        g = store.geometry
        layers.append({"index": g.index, "kind": g.kind, "window": g.window, "n_kv_heads": g.n_kv_heads,
                       "head_dim": g.head_dim, "end": store.end, "retained": list(store.retained()),
                       **({"meta": store.meta()} if store.meta() else {})})
        for meta, arrays in store.export():
            cells.append({"layer": g.index, **meta, "fields": {name: put(a) for name, a in arrays.items()}})
    header = {
        "format": VERSION, "model_fingerprint": model_fingerprint, "tokenizer_fingerprint": tokenizer_fingerprint,
        "engine": {"identity": state.identity, "options": jsonable(state.options)},
        "tokens": [int(t) for t in tokens], "processed": state.position, "layers": layers, "cells": cells,
        "logits": put(logits.float().cpu().numpy()) if logits is not None else None,
        **(extra or {}),
    }
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    data_offset = align(PREFIX.size + len(raw_header), PAGE)
    header_bytes = PREFIX.pack(MAGIC, VERSION, 0, len(raw_header), zlib.crc32(raw_header), 0) + raw_header
    with atomic_write(path, what) as f:
        f.write(header_bytes)
        f.write(b"\0" * (data_offset - len(header_bytes)))
        for b in blobs:
            f.write(b)
    return data_offset + offset


def restore_state(saved: SavedState, state: EngineState) -> None:
    """Fill a fresh state (same engine, same geometry) with the saved cells."""
    layers = saved.header["layers"]
    if len(layers) != len(state.layers):
        raise LarqlError(f"{saved.path}: {len(layers)} layers saved, the model has {len(state.layers)}")
    try:
        for info, store in zip(layers, state.layers):
            g = store.geometry
            if (info["index"], info["window"], info["n_kv_heads"], info["head_dim"]) != \
                    (g.index, g.window, g.n_kv_heads, g.head_dim):
                raise ValueError(f"layer {g.index} geometry differs")
            if info.get("meta", {}) != store.meta():  # e.g. codes made under another key calibration
                raise ValueError(f"layer {g.index} was saved with {_meta_str(info.get('meta', {}))}, "
                                 f"this run has {_meta_str(store.meta())}")
            store.restore(info["end"], saved.records.get(g.index, []))
        if any(s.end != saved.processed for s in state.layers):
            raise ValueError("layers disagree with the processed count")
    except (ValueError, KeyError, TypeError) as e:
        raise LarqlError(f"{saved.path}: cell table does not fit this engine ({e})") from None


def _meta_str(meta: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sorted(meta.items())) or "nothing extra"
