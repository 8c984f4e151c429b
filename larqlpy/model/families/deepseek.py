"""DeepSeek-V2 and V3 (`deepseek_v2`, `deepseek_v3`): multi-head latent attention (model/mla.py) and
DeepSeek-MoE -- layers from first_k_dense_replace on (and, where config.json has moe_layer_freq, those
a multiple of it, as DeepSeek's own code says) run n_routed_experts experts of
moe_intermediate_size beside n_shared_experts shared ones (one dense MLP of n_shared_experts x
moe_intermediate_size added to every row), the first layers a dense MLP of intermediate_size.
Routing (model/routing.py): V2 scores by softmax and picks greedily or group-limited (topk_method,
n_group, topk_group), its weights never renormalized (transformers' V2 router ignores
norm_topk_prob); V3 scores by sigmoid, picks group-limited with e_score_correction_bias (noaux_tc)
and renormalizes where norm_topk_prob; both times routed_scaling_factor. RoPE: default or YaRN
(model/yarn.py, with MLA's mscale on the softmax scale); V2 rotates interleaved pairs, V3 where
rope_interleave (the default). `kv_b_split` (a deepseek2 GGUF's, weights/gguf_deepseek.py): kv_b_proj
held per head as k_b_proj and v_b_proj. V3's multi-token-prediction layers (num_nextn_predict_layers,
after the last layer) are not run; their tensors are left in the files."""

from __future__ import annotations

from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.model.config import MlaConfig, MoeConfig, single_rope, softmax_mscale, yarn_rope
from larqlpy.model.families import llama

HF_NAMES = ("mlp", ("gate_proj", "up_proj", "down_proj"))  # the router (mlp.gate) and experts under layers.{i}.
MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _int(raw: dict[str, Any], key: str, default: Any = None, low: int = 1) -> int:
    v = raw.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise LarqlError(f"config.json: missing or invalid {key} ({v!r})")
    return v


def _rope(raw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The RoPE (default or yarn) and the spec it came from."""
    spec = raw.get("rope_parameters")
    if not (isinstance(spec, dict) and ("rope_theta" in spec or "rope_type" in spec)):
        spec = raw.get("rope_scaling") or {}
    theta = spec.get("rope_theta", raw.get("rope_theta", 10000.0))
    if spec.get("rope_type", spec.get("type")) == "yarn":
        return yarn_rope(spec, theta, int(raw.get("max_position_embeddings", 2048))), spec
    return single_rope(raw, 10000.0), spec


def _mla(raw: dict[str, Any], v3: bool) -> MlaConfig:
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _int(raw, "q_lora_rank")
    nope, rope, v = (_int(raw, k) for k in MLA_KEYS[1:])
    if rope % 2:
        raise LarqlError(f"config.json: qk_rope_head_dim must be even ({rope})")
    return MlaConfig(q_lora, _int(raw, "kv_lora_rank"), nope, rope, v,
                     bool(raw.get("rope_interleave", True)) if v3 else True, bool(raw.get("kv_b_split", False)))


def _moe(raw: dict[str, Any], n: int, v3: bool) -> MoeConfig | None:
    experts = _int(raw, "n_routed_experts", 0, 0)
    first, freq = _int(raw, "first_k_dense_replace", 0, 0), _int(raw, "moe_layer_freq", 1)
    sparse = tuple(i >= first and i % freq == 0 for i in range(n))
    if not experts or not any(sparse):
        return None
    k = _int(raw, "num_experts_per_tok")
    method = "noaux_tc" if v3 else raw.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise LarqlError(f"config.json: unsupported topk_method {method!r} (greedy, group_limited_greedy, noaux_tc)")
    groups = _int(raw, "n_group", 1) if method != "greedy" else 1
    keep = _int(raw, "topk_group", 1) if method != "greedy" else 1
    if experts % groups or keep > groups or k > experts or (method == "noaux_tc" and experts // groups < 2):
        raise LarqlError(f"config.json: {experts} experts, n_group {groups}, topk_group {keep} and "
                         f"num_experts_per_tok {k} do not fit together")
    size, shared = _int(raw, "moe_intermediate_size"), _int(raw, "n_shared_experts", 0, 0)
    return MoeConfig(experts, k, size, bool(raw.get("norm_topk_prob", False)) and v3, sparse, *HF_NAMES,
                     scoring="sigmoid" if v3 else "softmax", topk_method=method, n_group=groups, topk_group=keep,
                     routed_scaling=float(raw.get("routed_scaling_factor", 1.0)), shared_intermediate=shared * size)


def config(raw: dict[str, Any]):
    v3 = raw.get("model_type") == "deepseek_v3"
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise LarqlError(f"config.json: {raw.get('model_type')} with attention_bias or mlp_bias is not supported")
    n = _int(raw, "num_hidden_layers")
    mla, moe = _mla(raw, v3), _moe(raw, n, v3)
    rope, spec = _rope(raw)
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5 * softmax_mscale(spec, rope.factor)
    extra = _int(raw, "num_nextn_predict_layers", 0, 0) if v3 else 0
    plain = {**raw, "head_dim": mla.kv_lora_rank + mla.qk_rope_head_dim, "rope_parameters": None, "rope_scaling": None}
    return llama.config(plain, num_key_value_heads=1,
                        rope_global=rope, rope_local=rope, attention_scale=scale, moe=moe, mla=mla,
                        ignored=tuple(f"layers.{i}." for i in range(n, n + extra)))
