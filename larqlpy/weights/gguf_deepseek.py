"""deepseek2 GGUF files (DeepSeek-V2, V2-Lite, V3 and their kin) as llama.cpp's converter writes them,
read back into the HF layout of families/deepseek.py.

Tensors: attn_q, or attn_q_a / attn_q_a_norm / attn_q_b (a q LoRA); attn_kv_a_mqa (the latent and
the shared RoPE key) and attn_kv_a_norm; the per-head up-projections as attn_kv_b (older files, HF's
kv_b_proj) or split, as newer converters write them for the absorbed attention: attn_k_b (heads x
kv_lora_rank x qk_nope, each head's W_UK transposed) and attn_v_b (heads x v_head x kv_lora_rank),
read as they are (MlaConfig.kv_b_split, config.json's `kv_b_split`, a key of this route only); the
router ffn_gate_inp, V3's correction bias exp_probs_b.bias, the experts ffn_*_exps, the shared ones
ffn_*_shexp, and the dense ffn_* of the leading_dense_block_count first layers. No row is permuted:
llama.cpp rotates deepseek2's interleaved pairs as DeepSeek does (rope_interleave).

Metadata: key_length / value_length are the latent row's in newer files (kv_lora_rank +
qk_rope, kv_lora_rank) with the per-head sizes under key_length_mla / value_length_mla; older files
hold the per-head sizes under key_length / value_length. rope.dimension_count is qk_rope_head_dim.
expert_gating_func (absent: softmax, as llama.cpp reads older V2 files) picks the version: sigmoid is
V3 (noaux_tc, its groups, renormalized where expert_weights_norm), softmax V2 (group-limited where
fewer groups are used than there are, DeepSeek-V2's best-score rule; llama.cpp's newer graphs rank
groups by their two best scores, V3's rule). YaRN: rope.scaling.{factor, original_context_length},
and yarn_log_multiplier, which the converter writes as 0.1 x mscale_all_dim (llama.cpp divides it
back) and which llama.cpp runs with mscale equal to it (cos and sin unscaled), as DeepSeek's configs
have it."""

from __future__ import annotations

SIGMOID = 2  # gguf.ExpertGatingFuncType: 1 softmax, 2 sigmoid
NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_kv_a_norm": "self_attn.kv_a_layernorm"}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
           "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_b": "self_attn.kv_b_proj",
           "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
           "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
           "ffn_down_shexp": "mlp.shared_experts.down_proj"}
PLAIN = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}  # the converter's rename of HF's bias
LOG_MUL = "rope.scaling.yarn_log_multiplier"


def per_head(m) -> tuple[int, int]:
    """(qk_head_dim, v_head_dim): the _mla keys of newer files, else key_length / value_length."""
    qk = m.arch_key("attention.key_length_mla", m.arch_key("attention.key_length"))
    return int(qk), int(m.arch_key("attention.value_length_mla", m.arch_key("attention.value_length")))


def deepseek2_config(m) -> dict:
    sigmoid = m.arch_key("expert_gating_func", 1) == SIGMOID
    kind = ("deepseek_v3", "DeepseekV3ForCausalLM") if sigmoid else ("deepseek_v2", "DeepseekV2ForCausalLM")
    c = m.common(*kind, 10000.0)
    rope = int(m.arch_key("rope.dimension_count"))
    qk, v = per_head(m)
    groups, used = int(m.arch_key("expert_group_count", 1) or 1), int(m.arch_key("expert_group_used_count", 1) or 1)
    lora = m.arch_key("attention.q_lora_rank")
    c.update(num_key_value_heads=c["num_attention_heads"], q_lora_rank=int(lora) if lora else None,
             kv_lora_rank=int(m.arch_key("attention.kv_lora_rank")), qk_rope_head_dim=rope,
             qk_nope_head_dim=qk - rope, v_head_dim=v, kv_b_split=m.has_tensor("blk.0.attn_k_b.weight"),
             rope_interleave=True, attention_bias=False, hidden_act="silu", num_nextn_predict_layers=0,
             n_routed_experts=int(m.arch_key("expert_count", 0)),
             n_shared_experts=int(m.arch_key("expert_shared_count", 0)),
             first_k_dense_replace=int(m.arch_key("leading_dense_block_count", 0)), moe_layer_freq=1,
             # llama.cpp leaves a scale of 0 (or none) out
             routed_scaling_factor=float(m.arch_key("expert_weights_scale", 0.0) or 1.0),
             norm_topk_prob=bool(m.arch_key("expert_weights_norm", False)), n_group=groups, topk_group=used,
             topk_method="noaux_tc" if sigmoid else "group_limited_greedy" if used < groups else "greedy",
             scoring_func="sigmoid" if sigmoid else "softmax")
    if c["n_routed_experts"]:
        c.update(num_experts_per_tok=int(m.arch_key("expert_used_count")),
                 moe_intermediate_size=int(m.arch_key("expert_feed_forward_length")))
    if m.arch_key("rope.scaling.type") == "yarn" and m.arch_key("rope.scaling.factor"):
        c["rope_scaling"] = yarn(m, c["rope_theta"])
    return c


def yarn(m, theta: float) -> dict:
    """The rope_scaling DeepSeek's config.json had, as far as the file keeps it (model/config.yarn_rope
    reads it)."""
    spec = {"rope_type": "yarn", "rope_theta": theta, "factor": float(m.arch_key("rope.scaling.factor")),
            "original_max_position_embeddings": int(m.arch_key("rope.scaling.original_context_length")),
            "beta_fast": float(m.arch_key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(m.arch_key("rope.scaling.yarn_beta_slow", 1.0))}
    log_mul = m.arch_key(LOG_MUL)
    if log_mul:
        spec["mscale"] = spec["mscale_all_dim"] = float(log_mul) / 0.1
    return spec
