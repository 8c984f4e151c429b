"""gpt-oss GGUF files as llama.cpp's converter writes them: attn_norm and post_attention_norm; q, k,
v and o with biases, rows as they are (no permutation: llama.cpp runs its RoPE as NeoX); the sinks,
attn_sinks.weight, one logit a query head; the router ffn_gate_inp with a bias; the experts'
interleaved gate_up_proj split into ffn_gate_exps / ffn_up_exps (experts, rows, inputs), down into
ffn_down_exps, each with its bias (experts, rows), the matrices MXFP4 in the published files. The
metadata keeps the window, the experts' size and YaRN's factor and original context; the layer
pattern (sliding on even layers), beta_fast / beta_slow (32, 1), the clamped SwiGLU's constants and
YaRN's untruncated ramp are GPT-OSS constants, as transformers' GptOssConfig defaults them."""

from __future__ import annotations

NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
PLAIN = {"attn_sinks": "self_attn.sinks"}  # a block's GGUF `KIND.weight` whose HF name has no .weight
ROUTER = "router"


def gpt_oss_config(m) -> dict:
    c = m.common("gpt_oss", "GptOssForCausalLM", 150000.0)
    c.pop("rope_scaling", None)
    c.update(hidden_act="silu", attention_bias=True, sliding_window=int(m.arch_key("attention.sliding_window")),
             intermediate_size=int(m.arch_key("expert_feed_forward_length")),
             num_local_experts=int(m.arch_key("expert_count")),
             num_experts_per_tok=int(m.arch_key("expert_used_count")),
             rms_norm_eps=float(m.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
             rope_parameters={"rope_type": "yarn", "rope_theta": c["rope_theta"], "beta_fast": 32.0, "beta_slow": 1.0,
                              "factor": float(m.arch_key("rope.scaling.factor", 32.0)), "truncate": False,
                              "original_max_position_embeddings": int(m.arch_key("rope.scaling.original_context_length",
                                                                                 4096))})
    return c
