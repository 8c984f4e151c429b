"""Gemma 4 GGUF files (`gemma4`) laid out as llama.cpp's converter writes them (its Gemma4Model, a
Gemma3Model whose norms are not shifted): every gain stored as itself (no 1 + w), the embedding's
rows cut to the tokenizer's vocabulary, nothing permuted or rescaled (√hidden, √P and the per-layer
scales are applied at run time, as transformers does). The metadata:

- attention.sliding_window_pattern: one boolean a layer (sliding or not), read back as layer_types;
- attention.key_length / key_length_swa: the global and the sliding layers' head widths;
  attention.head_count_kv: one value a layer where the global layers have their own KV heads;
- attention.shared_kv_layers: the last layers that read an earlier layer's K/V; feed_forward_length
  one value a layer where those have the double-wide MLP;
- embedding_length_per_layer_input: the per-layer inputs' width P; per_layer_token_embd (vocab x
  layers * P), per_layer_model_proj and per_layer_proj_norm, and a layer's inp_gate, proj, post_norm;
- rope_freqs.weight: HF's proportional RoPE as llama.cpp's over the whole head, one divisor a pair:
  1 for the turned pairs, 1e30 (no turn) for the rest; rope.freq_base_swa the sliding layers' base;
- a global layer with no attn_v uses K as V (attention_k_eq_v);
- experts: the router ffn_gate_inp with its gain (ffn_gate_inp.scale), the per-expert scale
  (ffn_down_exps.scale), the fused ffn_gate_up_exps (gate rows, then up) and ffn_down_exps,
  pre_ffw_norm_2, post_ffw_norm_1 and post_ffw_norm_2; layer_output_scale is HF's layer_scalar."""

from __future__ import annotations

import numpy as np

NORMS = {"pre_ffw_norm_2": "pre_feedforward_layernorm_2", "post_ffw_norm_1": "post_feedforward_layernorm_1",
         "post_ffw_norm_2": "post_feedforward_layernorm_2", "post_norm": "post_per_layer_input_norm"}
LINEARS = {"inp_gate": "per_layer_input_gate", "proj": "per_layer_projection"}
TOP = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
       "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
       "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
PLAIN = {"layer_output_scale": "layer_scalar"}  # a block's KIND.weight whose HF name has no .weight
ROUTED = {"ffn_gate_inp.weight": "router.proj.weight", "ffn_gate_inp.scale": "router.scale",
          "ffn_down_exps.scale": "router.per_expert_scale"}
FUSED = ("ffn_gate_up_exps", "ffn_gate_exps", "ffn_up_exps")
ROPE_FREQS = "rope_freqs.weight"
SLIDING, GLOBAL = "sliding_attention", "full_attention"


def hf_name(name: str) -> tuple[str, bool] | None:
    """The router's and the experts' HF names (gguf_archs.Arch.hf_name maps the rest): an expert's
    matrices are views of its layer's 3-D tensors (NAME[j], gguf_archs.expert_views), gate and up
    as row ranges of the fused one (`@rLO:HI`, split_gate_up)."""
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    at = f"model.layers.{parts[1]}."
    if parts[2] in ROUTED:
        return at + ROUTED[parts[2]], False
    base, _, rest = parts[2].partition("[")
    j, _, rows = rest.partition("]")
    if not j.isdigit():
        return None
    if base == "ffn_gate_up_exps.weight" and rows.startswith("@r"):
        return f"{at}experts.gate_up_proj@e{j},{rows[1:]}", False
    if base == "ffn_down_exps.weight" and not rows:
        return f"{at}experts.down_proj@e{j}", False
    return None


