"""Qwen3: Qwen2's layout with RMSNorm on each query and key head (gains as stored) instead of
q/k/v biases (unless attention_bias), and a head_dim of its own."""

from __future__ import annotations

from typing import Any

from larqlpy.model.families import llama, qwen2


def config(raw: dict[str, Any]):
    bias = bool(raw.get("attention_bias", False))
    return llama.config(raw, windows=qwen2.windows(raw), qk_norm=True, qkv_bias=bias, o_bias=bias)
