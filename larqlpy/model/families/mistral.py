"""Mistral: Llama with a sliding window on every layer (`sliding_window`, 4,096 unless config.json
says null, as transformers reads it)."""

from __future__ import annotations

from typing import Any

from larqlpy.model.families import llama


def config(raw: dict[str, Any]):
    window = raw.get("sliding_window", 4096)
    n = raw.get("num_hidden_layers", 0)
    return llama.config(raw, windows=(int(window) if window else None,) * n if isinstance(n, int) else None)
