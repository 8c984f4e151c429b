"""The tensors of a model whose layers have shapes of their own (`ModelConfig.layer_shapes`: Gemma 4),
as HF names them (no torch): what model/tensors.py answers for such a model."""

from __future__ import annotations

from typing import Callable

from larqlpy.model.config import ModelConfig

Table = dict[str, tuple[str, Callable[[ModelConfig], tuple[int, ...]]]]


def _fixed(*shape: int) -> Callable[[ModelConfig], tuple[int, ...]]:
    return lambda c: shape


def block_weights(cfg: ModelConfig, layer: int) -> Table:
    """Layer `layer`'s tensors: ours -> (HF name under layers.{i}., shape). A layer that reads an
    earlier one's rows has no k/v projections or k norm; one whose K serves as V has no v_proj."""
    s, e, h = cfg.shape(layer), cfg.hidden_size, cfg.num_attention_heads
    q, kv = h * s.head_dim, s.kv_heads * s.head_dim
    out = {"q_proj": ("self_attn.q_proj.weight", _fixed(q, e)),
           "q_norm": ("self_attn.q_norm.weight", _fixed(s.head_dim)),
           "o_proj": ("self_attn.o_proj.weight", _fixed(e, q))}
    projections = [] if s.reads is not None else ["k"] if s.k_as_v else ["k", "v"]
    for p in projections:
        out[f"{p}_proj"] = (f"self_attn.{p}_proj.weight", _fixed(kv, e))
    if s.reads is None:
        out["k_norm"] = ("self_attn.k_norm.weight", _fixed(s.head_dim))
    if cfg.qkv_bias:
        out.update({f"{p}_proj_bias": (f"self_attn.{p}_proj.bias", _fixed(kv)) for p in projections})
        out.update(q_proj_bias=("self_attn.q_proj.bias", _fixed(q)), o_proj_bias=("self_attn.o_proj.bias", _fixed(e)))
    out.update(gate_proj=("mlp.gate_proj.weight", _fixed(s.intermediate_size, e)),
               up_proj=("mlp.up_proj.weight", _fixed(s.intermediate_size, e)),
               down_proj=("mlp.down_proj.weight", _fixed(e, s.intermediate_size)))
    for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
              "post_feedforward_layernorm"):
        out[n] = (f"{n}.weight", _fixed(e))
    if cfg.layer_scalar:
        out["layer_scalar"] = ("layer_scalar", _fixed(1))
    if cfg.per_layer_inputs is not None:
        p = cfg.per_layer_inputs.size
        out.update(per_layer_input_gate=("per_layer_input_gate.weight", _fixed(p, e)),
                   per_layer_projection=("per_layer_projection.weight", _fixed(e, p)),
                   post_per_layer_input_norm=("post_per_layer_input_norm.weight", _fixed(e)))
    if cfg.moe is not None:
        out.update(_experts(cfg))
    return out


def _experts(cfg: ModelConfig) -> Table:
    """The router (a linear, a gain on its normed input, a scale per expert), the norms around the
    experts, and each expert's matrices as views of the layer's two 3-D tensors (checkpoint.view_of):
    gate_up_proj (experts, 2 x width, hidden: gate rows, then up) and down_proj (experts, hidden, width)."""
    m, e = cfg.moe, cfg.hidden_size
    n = m.intermediate_size
    out = {"router": ("router.proj.weight", _fixed(m.num_experts, e)), "router_scale": ("router.scale", _fixed(e)),
           "per_expert_scale": ("router.per_expert_scale", _fixed(m.num_experts))}
    for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
        out[name] = (f"{name}.weight", _fixed(e))
    for j in range(m.num_experts):
        out.update({f"experts.{j}.gate_proj": (f"experts.gate_up_proj@e{j},r0:{n}", _fixed(n, e)),
                    f"experts.{j}.up_proj": (f"experts.gate_up_proj@e{j},r{n}:{2 * n}", _fixed(n, e)),
                    f"experts.{j}.down_proj": (f"experts.down_proj@e{j}", _fixed(e, n))})
    return out


def top_weights(cfg: ModelConfig) -> Table:
    """The per-layer inputs' tensors beside the embeddings: the table (vocab x layers * size), the
    projection of the token embeddings to every layer's slice, and the norm of a slice."""
    p = cfg.per_layer_inputs
    if p is None:
        return {}
    wide = cfg.num_hidden_layers * p.size
    return {"embed_tokens_per_layer": ("embed_tokens_per_layer.weight", _fixed(p.vocab, wide)),
            "per_layer_model_projection": ("per_layer_model_projection.weight", _fixed(wide, cfg.hidden_size)),
            "per_layer_projection_norm": ("per_layer_projection_norm.weight", _fixed(p.size))}


def matrix_groups(cfg: ModelConfig, layer: int) -> list[tuple[str, tuple[str, ...]]]:
    """The matrices packed weights hold, stacked where they read one input: q with the k and v the
    layer has, gate|up, each expert's gate|up; the per-layer inputs' gate and projection alone (they
    read other inputs)."""
    names = block_weights(cfg, layer)
    qkv = tuple(n for n in ("q_proj", "k_proj", "v_proj") if n in names)
    experts = [(f"experts.{j}.", group) for j in range(cfg.moe.num_experts)
               for group in (("gate_proj", "up_proj"), ("down_proj",))] if cfg.moe is not None else []
    per_layer = [("", ("per_layer_input_gate",)), ("", ("per_layer_projection",))] \
        if cfg.per_layer_inputs is not None else []
    return [("", qkv), ("", ("o_proj",)), ("", ("gate_proj", "up_proj")), ("", ("down_proj",))] + experts + per_layer


def top_matrices(cfg: ModelConfig) -> tuple[str, ...]:
    """The matrices beside the embeddings that pack as they do: the per-layer inputs' table (only
    gathered from, a row a token, as an embedding is) and the projection to every layer's slice."""
    return ("embed_tokens_per_layer", "per_layer_model_projection") if cfg.per_layer_inputs is not None else ()
