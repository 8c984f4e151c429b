"""The tensors of one decoder block, as each family declares them (no torch): what the decoder
holds, the checkpoint reader looks for and the loader packs."""

from __future__ import annotations

from typing import Callable

from larqlpy.model import shaped_tensors
from larqlpy.model.config import ModelConfig


def block_weights(cfg: ModelConfig, layer: int) -> dict[str, tuple[str, Callable[[ModelConfig], tuple[int, ...]]]]:
    """A block's tensors as the family declares them: ours -> (HF name under model.layers.{i}., shape).
    A sparse layer's experts are ours `experts.{j}.gate_proj` (and up, down), beside its `router`."""
    if cfg.layer_shapes is not None:  # layers of their own shapes (Gemma 4)
        return shaped_tensors.block_weights(cfg, layer)
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
    if cfg.mla is not None:
        return _mla(cfg, out)
    if cfg.layer_norm:
        out.update(input_layernorm_bias=("input_layernorm.bias", e), post_attention_layernorm_bias=(
            "post_attention_layernorm.bias", e))
    if not cfg.gated_mlp:  # up then down: StarCoder2's c_fc and c_proj
        del out["gate_proj"]
        out.update(up_proj=("mlp.c_fc.weight", out["up_proj"][1]), down_proj=("mlp.c_proj.weight", out["down_proj"][1]))
        if cfg.mlp_bias:
            out.update(up_proj_bias=("mlp.c_fc.bias", lambda c: (c.intermediate_size,)),
                       down_proj_bias=("mlp.c_proj.bias", e))
    if cfg.qkv_bias:
        out.update(q_proj_bias=("self_attn.q_proj.bias", lambda c: (c.q_dim,)),
                   k_proj_bias=("self_attn.k_proj.bias", lambda c: (c.kv_dim,)),
                   v_proj_bias=("self_attn.v_proj.bias", lambda c: (c.kv_dim,)))
    if cfg.o_bias:
        out["o_proj_bias"] = ("self_attn.o_proj.bias", e)
    if cfg.attention_sinks:
        out["sinks"] = ("self_attn.sinks", lambda c: (c.num_attention_heads,))
    if cfg.qk_norm:
        out.update(q_norm=("self_attn.q_norm.weight", f), k_norm=("self_attn.k_norm.weight", f))
    if cfg.sandwich_norms:
        out.update(pre_feedforward_layernorm=("pre_feedforward_layernorm.weight", e),
                   post_feedforward_layernorm=("post_feedforward_layernorm.weight", e))
    return _gpt2(out) if cfg.layout == "gpt2" else out


GPT2_NAMES = {"self_attn.o_proj": "attn.c_proj", "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2"}


def _gpt2(out: dict) -> dict:
    """GPT-2's names: q|k|v one matrix (c_attn) and one bias, under h.{i}."""
    for n in ("q_proj", "k_proj", "v_proj", "q_proj_bias", "k_proj_bias", "v_proj_bias"):
        out.pop(n, None)
    qkv = lambda c: (c.q_dim + 2 * c.kv_dim,)  # noqa: E731
    out.update(qkv_proj=("attn.c_attn.weight", lambda c: (*qkv(c), c.hidden_size)),
               qkv_proj_bias=("attn.c_attn.bias", qkv))
    renamed = {}
    for ours, (hf, shape) in out.items():
        owner, _, what = hf.rpartition(".")
        renamed[ours] = (f"{GPT2_NAMES.get(owner, owner)}.{what}", shape)
    return renamed


def top_weights(cfg: ModelConfig) -> dict[str, tuple[str, Callable[[ModelConfig], tuple[int, ...]]]]:
    """The tensors outside the blocks: ours -> (name under the decoder's prefix, shape); the untied
    LM head lies beside the decoder (lm_head.weight)."""
    e, table = (lambda c: (c.hidden_size,)), (lambda c: (c.vocab_size, c.hidden_size))
    gpt2 = cfg.layout == "gpt2"
    out = {"embed_tokens": ("wte.weight" if gpt2 else "embed_tokens.weight", table),
           "norm": ("ln_f.weight" if gpt2 else "norm.weight", e)}
    if cfg.layer_norm:
        out["norm_bias"] = ("ln_f.bias" if gpt2 else "norm.bias", e)
    if cfg.learned_positions:
        out["embed_positions"] = ("wpe.weight", lambda c: (c.max_position_embeddings, c.hidden_size))
    return {**out, **shaped_tensors.top_weights(cfg)}


def layers_name(cfg: ModelConfig) -> str:
    """Where block i's tensors live under the decoder's prefix."""
    return "h." if cfg.layout == "gpt2" else "layers."


