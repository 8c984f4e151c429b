"""YaRN's RoPE frequencies (transformers' _compute_yarn_parameters): each frequency blended between
itself (extrapolated) and itself / factor (interpolated) by a linear ramp over the dimensions whose
wavelengths make between beta_fast and beta_slow turns in the original context. The attention factor
(cos and sin scaled by it) is the Rope tables' business (model/decoder.py)."""

from __future__ import annotations

import math

import torch

from larqlpy.model.config import RopeConfig


def _correction_dim(turns: float, dim: int, base: float, context: int) -> float:
    """The dimension whose wavelength makes `turns` turns in `context` positions."""
    return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(cfg: RopeConfig, dim: int) -> torch.Tensor:
    base, context = cfg.theta, cfg.original_max_position_embeddings
    low = _correction_dim(cfg.beta_fast, dim, base, context)
    high = _correction_dim(cfg.beta_slow, dim, base, context)
    if cfg.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (cfg.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the extrapolated frequency
    return interpolated * (1 - keep) + extrapolated * keep
