"""Gemma 3 text configuration, read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from larqlpy.errors import LarqlError

SLIDING = "sliding_attention"
GLOBAL = "full_attention"
SUPPORTED_ROPE_TYPES = ("default", "linear")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0  # linear scaling divides positions (equivalently the frequencies) by this


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_global: RopeConfig
    rope_local: RopeConfig
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 32768
    bos_token_id: int = 2
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    weight_prefix: str = "model."  # "language_model.model." for the multimodal checkpoint

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def window(self, layer: int) -> int | None:
        """Rows a query at this layer can see (itself included); None for global layers."""
        return self.sliding_window if self.is_sliding(layer) else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Gemma3Config":
        """Build from a config.json dict; unknown keys are ignored, missing required ones refused."""
        model_type = raw.get("model_type")
        prefix = "model."
        if model_type == "gemma3":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise LarqlError("config.json: model_type 'gemma3' without a text_config")
            eos = raw.get("eos_token_id", text.get("eos_token_id"))
            raw = {**text, "eos_token_id": eos}
            prefix = "language_model.model."
        elif model_type != "gemma3_text":
            raise LarqlError(
                f"config.json: unsupported model_type {model_type!r} (expected 'gemma3_text' or 'gemma3')"
            )
        required = (
            "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
        )
        missing = [k for k in required if not isinstance(raw.get(k), int) or raw.get(k) <= 0]
        if missing:
            raise LarqlError(f"config.json: missing or invalid {', '.join(missing)}")
        n_layers = raw["num_hidden_layers"]
        layer_types = raw.get("layer_types")
        if layer_types is None:
            pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
            # Gemma 3: every `pattern`-th layer is global, the others slide.
            layer_types = [GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers or not set(layer_types) <= {SLIDING, GLOBAL}:
            raise LarqlError("config.json: layer_types must list 'sliding_attention'/'full_attention' per layer")
        rope_global, rope_local = _rope_from_dict(raw)
        eos = raw.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (int(eos),)
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
            raise LarqlError(f"config.json: unsupported hidden_activation {act!r}")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw["num_key_value_heads"],
            head_dim=raw["head_dim"],
            sliding_window=int(raw.get("sliding_window") or 4096),
            layer_types=layer_types,
            rope_global=rope_global,
            rope_local=rope_local,
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            hidden_activation=act,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            bos_token_id=int(raw.get("bos_token_id", 2)),
            eos_token_ids=eos_ids,
            pad_token_id=int(raw.get("pad_token_id", 0)),
            weight_prefix=prefix,
        )

    def to_dict(self) -> dict[str, Any]:
        """The HF `gemma3_text` config.json spelling (what the converter writes)."""
        d = dataclasses.asdict(self)
        d.pop("weight_prefix")
        d.pop("rope_global"), d.pop("rope_local")
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = list(d.pop("eos_token_ids"))
        d["rope_theta"] = self.rope_global.theta
        d["rope_local_base_freq"] = self.rope_local.theta
        d["rope_scaling"] = (
            None if self.rope_global.rope_type == "default"
            else {"rope_type": self.rope_global.rope_type, "factor": self.rope_global.factor}
        )
        return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **d}


def _rope_from_dict(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """Legacy keys (rope_theta, rope_local_base_freq, rope_scaling) or transformers 5's rope_parameters."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and GLOBAL in params:
        g = params.get(GLOBAL) or {}
        l = params.get(SLIDING) or {}
        return _rope(g, g.get("rope_theta", 1e6)), _rope(l, l.get("rope_theta", 1e4))
    scaling = raw.get("rope_scaling") or {}
    return _rope(scaling, raw.get("rope_theta", 1e6)), RopeConfig(float(raw.get("rope_local_base_freq", 1e4)))


def _rope(spec: dict[str, Any], theta: float) -> RopeConfig:
    rope_type = spec.get("rope_type", spec.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise LarqlError(f"config.json: unsupported rope_type {rope_type!r} (supported: default, linear)")
    factor = float(spec.get("factor", 1.0)) if rope_type == "linear" else 1.0
    return RopeConfig(theta=float(theta), rope_type=rope_type, factor=factor)


def read_config(path: Path) -> Gemma3Config:
    """The directory's config.json, checked (no weights read)."""
    cfg_path = path / "config.json"
    if path.is_file():
        raise LarqlError(f"{path}: is a file, not a model directory")
    if not path.is_dir():
        raise LarqlError(f"{path}: no such model directory")
    if not cfg_path.is_file():
        raise LarqlError(f"{path}: not a model directory (no config.json)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LarqlError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise LarqlError(f"{cfg_path}: expected a JSON object")
    return Gemma3Config.from_dict(raw)
