"""GPT-2: learned absolute positions (wpe) added to the token embeddings, no RoPE; LayerNorm before
attention and before the MLP; q|k|v one matrix (c_attn) with one bias; a non-gated GELU (tanh,
gelu_new) MLP; biases everywhere; the LM head tied. Its files' Conv1D matrices are stored
transposed (inputs, outputs), read as their transposes (weights/checkpoint.py). config.json spells
the sizes GPT-2's way (n_embd, n_layer, n_head, n_inner, n_positions)."""

from __future__ import annotations

from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.model.config import RopeConfig
from larqlpy.model.families import llama

NO_ROPE = RopeConfig(10000.0, "none")
SIZES = ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions")  # GPT-2's spellings, checked before renaming


def config(raw: dict[str, Any]):
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
        raise LarqlError("config.json: gpt2 with scale_attn_by_inverse_layer_idx or without scale_attn_weights "
                         "is not supported")
    raw = {"n_positions": 1024, **raw}
    bad = [k for k in SIZES if not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool) or raw[k] <= 0]
    if bad:
        raise LarqlError(f"config.json: missing or invalid {', '.join(bad)}")
    hidden = raw["n_embd"]
    renamed = {**raw, "hidden_size": hidden, "num_hidden_layers": raw["n_layer"],
               "num_attention_heads": raw["n_head"], "max_position_embeddings": raw["n_positions"],
               "intermediate_size": raw.get("n_inner") or 4 * hidden,
               "hidden_act": raw.get("activation_function", "gelu_new"), "mlp_bias": False,
               "num_key_value_heads": None, "head_dim": None, "rope_scaling": None, "rope_parameters": None}
    return llama.config(renamed, layer_norm=True, gated_mlp=False, mlp_bias=True, qkv_bias=True, o_bias=True,
                        learned_positions=True, layout="gpt2", rope_global=NO_ROPE, rope_local=NO_ROPE,
                        rms_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
                        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
