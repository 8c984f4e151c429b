"""Gemma 4 (`gemma4_text`; `gemma4` reads its text_config), as transformers 5's Gemma4TextModel:
gains stored as themselves (no 1 + w), norms before and after attention and the MLP, q/k norms and
an RMSNorm with no gain on every value head, queries unscaled (the norms fix their size), GELU-tanh,
embeddings x sqrt(hidden), final logit softcapping where set. Layers differ in shape:

- global (full_attention) layers have heads of `global_head_dim` (512) -- with
  `attention_k_eq_v`, `num_global_key_value_heads` KV heads and their K projection serving as V --
  and a proportional RoPE (the first `partial_rotary_factor` of each head's frequency pairs turned,
  the exponent over the whole head); sliding layers keep `head_dim`, `sliding_window` and theirs;
- the last `num_kv_shared_layers` layers project no K/V: each attends over the rows of the last
  earlier layer of its own type (`LayerShape.reads`), with an MLP twice as wide where
  `use_double_wide_mlp`;
- `hidden_size_per_layer_input`: a second embedding gives each layer a slice of its own, gated into
  the residual after the MLP; each layer's output is multiplied by its stored `layer_scalar`;
- `enable_moe_block`: experts beside the dense MLP on every layer (model/shaped.py has the math).
"""

from __future__ import annotations

from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.model.config import GLOBAL, SLIDING, LayerShape, ModelConfig, MoeConfig, PerLayerInputs, RopeConfig, \
    activation, require_ints, text_config, token_ids, windows_from_types

DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}


def config(raw: dict[str, Any], prefix: str = "model.") -> ModelConfig:
    require_ints(raw)
    n = raw["num_hidden_layers"]
    types = list(raw.get("layer_types") or [SLIDING if (i + 1) % 6 else GLOBAL for i in range(n)])
    if types and types[-1] != GLOBAL:  # transformers forces it so
        types[-1] = GLOBAL
    if raw.get("use_bidirectional_attention") == "all":
        raise LarqlError("config.json: use_bidirectional_attention 'all' (a non-causal decoder) is not supported")
    windows = windows_from_types({**raw, "layer_types": types}, n, int(raw.get("sliding_window") or 512), [])
    shapes = _shapes(raw, types)
    ple = int(raw.get("hidden_size_per_layer_input", 256) or 0)
    bias = bool(raw.get("attention_bias", False))
    d = int(raw.get("head_dim") or 256)
    return ModelConfig(
        model_type=raw["model_type"], vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=n,
        num_attention_heads=raw["num_attention_heads"], num_key_value_heads=shapes[0].kv_heads, head_dim=d,
        windows=windows, rope_global=_rope(raw, GLOBAL), rope_local=_rope(raw, SLIDING), attention_scale=1.0,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), norm_offset=False, sandwich_norms=True, qk_norm=True,
        qkv_bias=bias, o_bias=bias, attn_softcap=None, final_softcap=raw.get("final_logit_softcapping"),
        embed_scale=True, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        activation=activation(raw, "gelu_pytorch_tanh"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 131_072)),
        **token_ids({"bos_token_id": 2, "pad_token_id": 0, **raw}, default_eos=1), weight_prefix=prefix,
        moe=_moe(raw, n), layer_shapes=shapes, v_norm=True, layer_scalar=True,
        per_layer_inputs=PerLayerInputs(ple, int(raw.get("vocab_size_per_layer_input", 262_144))) if ple else None)


def config_multimodal(raw: dict[str, Any]) -> ModelConfig:
    return config(text_config(raw), prefix="model.language_model.")


def _shapes(raw: dict[str, Any], types: list[str]) -> tuple[LayerShape, ...]:
    """Each layer's head width, KV heads, MLP width, and the layer whose rows it reads."""
    n, d, kv = len(types), int(raw.get("head_dim") or 256), int(raw.get("num_key_value_heads") or 4)
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    wide = int(raw.get("global_head_dim") or 512)
    global_kv = raw.get("num_global_key_value_heads") if k_eq_v else None
    per_layer = raw.get("per_layer_config") or {}  # transformers 5.25 saves the global layers' overrides so
    shared = int(raw.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise LarqlError(f"config.json: num_kv_shared_layers is {shared}, needs 0 to {n - 1} (of {n} layers)")
    first = n - shared
    out = []
    for i, t in enumerate(types):
        own = per_layer.get(str(i)) or per_layer.get(t) or \
            ({} if t == SLIDING or per_layer else {"head_dim": wide, "num_key_value_heads": global_kv})
        reads = None
        if i >= first:
            reads = next((j for j in range(first - 1, -1, -1) if types[j] == t), None)
            if reads is None:
                raise LarqlError(f"config.json: layer {i} ({t}) shares the K/V of an earlier {t} layer, and none "
                                 f"of the first {first} layers is one")
        mlp = raw["intermediate_size"] * (2 if reads is not None and raw.get("use_double_wide_mlp") else 1)
        out.append(LayerShape(int(own.get("head_dim") or d), int(own.get("num_key_value_heads") or kv), mlp, reads,
                              k_eq_v and t == GLOBAL and reads is None))
    return tuple(out)


def _rope(raw: dict[str, Any], kind: str) -> RopeConfig:
    spec = (raw.get("rope_parameters") or DEFAULT_ROPE).get(kind) or DEFAULT_ROPE[kind]
    rope_type, theta = spec.get("rope_type", "default"), float(spec.get("rope_theta", DEFAULT_ROPE[kind]["rope_theta"]))
    if rope_type == "default":
        return RopeConfig(theta)
    if rope_type == "proportional":
        return RopeConfig(theta, "proportional", float(spec.get("factor", 1.0)),
                          partial=float(spec.get("partial_rotary_factor", 1.0)))
    raise LarqlError(f"config.json: unsupported rope_type {rope_type!r} for {kind} layers (supported: default, "
                     "proportional)")


def _moe(raw: dict[str, Any], n: int) -> MoeConfig | None:
    """Experts beside the MLP on every layer: `num_experts` of `moe_intermediate_size`, top
    `top_k_experts`, the k weights renormalized and scaled per expert."""
    if not raw.get("enable_moe_block"):
        return None
    e, k, size = raw.get("num_experts"), raw.get("top_k_experts"), raw.get("moe_intermediate_size")
    for key, v in (("num_experts", e), ("top_k_experts", k), ("moe_intermediate_size", size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LarqlError(f"config.json: enable_moe_block needs a positive {key} ({v!r})")
    if k > e:
        raise LarqlError(f"config.json: top_k_experts is {k}, above the {e} experts")
    return MoeConfig(e, k, size, True, (True,) * n, "experts", ("gate_up_proj", "gate_up_proj", "down_proj"),
                     hf_router="router.proj")
