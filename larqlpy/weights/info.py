"""What `larqlpy info` shows of a model directory or a .gguf file, without loading its weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from larqlpy.model.config import ModelConfig
from larqlpy.model.families import read_config
from larqlpy.weights import calibration_file
from larqlpy.weights.checkpoint import Checkpoint
from larqlpy.weights.gguf_checkpoint import GGUFCheckpoint, checkpoint
from larqlpy.weights.gguf_file import model_dir


def describe(path: str | Path, pre_tokenizer: str | None = None) -> dict:
    """What `info` shows, read from config.json and the weight files' headers (no weights loaded);
    pre_tokenizer: as `load`'s."""
    path = Path(path)
    home = model_dir(path, pre_tokenizer=pre_tokenizer)
    cfg = read_config(home)
    ckpt = checkpoint(path, cfg, allow_unused_tensors=True)  # shown, not refused
    params, dtypes = 0, set()
    if isinstance(ckpt, GGUFCheckpoint):
        for qtype, shape, _, _ in ckpt.file.tensors.values():
            params += int(np.prod(shape, dtype=np.int64))
            dtypes.add(qtype)
    for name in ckpt.stored() if isinstance(ckpt, Checkpoint) else ():
        if ckpt.files[name] in ckpt.handles:  # MXFP4 experts as the tensors they stand for
            shape, dtype = ckpt.header(name)
            params += int(np.prod(shape, dtype=np.int64))
            dtypes.add(dtype)
    windows = sorted({w for w in cfg.windows if w is not None})
    return {
        "model_type": cfg.model_type + (" (text part)" if cfg.weight_prefix != "model." else ""),
        "parameters": params, "dtypes": ",".join(sorted(dtypes)), "layers": cfg.num_hidden_layers,
        "layer_kinds": ["sliding" if cfg.is_sliding(i) else "global" for i in range(cfg.num_hidden_layers)],
        "hidden_size": cfg.hidden_size, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "sliding_window": windows[0] if len(windows) == 1 else (windows or None),
        "vocab_size": cfg.vocab_size, "rope": _rope_text(cfg), "tied_embeddings": cfg.tie_word_embeddings,
        "attention_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.final_softcap,
        "max_position_embeddings": cfg.max_position_embeddings, "experts": _experts_text(cfg),
        "fingerprint": ckpt.fingerprint, "unused_tensors": len(ckpt.unused), "pre_tokenizer": _splits(ckpt),
        # `native` runs a GGUF's codes; types without codes are read as float32, at their cost a token
        "float_fallback": ckpt.float_fallback() if isinstance(ckpt, GGUFCheckpoint) else None,
        "key_calibration": calibration_file.summary(home, cfg.num_hidden_layers, *calibration_file.head_shapes(cfg),
                                                    ckpt.fingerprint),
    }


def _experts_text(cfg: ModelConfig) -> str | None:
    m = cfg.moe
    if m is None:
        return None
    return f"{m.num_experts} of width {m.intermediate_size}, top {m.top_k}" \
        f"{' renormalized' if m.norm_topk_prob else ''}, on {sum(m.sparse)} of {cfg.num_hidden_layers} layers"


def _splits(ckpt) -> str | None:
    """A GGUF's pre-tokenizer in use: the file's tokenizer.ggml.pre, or the name given in its place."""
    if not isinstance(ckpt, GGUFCheckpoint) or ckpt.file.splits_as is None:
        return None
    return ckpt.file.splits_as + (" (given in place of the file's)" if ckpt.file.pre_tokenizer else "")


def _rope_text(cfg: ModelConfig) -> str:
    def one(r) -> str:
        return f"{r.theta:g}" + ("" if r.rope_type == "default" else f" ({r.rope_type} x{r.factor:g})")

    if cfg.learned_positions:
        return "none (learned positions)"
    if cfg.rope_local == cfg.rope_global or not any(cfg.windows):
        return one(cfg.rope_global)
    return f"global {one(cfg.rope_global)}, local {one(cfg.rope_local)}"
