"""Qwen2: Llama with biases on q, k and v (not on the output), and sliding layers only with
use_sliding_window (from layer max_window_layers on)."""

from __future__ import annotations

from typing import Any

from larqlpy.model.config import GLOBAL, SLIDING, windows_from_types
from larqlpy.model.families import llama


def windows(raw: dict[str, Any]) -> tuple | None:
    """Qwen's rule: layers from max_window_layers on slide, when use_sliding_window is set."""
    n = raw.get("num_hidden_layers")
    if not isinstance(n, int):
        return None
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    first = raw.get("max_window_layers", 28)
    default = [SLIDING if window is not None and i >= first else GLOBAL for i in range(n)]
    return windows_from_types(raw, n, window, default)


def config(raw: dict[str, Any]):
    return llama.config(raw, windows=windows(raw), qkv_bias=True, o_bias=False)
