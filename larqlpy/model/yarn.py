"""YaRN RoPE scaling as transformers computes it (modeling_rope_utils: _compute_yarn_parameters,
yarn_get_mscale, yarn_apply_mscale): frequencies ramped between interpolated (divided by factor)
and extrapolated ones, cos and sin multiplied by an attention factor, and for DeepSeek's MLA the
softmax scale multiplied by mscale(factor, mscale_all_dim) squared. Plain Python but the frequencies."""

from __future__ import annotations

import math

import torch

from larqlpy.model.config import RopeConfig


def yarn_inv_freq(cfg: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's inverse frequencies for a `dim`-wide rotation."""
    base, original = cfg.theta, cfg.original_max_position_embeddings

    def correction(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(cfg.beta_fast), correction(cfg.beta_slow)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp
    return (1.0 / (cfg.factor * pos)) * (1 - extrapolated) + (1.0 / pos) * extrapolated
