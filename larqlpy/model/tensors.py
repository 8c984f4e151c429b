"""The tensors of one decoder block, as each family declares them (no torch): what the decoder
holds, the checkpoint reader looks for and the loader packs."""

from __future__ import annotations

from typing import Callable

from larqlpy.model.config import ModelConfig


def block_weights(cfg: ModelConfig, layer: int) -> dict[str, tuple[str, Callable[[ModelConfig], tuple[int, ...]]]]:
    """A block's tensors as the family declares them: ours -> (HF name under model.layers.{i}., shape).
    A sparse layer's experts are ours `experts.{j}.gate_proj` (and up, down), beside its `router`."""
    e, f = (lambda c: (c.hidden_size,)), (lambda c: (c.head_dim,))
    out = {
        "q_proj": ("self_attn.q_proj.weight", lambda c: (c.q_dim, c.hidden_size)),
        "k_proj": ("self_attn.k_proj.weight", lambda c: (c.kv_dim, c.hidden_size)),
        "v_proj": ("self_attn.v_proj.weight", lambda c: (c.kv_dim, c.hidden_size)),
        "o_proj": ("self_attn.o_proj.weight", lambda c: (c.hidden_size, c.q_dim)),
        "gate_proj": ("mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
        "up_proj": ("mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
        "down_proj": ("mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
        "input_layernorm": ("input_layernorm.weight", e),
        "post_attention_layernorm": ("post_attention_layernorm.weight", e),
    }
    if cfg.is_sparse(layer):
        for n in ("gate_proj", "up_proj", "down_proj"):
            del out[n]
        out.update(_experts(cfg))
    if cfg.qkv_bias:
        out.update(q_proj_bias=("self_attn.q_proj.bias", lambda c: (c.q_dim,)),
                   k_proj_bias=("self_attn.k_proj.bias", lambda c: (c.kv_dim,)),
                   v_proj_bias=("self_attn.v_proj.bias", lambda c: (c.kv_dim,)))
    if cfg.o_bias:
        out["o_proj_bias"] = ("self_attn.o_proj.bias", e)
    if cfg.qk_norm:
        out.update(q_norm=("self_attn.q_norm.weight", f), k_norm=("self_attn.k_norm.weight", f))
    if cfg.sandwich_norms:
        out.update(pre_feedforward_layernorm=("pre_feedforward_layernorm.weight", e),
                   post_feedforward_layernorm=("post_feedforward_layernorm.weight", e))
    return out


def _experts(cfg: ModelConfig) -> dict:
    m = cfg.moe
    block, (gate, up, down) = m.hf_block, m.hf_experts
    out = {"router": (f"{block}.gate.weight", lambda c: (m.num_experts, c.hidden_size))}
    for j in range(m.num_experts):
        out.update({f"experts.{j}.gate_proj": (f"{block}.experts.{j}.{gate}.weight",
                                               lambda c: (m.intermediate_size, c.hidden_size)),
                    f"experts.{j}.up_proj": (f"{block}.experts.{j}.{up}.weight",
                                             lambda c: (m.intermediate_size, c.hidden_size)),
                    f"experts.{j}.down_proj": (f"{block}.experts.{j}.{down}.weight",
                                               lambda c: (c.hidden_size, m.intermediate_size))})
    return out


def matrix_groups(cfg: ModelConfig, layer: int) -> list[tuple[str, tuple[str, ...]]]:
    """A block's matrices as packed weights hold them, (owner under the block, names): the ones
    reading one input stacked into one matrix (q|k|v, gate|up, each expert's gate|up), decode calling
    one kernel per stack. The router stays float: it picks the experts."""
    mlp = [(f"experts.{j}.", names) for j in range(cfg.moe.num_experts) for names in
           (("gate_proj", "up_proj"), ("down_proj",))] if cfg.is_sparse(layer) else \
        [("", ("gate_proj", "up_proj")), ("", ("down_proj",))]
    return [("", ("q_proj", "k_proj", "v_proj")), ("", ("o_proj",))] + mlp
