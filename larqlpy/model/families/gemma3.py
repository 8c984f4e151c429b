"""Gemma 3: Gemma 2's layout with RMSNorm on each query and key head, no attention softcapping, five
sliding layers to each global one, and two RoPE bases (rope_theta on global layers, with optional
linear scaling; rope_local_base_freq, 10,000, on sliding ones). `gemma3` (multimodal) configs carry
the text decoder in text_config."""

from __future__ import annotations

from typing import Any

from larqlpy.model.config import GLOBAL, SLIDING, ModelConfig, RopeConfig, rope_from, text_config
from larqlpy.model.families.gemma2 import gemma_fields


def config(raw: dict[str, Any], prefix: str = "model.") -> ModelConfig:
    n = raw.get("num_hidden_layers") if isinstance(raw.get("num_hidden_layers"), int) else 0
    pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
    fields = gemma_fields(raw, [GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(n)])
    rope_global, rope_local = _ropes(raw)
    return ModelConfig(**fields, rope_global=rope_global, rope_local=rope_local, qk_norm=True, attn_softcap=None,
                       final_softcap=raw.get("final_logit_softcapping"), weight_prefix=prefix)


def config_multimodal(raw: dict[str, Any]) -> ModelConfig:
    return config(text_config(raw), prefix="language_model.model.")


def _ropes(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """Legacy keys (rope_theta, rope_local_base_freq, rope_scaling) or transformers 5's per-layer-type
    rope_parameters."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and GLOBAL in params:
        g, local = params.get(GLOBAL) or {}, params.get(SLIDING) or {}
        return rope_from(g, g.get("rope_theta", 1e6)), rope_from(local, local.get("rope_theta", 1e4))
    return rope_from(raw.get("rope_scaling"), raw.get("rope_theta", 1e6)), \
        RopeConfig(float(raw.get("rope_local_base_freq", 1e4)))
