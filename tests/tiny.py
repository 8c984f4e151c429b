"""Tiny random Gemma 3 checkpoints in the HF layout, made with transformers (test-only)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz") + ["\u2581"] + ["\u2581t", "he", "\u2581the", "in", "er"]


def write_tokenizer(path: Path) -> int:
    """A small byte-fallback BPE in Gemma's shape; returns its vocabulary size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + LETTERS)}
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he"), ("i", "n"), ("e", "r")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return len(vocab)


def hf_config(vocab_size: int, **overrides):
    from transformers import Gemma3TextConfig

    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
              query_pre_attn_scalar=16, rope_theta=1e6, rope_local_base_freq=1e4, max_position_embeddings=512,
              rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
              attn_implementation="eager")
    kw.update(overrides)
    return Gemma3TextConfig(**kw)


def make_tiny(path: Path, seed: int = 0, **overrides):
    """Write a random tiny Gemma 3 to `path`; returns the transformers model (eval, float32)."""
    from transformers import Gemma3ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(hf_config(vocab, **overrides)).eval()
    with torch.no_grad():  # norms start at zero in HF; give them values so the (1 + w) form matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=2, eos_token_id=1,
              pad_token_id=0, attn_implementation="eager")
# Each family's tiny config: transformers' own classes, sized to run in milliseconds, with sliding
# windows short enough that a 40-token prompt crosses them.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama-llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16})),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2-sliding": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=8,
                                                              max_window_layers=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(query_pre_attn_scalar=16, sliding_window=8,
                                                         # caps that bite
                                                         attn_logit_softcapping=1.5, final_logit_softcapping=3.0)),
}
# Mixtures of experts (tests/test_moe.py): Mixtral's four experts, two a row, with a window; Qwen3-MoE's
# eight, three a row, unnormalized, layer 1 a dense MLP.
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=8, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1],
        tie_word_embeddings=True)),
}


def make_tiny_family(path: Path, family: str, seed: int = 0, **overrides):
    """A random tiny model of `family` (FAMILIES, MOE_FAMILIES) in the HF layout; returns the
    transformers model."""
    import transformers

    config_cls, model_cls, extra = {**FAMILIES, **MOE_FAMILIES}[family]
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    cfg = getattr(transformers, config_cls)(**{**COMMON, "vocab_size": vocab, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms and biases start at constants in HF; give them values so they matter
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name or "bias" in name else 0.08)
            if "norm" in name and not family.startswith("gemma"):
                p.add_(1.0)  # a gain near one, as trained Llama-style norms are
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def write_in_place(file: Path, name: str, values: np.ndarray) -> None:
    """Overwrite the first values of float32 tensor `name` where it lies in a safetensors file: same
    size, same header, every other byte kept (as an editor of one layer's weights might)."""
    with open(file, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        start = json.loads(f.read(n))[name]["data_offsets"][0]
        f.seek(8 + n + start)
        f.write(values.astype(np.float32).tobytes())
