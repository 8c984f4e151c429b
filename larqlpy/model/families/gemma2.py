"""Gemma 2: gains stored as w and applied as (1 + w), norms before and after both attention and the
MLP, embeddings times sqrt(hidden), GELU-tanh, attention and final logit softcapping, sliding
layers alternating with global ones, queries scaled by query_pre_attn_scalar ** -0.5."""

from __future__ import annotations

from typing import Any

from larqlpy.model.config import GLOBAL, SLIDING, ModelConfig, activation, head_dim, require_ints, single_rope, \
    token_ids, windows_from_types


def gemma_fields(raw: dict[str, Any], default_types: list[str]) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share."""
    require_ints(raw)
    n, d = raw["num_hidden_layers"], head_dim(raw)
    window = raw.get("sliding_window") or 4096
    return dict(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=n,
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]), head_dim=d,
        windows=windows_from_types(raw, n, int(window), default_types),
        attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), norm_offset=True, sandwich_norms=True,
        qkv_bias=bool(raw.get("attention_bias", False)), o_bias=bool(raw.get("attention_bias", False)),
        embed_scale=True, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        activation=activation(raw, "gelu_pytorch_tanh"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
        **token_ids(raw, default_eos=1))


def config(raw: dict[str, Any]) -> ModelConfig:
    n = raw.get("num_hidden_layers") if isinstance(raw.get("num_hidden_layers"), int) else 0
    fields = gemma_fields(raw, [SLIDING if (i + 1) % 2 else GLOBAL for i in range(n)])
    rope = single_rope(raw, 10000.0)
    return ModelConfig(**fields, rope_global=rope, rope_local=rope, qk_norm=False,
                       attn_softcap=raw.get("attn_logit_softcapping", 50.0),
                       final_softcap=raw.get("final_logit_softcapping", 30.0))