def split_gate_up(tensors: dict) -> dict:
    """A tensor table (gguf_file.GGUFFile.tensors) with each expert's fused gate|up view as its two
    row ranges, `NAME[j]@r0:I` and `@rI:2I` (rows lie whole, so each is a matrix of its own, read and
    packed as any); a file holding the two apart (ffn_gate_exps / ffn_up_exps, which llama.cpp also
    takes) has them named the same way."""
    out = {}
    for name, (qtype, shape, offset, nbytes) in tensors.items():
        base, bracket, j = name.partition("[")
        kind = base.split(".")[2] if base.count(".") == 3 else ""
        if not bracket or kind not in FUSED or len(shape) != 2 or (kind == FUSED[0] and shape[0] % 2):
            out[name] = (qtype, shape, offset, nbytes)
            continue
        fused = base.replace(kind, FUSED[0])
        if kind == FUSED[0]:
            half = shape[0] // 2
            out[f"{fused}[{j}@r0:{half}"] = (qtype, (half, shape[1]), offset, nbytes // 2)
            out[f"{fused}[{j}@r{half}:{shape[0]}"] = (qtype, (half, shape[1]), offset + nbytes // 2, nbytes // 2)
        else:
            lo = 0 if kind == "ffn_gate_exps" else shape[0]
            out[f"{fused}[{j}@r{lo}:{lo + shape[0]}"] = (qtype, shape, offset, nbytes)
    return out


def per_layer(value, n: int) -> list[int]:
    """A key llama.cpp reads as one value or one a layer (checked by gguf_check)."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * n


def rotated_share(m, wide: int) -> float:
    """The global layers' partial_rotary_factor: the pairs rope_freqs.weight turns (divisor 1), of
    the head's; a file without the tensor turns the whole head."""
    t = m.tensor(ROPE_FREQS)
    return 1.0 if t is None else 2 * int((np.asarray(t.data) == 1.0).sum()) / wide


def gemma4_config(m) -> dict:
    """config.json (model_type gemma4_text) from the metadata and the tensors it shows."""
    c = m.common("gemma4_text", "Gemma4ForCausalLM", 1e6)
    n, tokens = c["num_hidden_layers"], m.get("tokenizer.ggml.tokens")
    types = [SLIDING if s else GLOBAL for s in m.arch_key("attention.sliding_window_pattern")]
    wide = int(m.arch_key("attention.key_length"))
    kv = per_layer(m.arch_key("attention.head_count_kv", c["num_attention_heads"]), n)
    ffn = per_layer(m.arch_key("feed_forward_length"), n)
    shared = int(m.arch_key("attention.shared_kv_layers", 0))
    sliding_kv = next((kv[i] for i in range(n) if types[i] == SLIDING), kv[0])
    global_kv = next((kv[i] for i in range(n) if types[i] == GLOBAL), sliding_kv)
    own = [i for i in range(n - shared) if types[i] == GLOBAL]  # global layers with K/V of their own
    k_eq_v = bool(own) and not m.has_tensor(f"blk.{own[0]}.attn_v.weight")
    table = m.tensor("per_layer_token_embd.weight")
    eos = c["eos_token_id"] if c["eos_token_id"] is not None else 1
    eot = tokens.index("<turn|>") if "<turn|>" in tokens else None
    c.pop("rope_scaling", None)  # gguf_check refuses a scaling on gemma4
    c.update(
        head_dim=int(m.arch_key("attention.key_length_swa", wide)), global_head_dim=wide,
        num_key_value_heads=sliding_kv, layer_types=types, sliding_window=int(m.arch_key("attention.sliding_window")),
        intermediate_size=ffn[0], num_kv_shared_layers=shared,
        use_double_wide_mlp=bool(shared) and ffn[-1] == 2 * ffn[0], attention_k_eq_v=k_eq_v,
        hidden_size_per_layer_input=int(m.arch_key("embedding_length_per_layer_input", 0)),
        vocab_size_per_layer_input=int(table.shape[-1]) if table is not None else c["vocab_size"],
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": float(m.arch_key("rope.freq_base_swa", 1e4))},
                         GLOBAL: {"rope_type": "proportional", "rope_theta": c.pop("rope_theta"),
                                  "partial_rotary_factor": rotated_share(m, wide)}},
        final_logit_softcapping=m.arch_key("final_logit_softcapping"), hidden_activation="gelu_pytorch_tanh",
        attention_bias=False, max_position_embeddings=int(m.arch_key("context_length", 131_072)),
        bos_token_id=int(c["bos_token_id"] if c["bos_token_id"] is not None else 2),
        eos_token_id=[eos] + ([eot] if eot is not None and eot != eos else []),
        pad_token_id=int(c["pad_token_id"] if c["pad_token_id"] is not None else 0))
    if k_eq_v:
        c["num_global_key_value_heads"] = global_kv
    elif global_kv != sliding_kv:  # read by model/families/gemma4.py as transformers saves its overrides
        c["per_layer_config"] = {GLOBAL: {"head_dim": wide, "num_key_value_heads": global_kv}}
    if m.arch_key("expert_count"):
        c.update(enable_moe_block=True, num_experts=int(m.arch_key("expert_count")),
                 top_k_experts=int(m.arch_key("expert_used_count")),
                 moe_intermediate_size=int(m.arch_key("expert_feed_forward_length")))
    return c