def _experts(cfg: ModelConfig) -> dict:
    m = cfg.moe
    block, (gate, up, down) = m.hf_block, m.hf_experts
    out = {"router": (f"{block}.{m.hf_router}.weight", lambda c: (m.num_experts, c.hidden_size))}
    for j in range(m.num_experts):
        out.update({f"experts.{j}.gate_proj": (f"{block}.experts.{j}.{gate}.weight",
                                               lambda c: (m.intermediate_size, c.hidden_size)),
                    f"experts.{j}.up_proj": (f"{block}.experts.{j}.{up}.weight",
                                             lambda c: (m.intermediate_size, c.hidden_size)),
                    f"experts.{j}.down_proj": (f"{block}.experts.{j}.{down}.weight",
                                               lambda c: (c.hidden_size, m.intermediate_size))})
        if m.expert_bias:
            size = lambda c: (m.intermediate_size,)  # noqa: E731
            out.update({f"experts.{j}.{n}_bias": (f"{block}.experts.{j}.{hf}.bias", shape) for n, hf, shape in (
                ("gate_proj", gate, size), ("up_proj", up, size), ("down_proj", down, lambda c: (c.hidden_size,)))})
    if m.router_bias:
        out["router_bias"] = (f"{block}.{m.hf_router}.bias", lambda c: (m.num_experts,))
    if m.shared_intermediate:  # DeepSeek's shared experts, one dense MLP
        size = m.shared_intermediate
        out.update({"shared.gate_proj": (f"{block}.shared_experts.{gate}.weight", lambda c: (size, c.hidden_size)),
                    "shared.up_proj": (f"{block}.shared_experts.{up}.weight", lambda c: (size, c.hidden_size)),
                    "shared.down_proj": (f"{block}.shared_experts.{down}.weight", lambda c: (c.hidden_size, size))})
    if m.topk_method == "noaux_tc":  # DeepSeek-V3's bias on the scores the experts are chosen by
        out["score_bias"] = (f"{block}.{m.hf_router}.e_score_correction_bias", lambda c: (m.num_experts,))
    return out


def _mla(cfg: ModelConfig, out: dict) -> dict:
    """Multi-head latent attention's tensors in place of q, k, v (model/mla.py)."""
    m, heads = cfg.mla, cfg.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    for n in ("q_proj", "k_proj", "v_proj"):
        del out[n]
    attn = "self_attn."
    if m.q_lora_rank is None:
        out["q_proj"] = (attn + "q_proj.weight", lambda c: (heads * qk, c.hidden_size))
    else:
        out.update(q_a_proj=(attn + "q_a_proj.weight", lambda c: (m.q_lora_rank, c.hidden_size)),
                   q_a_norm=(attn + "q_a_layernorm.weight", lambda c: (m.q_lora_rank,)),
                   q_b_proj=(attn + "q_b_proj.weight", lambda c: (heads * qk, m.q_lora_rank)))
    out.update(kv_a_proj=(attn + "kv_a_proj_with_mqa.weight",
                          lambda c: (m.kv_lora_rank + m.qk_rope_head_dim, c.hidden_size)),
               kv_a_norm=(attn + "kv_a_layernorm.weight", lambda c: (m.kv_lora_rank,)),
               o_proj=(attn + "o_proj.weight", lambda c: (c.hidden_size, heads * m.v_head_dim)))
    if m.kv_b_split:  # llama.cpp's attn_k_b, attn_v_b: (heads, r, nope) and (heads, v, r)
        out.update(k_b_proj=(attn + "k_b_proj.weight", lambda c: (heads, m.kv_lora_rank, m.qk_nope_head_dim)),
                   v_b_proj=(attn + "v_b_proj.weight", lambda c: (heads, m.v_head_dim, m.kv_lora_rank)))
    else:
        out["kv_b_proj"] = (attn + "kv_b_proj.weight",
                            lambda c: (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    return out


def head_matrices(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """Matrices held per head (heads, rows, inputs) that `native` runs on their own codes, every
    head's rows one packed matrix: DeepSeek's W_UK and W_UV as a GGUF splits them (model/mla.py)."""
    return ("k_b_proj", "v_b_proj") if cfg.mla is not None and cfg.mla.kv_b_split else ()


def matrix_groups(cfg: ModelConfig, layer: int) -> list[tuple[str, tuple[str, ...]]]:
    """A block's matrices as packed weights hold them, (owner under the block, names): the ones
    reading one input stacked into one matrix (q|k|v, gate|up, each expert's gate|up), decode calling
    one kernel per stack. The router stays float: it picks the experts."""
    if cfg.layer_shapes is not None:
        return shaped_tensors.matrix_groups(cfg, layer)
    mlp = [(f"experts.{j}.", names) for j in range(cfg.moe.num_experts) for names in
           (("gate_proj", "up_proj"), ("down_proj",))] if cfg.is_sparse(layer) else \
        [("", ("gate_proj", "up_proj")), ("", ("down_proj",))]
    if not cfg.gated_mlp:
        mlp = [("", ("up_proj",)), ("", ("down_proj",))]
    if cfg.is_sparse(layer) and cfg.moe.shared_intermediate:
        mlp += [("shared.", ("gate_proj", "up_proj")), ("shared.", ("down_proj",))]
    qkv = ("qkv_proj",) if cfg.layout == "gpt2" else ("q_proj", "k_proj", "v_proj")
    if cfg.mla is not None:  # kv_b_proj stays float: attention folds it into queries and outputs per head
        lora = cfg.mla.q_lora_rank is not None
        return [("", ("q_a_proj" if lora else "q_proj", "kv_a_proj")), *([("", ("q_b_proj",))] if lora else []),
                ("", ("o_proj",))] + mlp
    return [("", qkv), ("", ("o_proj",))] + mlp
