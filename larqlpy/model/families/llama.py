"""Llama (and the families that are Llama with a twist, see mistral.py): RMSNorm gains as stored,
a pre-norm before attention and one before the MLP, SiLU-gated MLP, one RoPE base with optional
linear or llama3 scaling, no sliding layers."""

from __future__ import annotations

from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.model.config import ModelConfig, activation, head_dim, require_ints, single_rope, token_ids


def config(raw: dict[str, Any], windows: tuple | None = None, **overrides: Any) -> ModelConfig:
    """A Llama-shaped config; the families built on it pass their windows and differences."""
    require_ints(raw)
    if raw.get("mlp_bias"):
        raise LarqlError(f"config.json: {raw['model_type']} with mlp_bias is not supported")
    n, d = raw["num_hidden_layers"], head_dim(raw)
    rope = single_rope(raw, 10000.0)
    bias = bool(raw.get("attention_bias", False))
    fields = dict(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=n,
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]), head_dim=d,
        windows=windows if windows is not None else (None,) * n, rope_global=rope, rope_local=rope,
        attention_scale=d ** -0.5, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), norm_offset=False,
        sandwich_norms=False, qk_norm=False, qkv_bias=bias, o_bias=bias, attn_softcap=None, final_softcap=None,
        embed_scale=False, tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        activation=activation(raw, "silu"), max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        **token_ids(raw))
    fields.update(overrides)
    return ModelConfig(**fields)
