"""GPT-OSS: Llama's pre-norm layout with biases on q, k, v and o; sliding layers (128 rows) alternating
with full ones (layer_types); a learned sink logit per query head joined to every softmax
(`attention_sinks`: it takes probability mass and has no value row); YaRN RoPE (rope_parameters,
cos and sin times its attention factor); a mixture of experts on every layer whose router has a bias
and softmaxes the top k of its raw logits, whose experts have biases and GPT-OSS's clamped SwiGLU
(transformers' GptOssMLP; model/moe.py)."""

from __future__ import annotations

from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.model.config import GLOBAL, SLIDING, MoeConfig, moe_from, windows_from_types
from larqlpy.model.families import llama

HF_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))  # views of mlp.experts' fused tensors (checkpoint.py)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}  # transformers' GptOssConfig default


def config(raw: dict[str, Any]):
    n = raw.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) else 0
    window = raw.get("sliding_window", 128)
    windows = windows_from_types(raw, n, window, [SLIDING if (i + 1) % 2 else GLOBAL for i in range(n)])
    limit, alpha = raw.get("swiglu_limit", 7.0), raw.get("swiglu_alpha", 1.702)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in (limit, alpha)):
        raise LarqlError("config.json: swiglu_limit and swiglu_alpha must be positive numbers")
    moe = moe_from(raw, "num_local_experts", "intermediate_size", False, [True] * n, *HF_NAMES)
    if moe is None:
        raise LarqlError("config.json: gpt_oss needs num_local_experts >= 1")
    moe = MoeConfig(**{**moe.__dict__, "hf_router": "router", "router_bias": True, "softmax_after_topk": True,
                       "expert_bias": True, "swiglu_limit": float(limit), "swiglu_alpha": float(alpha),
                       "hf_interleaved": True})
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or DEFAULT_ROPE
    rope = {**params, "rope_theta": params.get("rope_theta", raw.get("rope_theta", 150000.0))}
    bias = bool(raw.get("attention_bias", True))
    return llama.config({**raw, "rope_parameters": rope, "rope_scaling": None}, windows=windows, qkv_bias=bias,
                        o_bias=bias, moe=moe, attention_sinks=True,
                        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)))
