"""Granite: Llama with four multipliers: the embeddings times embedding_multiplier, each block's
attention and MLP outputs times residual_multiplier before their residual adds, the attention
scores times attention_multiplier (in place of head_dim ** -0.5) and the logits divided by
logits_scaling (transformers' GraniteModel)."""

from __future__ import annotations

from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.model.families import llama


def multipliers(raw: dict[str, Any]) -> dict[str, float]:
    """Granite's four, as ModelConfig fields (transformers' defaults, 1.0, where config.json has none)."""
    out = {}
    for key, field in (("embedding_multiplier", "embedding_multiplier"), ("residual_multiplier", "residual_multiplier"),
                       ("attention_multiplier", "attention_scale"), ("logits_scaling", "logits_scaling")):
        v = raw.get(key, 1.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise LarqlError(f"config.json: {key} must be a positive number, got {v!r}")
        out[field] = float(v)
    return out


def config(raw: dict[str, Any]):
    return llama.config(raw, **multipliers(raw))
