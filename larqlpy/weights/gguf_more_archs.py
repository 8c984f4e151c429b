"""The config.json of the GGUF architectures beyond Llama's, Qwen's and Gemma's (gguf_archs.py holds
their Arch entries and the shared reader, Meta, passed in here as `m`):

- granite: llama's layout (q/k rows permuted) with Granite's four multipliers under their llama.cpp
  names: {arch}.embedding_scale, residual_scale, attention.scale, logit_scale. A missing one is
  1.0, as llama.cpp reads it, but for attention.scale: head_dim ** -0.5.
- granitemoe: granite with experts on every layer, the converter's split of input_linear into
  ffn_gate_exps / ffn_up_exps (3-D, as Mixtral's); the router ffn_gate_inp.
- starcoder2: LayerNorm gains and biases (attn_norm, ffn_norm, output_norm), biases on q/k/v/o and
  on ffn_up / ffn_down (c_fc, c_proj); eps {arch}.attention.layer_norm_epsilon; no permutation.
- gpt2: position_embd beside token_embd, q|k|v one tensor attn_qkv (its Conv1D matrices transposed
  by the converter into the usual (outputs, inputs)), LayerNorms and biases everywhere, no RoPE; the
  converter writes output.weight as a copy of token_embd.
"""

from __future__ import annotations

LAYER_NORM_EPS = "attention.layer_norm_epsilon"
MULTIPLIERS = (("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
               ("logits_scaling", "logit_scale"))


def granite_config(m) -> dict:
    c = {**m.common("granite", "GraniteForCausalLM", 10000.0), "hidden_act": "silu", "attention_bias": False,
         "mlp_bias": False}
    c.update({ours: float(m.arch_key(key, 1.0)) for ours, key in MULTIPLIERS})
    c["attention_multiplier"] = float(m.arch_key("attention.scale", c["head_dim"] ** -0.5))
    return c


def granitemoe_config(m) -> dict:
    return {**granite_config(m), "model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"],
            "num_local_experts": int(m.arch_key("expert_count")),
            "num_experts_per_tok": int(m.arch_key("expert_used_count"))}


def starcoder2_config(m) -> dict:
    c = m.common("starcoder2", "Starcoder2ForCausalLM", 10000.0)
    window = m.arch_key("attention.sliding_window")
    return {**c, "norm_epsilon": float(m.arch_key(LAYER_NORM_EPS, 1e-5)), "hidden_act": "gelu_pytorch_tanh",
            "use_bias": m.has_tensor("blk.0.attn_q.bias"), "sliding_window": int(window) if window else None}


def gpt2_config(m) -> dict:
    c = m.common("gpt2", "GPT2LMHeadModel", 10000.0)
    return {**c, "n_embd": c["hidden_size"], "n_layer": c["num_hidden_layers"], "n_head": c["num_attention_heads"],
            "n_inner": c["intermediate_size"], "n_positions": c["max_position_embeddings"],
            "layer_norm_epsilon": float(m.arch_key(LAYER_NORM_EPS, 1e-5)), "activation_function": "gelu_new"}


# Tensor names where they differ from llama's: top-level (GGUF -> HF) and a block's linears
# (GGUF kind -> HF under the block).
LAYER_NORM_TOP = {"output_norm.bias": "model.norm.bias"}
GPT2_TOP = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
            "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias"}
PLAIN_MLP = {"ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
GPT2_LINEARS = {"attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", **PLAIN_MLP}
GPT2_NORMS = {"attn_norm": "ln_1", "ffn_norm": "ln_2"}
