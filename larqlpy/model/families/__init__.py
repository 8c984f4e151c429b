"""The decoder families, by config.json's `model_type`: each module reads its family's config.json
into a ModelConfig, declaring how it differs; the decoder (model/decoder.py) is shared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from larqlpy.errors import LarqlError
from larqlpy.model.config import ModelConfig
from larqlpy.model.families import deepseek, gemma2, gemma3, gemma4, gpt2, gpt_oss, granite, granitemoe, llama, \
    mistral, mixtral, qwen2, qwen3, qwen3_moe, starcoder2

FAMILIES: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "llama": llama.config, "mistral": mistral.config, "qwen2": qwen2.config, "qwen3": qwen3.config,
    "mixtral": mixtral.config, "qwen3_moe": qwen3_moe.config, "gemma2": gemma2.config, "gemma3_text": gemma3.config,
    "gemma3": gemma3.config_multimodal, "granite": granite.config, "granitemoe": granitemoe.config,
    "starcoder2": starcoder2.config, "gpt2": gpt2.config, "gpt_oss": gpt_oss.config,
    "deepseek_v2": deepseek.config, "deepseek_v3": deepseek.config,
    "gemma4_text": gemma4.config, "gemma4": gemma4.config_multimodal,
}


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    """Build from a config.json dict by its `model_type`; unknown keys are ignored."""
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise LarqlError(f"config.json: unsupported model_type {model_type!r} (supported: {', '.join(FAMILIES)})")
    return family(raw)


def read_raw_config(path: Path) -> dict[str, Any]:
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
    return raw


def read_config(path: Path) -> ModelConfig:
    """The directory's config.json, checked and read by its family (no weights read)."""
    return config_from_dict(read_raw_config(path))
