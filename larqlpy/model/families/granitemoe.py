"""Granite-MoE: Granite's multipliers (granite.py) with Mixtral's mixture of experts on every layer:
a router (block_sparse_moe.router.layer) picks the top num_experts_per_tok of num_local_experts by
its logits, their weights a softmax over those k alone (the full softmax renormalized: the same
weights, norm_topk_prob). The files hold a layer's experts fused, input_linear (experts, 2 *
intermediate, hidden: gate rows then up rows) and output_linear (experts, hidden, intermediate),
read as one view an expert matrix (weights/checkpoint.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from larqlpy.model.config import moe_from
from larqlpy.model.families import granite, llama

HF_NAMES = ("block_sparse_moe", ("gate", "up", "down"))  # experts.{j}.gate ...: views of the fused tensors
HF_ROUTER = "router.layer"
HF_FUSED = ("input_linear", "output_linear")


def config(raw: dict[str, Any]):
    n = raw.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 0
    moe = moe_from(raw, "num_local_experts", "intermediate_size", True, [True] * n, *HF_NAMES)
    moe = moe and replace(moe, hf_router=HF_ROUTER, hf_fused=HF_FUSED)
    return llama.config(raw, moe=moe, **granite.multipliers(raw))
