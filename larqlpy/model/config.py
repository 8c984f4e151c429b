"""A decoder's configuration, family-agnostic: what the common decoder families differ in, declared as
fields, and the readers of config.json's shared spellings. The family modules (model/families/)
read a config.json into it; `families.read_config` picks the family. Plain Python: `info`,
`residency` and every refusal read it without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from larqlpy.errors import LarqlError

SLIDING = "sliding_attention"
GLOBAL = "full_attention"


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn | proportional | none (learned positions: GPT-2)
    factor: float = 1.0  # linear: positions divided by this; llama3, yarn: the low-frequency divisor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (model/yarn.py): the ramp between interpolated and extrapolated frequencies, and the
    # factor cos and sin are multiplied by (transformers' attention_scaling)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    partial: float = 1.0  # proportional (Gemma 4): the share of each head's frequency pairs turned, the rest left still


@dataclass(frozen=True)
class LayerShape:
    """One layer's own shape where a family's layers differ (Gemma 4: wider heads on global layers,
    layers that attend over an earlier layer's K/V rows, a wider MLP on those)."""

    head_dim: int
    kv_heads: int
    intermediate_size: int
    reads: int | None = None  # the earlier layer whose K/V rows this one attends over (it projects no k, v)
    k_as_v: bool = False  # its K projection, before the k norm, serves as V too (no v_proj)


@dataclass(frozen=True)
class PerLayerInputs:
    """A second embedding feeding every layer a slice of its own (Gemma 4's per-layer inputs): a table
    of `vocab` rows of layers x `size`, mixed with a projection of the token embeddings."""

    size: int
    vocab: int


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts in place of the MLP on its sparse layers (Mixtral, Qwen3-MoE)."""

    num_experts: int
    top_k: int  # experts each row runs
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # the top k's softmax weights divided by their sum (Mixtral always)
    sparse: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of `intermediate_size`
    hf_block: str  # where a sparse layer's router (gate) and experts live: "block_sparse_moe" | "mlp"
    hf_experts: tuple[str, str, str]  # an expert's gate, up and down under experts.{j}.: ("w1", "w3", "w2")
    hf_router: str = "gate"  # the router's linear under hf_block ("router.layer": Granite-MoE)
    # Granite-MoE's files hold a layer's experts as two 3-D tensors under hf_block, gate|up fused
    # (experts, 2 * intermediate, hidden) and down (experts, hidden, intermediate): (their names), read
    # as one view a matrix (weights/checkpoint.py); None: a tensor an expert matrix
    hf_fused: tuple[str, str] | None = None
    # GPT-OSS: the router's linear has a bias; the top k of its raw logits are picked, then a softmax
    # over those k (`softmax_after_topk`); every expert's gate, up and down have biases; the gate is
    # a clamped SwiGLU, (min(up, l) clamped to [-l, l] + 1) * g * sigmoid(alpha g), g = min(gate, l)
    router_bias: bool = False
    softmax_after_topk: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # GPT-OSS's files hold a layer's experts as (experts, inputs, outputs) tensors under
    # hf_block.experts: gate_up_proj with gate and up interleaved in columns, down_proj, and biases
    hf_interleaved: bool = False
    # DeepSeek (families/deepseek.py): scores by softmax or sigmoid; how the top k are picked --
    # "topk" (torch.topk of the scores), "greedy", "group_limited_greedy" (V2: the best topk_group of
    # n_group groups by their best score) or "noaux_tc" (V3: groups by their two best scores plus
    # e_score_correction_bias, the bias only choosing); the weights times routed_scaling; shared
    # experts, one dense MLP of shared_intermediate (0: none) added to every row
    scoring: str = "softmax"
    topk_method: str = "topk"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    shared_intermediate: int = 0


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2, V3; model/mla.py): keys and values rebuilt per head
    from one latent row a position (kv_lora_rank, normed) and one shared RoPE key (qk_rope_head_dim)."""

    q_lora_rank: int | None  # queries through a low-rank bottleneck (q_a, its norm, q_b), or q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the RoPE part rotates interleaved pairs (DeepSeek's layout), else rotate-half
    # kv_b_proj held as llama.cpp's newer GGUFs split it: W_UK transposed (k_b_proj) and W_UV (v_b_proj), per head
    kv_b_split: bool = False


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # as config.json spells it
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # decoupled from hidden_size / heads (Gemma, Qwen3)
    windows: tuple[int | None, ...]  # per layer: the sliding window (rows a query sees), or None (global)
    rope_global: RopeConfig  # global layers (and every layer of a family with one base)
    rope_local: RopeConfig  # sliding layers (Gemma 3: base 10,000)
    attention_scale: float  # the queries' scale: query_pre_attn_scalar ** -0.5 or head_dim ** -0.5
    rms_norm_eps: float
    norm_offset: bool  # a norm gain is stored as w and applied as (1 + w) (Gemma)
    sandwich_norms: bool  # norms after attention and after the MLP too (Gemma 2, 3)
    qk_norm: bool  # RMSNorm of each query and key head before RoPE (Gemma 3, Qwen3)
    qkv_bias: bool  # biases on q, k and v (Qwen2)
    o_bias: bool  # a bias on the output projection (Llama's attention_bias)
    attn_softcap: float | None  # scores -> tanh(scores / cap) * cap before the softmax (Gemma 2)
    final_softcap: float | None  # the same on the logits (Gemma 2)
    embed_scale: bool  # embeddings times sqrt(hidden_size) (Gemma)
    tie_word_embeddings: bool
    activation: str  # gelu_tanh | silu: the MLP's gate activation
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    weight_prefix: str = "model."  # where the decoder's tensors live ("language_model.model." multimodal)
    moe: MoeConfig | None = None  # experts on some layers (model/moe.py), or a dense MLP on every layer
    # Granite's multipliers: the embeddings times the first, each block's attention and MLP output
    # times the second before the residual add, the logits divided by the third
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    layer_norm: bool = False  # LayerNorm (mean removed, gain and bias, eps rms_norm_eps): StarCoder2, GPT-2
    gated_mlp: bool = True  # act(gate) * up; False: act(up) then down, c_fc / c_proj (StarCoder2, GPT-2)
    mlp_bias: bool = False  # biases on a non-gated MLP's c_fc and c_proj
    learned_positions: bool = False  # a position embedding added to the tokens' (GPT-2's wpe), no RoPE
    attention_sinks: bool = False  # a learned logit per query head in every softmax (GPT-OSS's self_attn.sinks)
    layout: str = "llama"  # the files' tensor names: llama (layers.{i}.self_attn...) | gpt2 (h.{i}.attn.c_attn...)
    # multi-head latent attention (DeepSeek): the engines' one KV head is the latent row plus the RoPE
    # key (head_dim = kv_lora_rank + qk_rope_head_dim), its value the same row
    mla: MlaConfig | None = None
    ignored: tuple[str, ...] = ()  # tensor names under the prefix the family leaves (DeepSeek-V3's MTP layers)
    # Gemma 4 (model/shaped.py): layers of their own shapes, values RMS-normed with no gain, a second
    # embedding per layer, each layer's output times a stored scalar, experts beside the dense MLP
    layer_shapes: tuple[LayerShape, ...] | None = None
    v_norm: bool = False
    per_layer_inputs: PerLayerInputs | None = None
    layer_scalar: bool = False

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE turns: a whole head, or MLA's RoPE part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    def window(self, layer: int) -> int | None:
        """Rows a query at this layer can see (itself included); None for global layers."""
        return self.windows[layer]

    def is_sliding(self, layer: int) -> bool:
        return self.windows[layer] is not None

    def is_sparse(self, layer: int) -> bool:
        """Whether this layer runs experts in place of the dense MLP."""
        return self.moe is not None and self.moe.sparse[layer]

    def rope(self, layer: int) -> RopeConfig:
        return self.rope_local if self.is_sliding(layer) else self.rope_global

    def shape(self, layer: int) -> LayerShape:
        """The layer's head width, KV heads, MLP width and the layer whose rows it reads, if any."""
        if self.layer_shapes is not None:
            return self.layer_shapes[layer]
        return LayerShape(self.head_dim, self.num_key_value_heads, self.intermediate_size)

    def kind_head_dim(self, sliding: bool) -> int:
        """The width RoPE turns on the sliding (or global) layers: their heads (Gemma 4's differ by
        kind), or MLA's RoPE part."""
        if self.layer_shapes is None:
            return self.rope_dim
        return next((self.shape(i).head_dim for i in range(self.num_hidden_layers) if self.is_sliding(i) == sliding),
                    self.head_dim)


# -- shared readers the families use ------------------------------------------------------------

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def require_ints(raw: dict[str, Any], *extra: str) -> None:
    missing = [k for k in (*REQUIRED, *extra) if not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool)
               or raw.get(k) <= 0]
    if missing:
        raise LarqlError(f"config.json: missing or invalid {', '.join(missing)}")


