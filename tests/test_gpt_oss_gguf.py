"""GPT-OSS as a GGUF file, laid out as llama.cpp's converter writes it (experts split from their
interleaved gate_up_proj, their matrices MXFP4 as the published files hold them, biases, sinks,
YaRN's factor in the metadata): read by larqlpy, it gives the logits of the transformers model whose
experts hold the same MXFP4 values, dequantized (float32) and on the file's own 4-bit codes."""

from __future__ import annotations

import gguf
import numpy as np
import torch
import transformers

from larqlpy.kernels.weights.qweight import PackedWeight
from larqlpy.weights.loader import load
from hf_compare import hf_logits, our_logits
from test_gguf_archs import TOKENS, finish, vocabulary
from test_gpt_oss import randomized
from test_moe import GIDS

MXFP4 = gguf.GGMLQuantizationType.MXFP4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp"}


def make():
    """A tiny GPT-OSS whose experts' matrices are MXFP4 values (quantized, then dequantized)."""
    cfg = transformers.GptOssConfig(vocab_size=len(TOKENS), hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                    rope_parameters=YARN, bos_token_id=257, eos_token_id=259)
    return randomized(cfg, 3, as_mxfp4)


def as_mxfp4(name: str, p: torch.Tensor) -> None:
    """An expert tensor (experts, inputs, outputs) to the values MXFP4 keeps: blocks run along the inputs."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        t = p.transpose(1, 2).numpy()
        p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t, MXFP4), MXFP4).reshape(t.shape))
                .transpose(1, 2))


def write_gguf(hf, path):
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    for add, v in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                   (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                   (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                   (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                   (w.add_rope_freq_base, YARN["rope_theta"]), (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                   (w.add_sliding_window, c.sliding_window), (w.add_expert_count, c.num_local_experts),
                   (w.add_expert_used_count, c.num_experts_per_tok),
                   (w.add_expert_feed_forward_length, c.intermediate_size),
                   (w.add_rope_scaling_factor, YARN["factor"]),
                   (w.add_rope_scaling_orig_ctx_len, YARN["original_max_position_embeddings"])):
        add(v)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    vocabulary(w)
    for name, t in hf.state_dict().items():
        a, parts = t.detach().float().numpy(), name.split(".")
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[name], a)
            continue
        blk = f"blk.{parts[2]}"
        if parts[-1] == "sinks":
            w.add_tensor(f"{blk}.attn_sinks.weight", a)
        elif parts[-1] in ("gate_up_proj", "down_proj"):  # (experts, inputs, outputs) -> (experts, rows, inputs)
            a = a.transpose(0, 2, 1)
            stacks = {"down": a} if parts[-1] == "down_proj" else {"gate": a[:, ::2], "up": a[:, 1::2]}
            for kind, x in stacks.items():
                w.add_tensor(f"{blk}.ffn_{kind}_exps.weight", gguf.quants.quantize(np.ascontiguousarray(x), MXFP4),
                             raw_dtype=MXFP4)
        elif parts[-1] in ("gate_up_proj_bias", "down_proj_bias"):
            stacks = {"down": a} if parts[-1] == "down_proj_bias" else {"gate": a[:, ::2], "up": a[:, 1::2]}
            for kind, x in stacks.items():
                w.add_tensor(f"{blk}.ffn_{kind}_exps.bias", np.ascontiguousarray(x))
        else:
            w.add_tensor(f"{blk}.{BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}", a)
    return finish(w, path)


def test_mxfp4_gguf_runs_as_transformers(tmp_path):
    hf = make()
    path = write_gguf(hf, tmp_path / "tiny-gpt-oss.gguf")
    want = hf_logits(hf, GIDS)
    f32 = load(path, device="cpu", weights="f32")
    assert f32.config.model_type == "gpt_oss" and f32.config.rope_global.rope_type == "yarn"
    assert (our_logits(f32, GIDS) - want).abs().max().item() < 1e-3
    native = load(path, device="cpu")  # the experts on their own MXFP4 codes (int8 activations)
    down = native.model.layers[0].experts[0].down_proj
    assert native.weights == "native" and isinstance(down, PackedWeight) and down.kind == "fp4"  # the file's nibbles
    assert (our_logits(native, GIDS) - want).abs().max().item() < 0.05
