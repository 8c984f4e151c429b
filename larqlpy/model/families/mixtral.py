"""Mixtral: Mistral's layout with a mixture of experts in place of every MLP: a router (a linear over
the hidden state) picks the top num_experts_per_tok of num_local_experts SiLU-gated experts by
softmax, their weights renormalized to sum to one (transformers' MixtralSparseMoeBlock); a sliding
window on every layer when `sliding_window` is set (null, the default, is none)."""

from __future__ import annotations

from typing import Any

from larqlpy.model.config import moe_from
from larqlpy.model.families import llama

HF_NAMES = ("block_sparse_moe", ("w1", "w3", "w2"))  # the router and experts under model.layers.{i}.


def config(raw: dict[str, Any]):
    window, n = raw.get("sliding_window"), raw.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 0
    moe = moe_from(raw, "num_local_experts", "intermediate_size", True, [True] * n, *HF_NAMES)
    return llama.config(raw, windows=(int(window) if window else None,) * n, moe=moe)
