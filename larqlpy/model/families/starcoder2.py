"""StarCoder2: LayerNorm (gain and bias, norm_epsilon) before attention and before the MLP, biases on
q, k, v, the output and the MLP (use_bias), a non-gated MLP c_fc -> GELU (tanh) -> c_proj, RoPE, and
a sliding window on every layer where `sliding_window` is set."""

from __future__ import annotations

from typing import Any

from larqlpy.model.families import llama


def config(raw: dict[str, Any]):
    window, n = raw.get("sliding_window"), raw.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 0
    bias = bool(raw.get("use_bias", True))
    return llama.config({**raw, "mlp_bias": False, "hidden_act": raw.get("hidden_act", "gelu_pytorch_tanh")},
                        windows=(int(window) if window else None,) * n, layer_norm=True, gated_mlp=False,
                        mlp_bias=bias, qkv_bias=bias, o_bias=bias, rms_norm_eps=float(raw.get("norm_epsilon", 1e-5)),
                        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