def head_dim(raw: dict[str, Any]) -> int:
    d = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if not isinstance(d, int) or d <= 0:
        raise LarqlError(f"config.json: invalid head_dim {d!r}")
    return d


def windows_from_types(raw: dict[str, Any], n: int, window: int | None, default_types: list[str]) -> tuple:
    """Per-layer windows from config.json's `layer_types` (or the family's default pattern)."""
    types = raw.get("layer_types") or default_types
    if len(types) != n or not set(types) <= {SLIDING, GLOBAL}:
        raise LarqlError("config.json: layer_types must list 'sliding_attention'/'full_attention' per layer")
    if SLIDING in types and not (isinstance(window, int) and window > 0):
        raise LarqlError("config.json: sliding layers need a positive sliding_window")
    return tuple(window if t == SLIDING else None for t in types)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_from(spec: dict[str, Any] | None, theta: float) -> RopeConfig:
    spec = spec or {}
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise LarqlError(f"config.json: unsupported rope_type {rope_type!r} "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    theta = float(spec.get("rope_theta", theta))
    if rope_type == "default":
        return RopeConfig(theta)
    factor = float(spec.get("factor", 1.0))
    if rope_type == "linear":
        return RopeConfig(theta, "linear", factor)
    if rope_type == "yarn":
        return yarn_rope(spec, theta)
    try:
        return RopeConfig(theta, "llama3", factor, float(spec["low_freq_factor"]), float(spec["high_freq_factor"]),
                          int(spec["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError):
        raise LarqlError("config.json: llama3 rope scaling needs factor, low_freq_factor, high_freq_factor and "
                         "original_max_position_embeddings") from None


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' yarn_get_mscale: YaRN's attention factor for a context `scale` times longer."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_rope(spec: dict[str, Any], theta: float, max_positions: int | None = None) -> RopeConfig:
    """YaRN as transformers reads it for any family: factor (or max_positions / the original context),
    the ramp's bounds, and the attention factor cos and sin are scaled by -- given, or from mscale and
    mscale_all_dim where both are set (DeepSeek), else 0.1 ln(factor) + 1."""
    try:
        original = int(spec["original_max_position_embeddings"])
        factor = spec.get("factor")
        factor = float(factor) if factor is not None else max_positions / original
        fast, slow = float(spec.get("beta_fast") or 32.0), float(spec.get("beta_slow") or 1.0)
        mscale, all_dim, given = spec.get("mscale"), spec.get("mscale_all_dim"), spec.get("attention_factor")
        attention = float(given) if given is not None else get_mscale(factor, mscale) / get_mscale(factor, all_dim) \
            if mscale and all_dim else get_mscale(factor)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise LarqlError("config.json: yarn rope scaling needs original_max_position_embeddings and a numeric "
                         "factor") from None
    return RopeConfig(theta, "yarn", factor, original_max_position_embeddings=original, beta_fast=fast,
                      beta_slow=slow, truncate=bool(spec.get("truncate", True)), attention_factor=attention)


def softmax_mscale(spec: dict[str, Any], factor: float) -> float:
    """What MLA multiplies its softmax scale by: mscale(factor, mscale_all_dim) squared (1 without)."""
    all_dim = spec.get("mscale_all_dim") or 0
    if spec.get("rope_type", spec.get("type", "default")) == "default" or not all_dim:
        return 1.0
    m = get_mscale(factor, float(all_dim))
    return m * m


def single_rope(raw: dict[str, Any], default_theta: float) -> RopeConfig:
    """One RoPE for every layer: transformers 5's rope_parameters, or legacy rope_theta / rope_scaling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("rope_theta" in params or "rope_type" in params):
        return rope_from(params, params.get("rope_theta", raw.get("rope_theta", default_theta)))
    return rope_from(raw.get("rope_scaling"), raw.get("rope_theta", default_theta))


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text decoder: its text_config, the outer eos ids and model_type."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise LarqlError(f"config.json: model_type {raw.get('model_type')!r} without a text_config")
    return {**text, "eos_token_id": raw.get("eos_token_id", text.get("eos_token_id")), "model_type": raw["model_type"]}


def token_ids(raw: dict[str, Any], default_eos: int | None = None) -> dict[str, Any]:
    eos = raw.get("eos_token_id", default_eos)
    eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bos, pad = raw.get("bos_token_id"), raw.get("pad_token_id")
    return {"bos_token_id": None if bos is None else int(bos), "eos_token_ids": eos_ids,
            "pad_token_id": None if pad is None else int(pad)}


def activation(raw: dict[str, Any], default: str) -> str:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or default
    table = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "silu": "silu"}
    if act not in table:
        raise LarqlError(f"config.json: unsupported hidden_activation {act!r}")
    return table[act]


def moe_from(raw: dict[str, Any], experts_key: str, intermediate_key: str, norm_topk_prob: bool,
             sparse: list[bool], hf_block: str, hf_experts: tuple[str, str, str]) -> MoeConfig | None:
    """A family's experts from config.json, checked: the expert count under `experts_key`, the top k
    under num_experts_per_tok, each expert's size under `intermediate_key`; None without sparse layers."""
    n, k, size = raw.get(experts_key), raw.get("num_experts_per_tok", 2), raw.get(intermediate_key)
    for key, v in ((experts_key, n), ("num_experts_per_tok", k), (intermediate_key, size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == experts_key else 1):
            raise LarqlError(f"config.json: missing or invalid {key} ({v!r})")
    if n == 0 or not any(sparse):
        return None
    if k > n:
        raise LarqlError(f"config.json: num_experts_per_tok is {k}, above the {n} experts ({experts_key})")
    return MoeConfig(n, k, size, norm_topk_prob, tuple(sparse), hf_block, hf_experts)
