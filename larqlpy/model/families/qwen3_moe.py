"""Qwen3-MoE: Qwen3's attention (q/k norms per head) with a mixture of experts on the sparse layers:
layer i is sparse unless listed in mlp_only_layers, when (i + 1) is a multiple of
decoder_sparse_step; the others run a dense MLP of intermediate_size. The router picks the top
num_experts_per_tok of num_experts by softmax, renormalized only with norm_topk_prob; each expert is
moe_intermediate_size wide. A sliding window on every layer when use_sliding_window (transformers'
Qwen3MoeConfig drops sliding_window otherwise)."""

from __future__ import annotations

from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.model.config import moe_from
from larqlpy.model.families import llama

HF_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))  # the router and experts under model.layers.{i}.


def config(raw: dict[str, Any]):
    n = raw.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 0
    only, step = raw.get("mlp_only_layers") or [], raw.get("decoder_sparse_step", 1)
    if not isinstance(only, list) or not isinstance(step, int) or step < 1:
        raise LarqlError("config.json: mlp_only_layers must be a list of layers and decoder_sparse_step a "
                         "positive integer")
    sparse = [i not in only and (i + 1) % step == 0 for i in range(n)]
    key = "num_experts" if "num_experts" in raw else "num_local_experts"  # transformers 5 saves the second
    moe = moe_from(raw, key, "moe_intermediate_size", bool(raw.get("norm_topk_prob", False)), sparse, *HF_NAMES)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    bias = bool(raw.get("attention_bias", False))
    return llama.config(raw, windows=(int(window) if window else None,) * n, qk_norm=True, qkv_bias=bias,
                        o_bias=bias, moe=moe)
