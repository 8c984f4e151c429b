"""GGUF (llama.cpp) Gemma 3 -> Hugging Face layout: f32 safetensors, config.json, tokenizer.json.

GGUF conventions minded here: tensor shapes are listed innermost-first (the numpy view the `gguf`
package gives is already [rows, cols] = HF's [out, in]); llama.cpp stores every Gemma norm weight
as 1 + w (HF stores w); the layer pattern, the local RoPE base and query_pre_attn_scalar are not in
the metadata and are Gemma 3 constants.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_directory, check_output
from larqlpy.model.files import check_finite

NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
SLIDING_PATTERN = 6  # Gemma 3: five sliding layers, then one global
LOCAL_ROPE_BASE = 10_000.0

Progress = Callable[[str, int, int], None]  # (what, done, total)


def hf_name(gguf_name: str) -> tuple[str, bool] | None:
    """HF tensor name for a GGUF one, and whether it is a norm stored as 1 + w. None: not ours."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight", False
    if gguf_name == "output_norm.weight":
        return "model.norm.weight", True
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight":
        layer, kind = parts[1], parts[2]
        if kind in NORMS:
            return f"model.layers.{layer}.{NORMS[kind]}.weight", True
        if kind in LINEARS:
            return f"model.layers.{layer}.{LINEARS[kind]}.weight", False
    return None


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf(src: Path):
    if src.is_dir():
        raise LarqlError(f"{src}: is a directory, not a GGUF file")
    if not src.is_file():
        raise LarqlError(f"{src}: no such file")
    with open(src, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise LarqlError(f"{src}: not a readable GGUF file (it does not start with the GGUF magic)")
    try:
        reader = gguf.GGUFReader(str(src))
    except Exception:  # gguf's reader fails on a short file with numpy's own words
        raise LarqlError(f"{src}: not a readable GGUF file (truncated or damaged: {src.stat().st_size:,} bytes)") from None
    arch = _field(reader, "general.architecture")
    if arch is None:
        raise LarqlError(f"{src}: not a model GGUF (it has no general.architecture)")
    if arch != "gemma3":
        raise LarqlError(f"{src}: architecture {arch!r} is not supported (expected gemma3)")
    return reader


def config_from_gguf(reader) -> dict:
    a = "gemma3."
    tokens = _field(reader, "tokenizer.ggml.tokens")
    n_layers = int(_field(reader, a + "block_count"))
    hidden = int(_field(reader, a + "embedding_length"))
    heads = int(_field(reader, a + "attention.head_count"))
    head_dim = int(_field(reader, a + "attention.key_length", hidden // heads))
    scaling_type = _field(reader, a + "rope.scaling.type")
    scaling_factor = _field(reader, a + "rope.scaling.factor")
    rope_scaling = ({"rope_type": scaling_type, "factor": float(scaling_factor)}
                    if scaling_type not in (None, "none") and scaling_factor else None)
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id", 1))
    eot = tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else None
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, a + "feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, a + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "sliding_window": int(_field(reader, a + "attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(n_layers)],
        "rope_theta": float(_field(reader, a + "rope.freq_base", 1e6)),
        "rope_local_base_freq": LOCAL_ROPE_BASE,
        "rope_scaling": rope_scaling,
        # Gemma 3 scales queries by head_dim ** -0.5, except 27B which uses hidden/heads (168).
        "query_pre_attn_scalar": hidden // heads if hidden == 5376 else head_dim,
        "rms_norm_eps": float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-6)),
        "final_logit_softcapping": _field(reader, a + "final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(_field(reader, a + "context_length", 32768)),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": [eos] + ([eot] if eot is not None and eot != eos else []),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def build_tokenizer(reader):
    """A `tokenizers` BPE tokenizer equivalent to the GGUF's SentencePiece vocabulary.

    The file carries no merges, so they are rebuilt: every split of a token into two tokens is a
    merge, ranked by the merged token's position in the vocabulary (Gemma's scores do not follow
    its merge order; positions do). Tokens made only of spaces are stored with real spaces but the
    normalizer turns spaces into U+2581, so they are respelled first.
    """
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = []
    for token, index in vocab.items():
        local = [(token[:j], token[j:], index) for j in range(1, len(token))
                 if token[:j] in vocab and token[j:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (-m[2], len(m[0]), len(m[1])), reverse=True)
    unk = tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id", 3))]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(l, r) for l, r, _ in merges], unk_token=unk,
                               fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens (type 3) are special; user-defined ones (type 4, e.g. "\n\n") match whole.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == 4 and t in vocab])
    bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id", 2))
    if bool(_field(reader, "tokenizer.ggml.add_bos_token", True)):
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    config = {"add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", True)),
              "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
              "bos_token": tokens[bos_id], "eos_token": tokens[int(_field(reader, "tokenizer.ggml.eos_token_id", 1))],
              "unk_token": unk, "pad_token": tokens[int(_field(reader, "tokenizer.ggml.padding_token_id", 0))],
              "tokenizer_class": "GemmaTokenizer"}
    return tok, config


def convert_gguf(src: str | Path, dest: str | Path, progress: Progress | None = None, force: bool = False) -> Path:
    """Dequantize a Gemma 3 GGUF into an HF-layout directory. Written to a temp dir, then renamed."""
    src, dest = Path(src), Path(dest)
    if dest.exists() and not force:
        raise LarqlError(f"{dest}: already exists (pass `force` to overwrite)")
    check_output(dest, "DEST", inputs=[src], directory=True)
    reader = read_gguf(src)
    config = config_from_gguf(reader)
    step = progress or (lambda what, done, total: None)
    ours = [(t, hf_name(t.name)) for t in reader.tensors]
    ours = [(t, m) for t, m in ours if m is not None]
    total = len(ours) + 1
    tensors: dict[str, np.ndarray] = {}
    for i, (t, (name, is_norm)) in enumerate(ours):
        step(f"dequantize {t.name}", i, total)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except Exception as e:
            raise LarqlError(f"{src}: cannot dequantize {t.name} ({t.tensor_type.name}: {e})") from None
        expected = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        w = w.reshape(expected)
        check_finite(src, t.name, w)
        tensors[name] = w - 1.0 if is_norm else w  # llama.cpp stores Gemma norms as 1 + w
    step("tokenizer", len(ours), total)
    tokenizer, tok_config = build_tokenizer(reader)

    with atomic_directory(dest, replace=True) as tmp:  # a crash leaves no half-written model directory
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": src.name})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
             "pad_token_id": config["pad_token_id"]}, indent=2) + "\n")
        save_tokenizer(tokenizer, tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    step("done", total, total)
    return dest


def save_tokenizer(tok, path: Path) -> None:
    """tokenizer.json, with the merges in the "left right" spelling when no token holds a space:
    `tokenizers` reads that spelling of the 270M's 515K merges in half the time of [left, right]
    pairs (0.35 s of every start-up)."""
    data = json.loads(tok.to_str())
    model = data.get("model", {})
    merges = model.get("merges") or []
    if merges and isinstance(merges[0], list) and not any(" " in t for t in model.get("vocab", {})):
        model["merges"] = [" ".join(m) for m in merges]
    path.write_text(json.dumps(data, ensure_ascii=False))
