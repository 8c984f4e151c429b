"""Generation settings: frozen dataclasses whose `from_dict` ignores unknown keys. The CLI, the
Python API and batch lines share these defaults (plain Python: the CLI reads them without torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from larqlpy.errors import LarqlError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise LarqlError(f"`{name}` must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0:
            raise LarqlError(f"`temperature` must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LarqlError(f"`top_k` must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LarqlError(f"`top_p` must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 64
    prefill_chunk: int = 1024
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_at_eos: bool = True

    def __post_init__(self):
        if self.max_tokens < 0:
            raise LarqlError(f"`max_tokens` must be >= 0, got {self.max_tokens}")
        if self.prefill_chunk < 1:
            raise LarqlError(f"`prefill_chunk` must be >= 1, got {self.prefill_chunk}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "GenerationConfig":
        """Build from a flat dict (CLI flags, JSON lines); unknown keys are ignored."""
        sampling_keys = {f.name for f in fields(SamplingConfig)}
        own = {f.name for f in fields(cls)} - {"sampling"}
        sampling = SamplingConfig(**{k: v for k, v in raw.items() if k in sampling_keys and v is not None})
        return cls(sampling=sampling, **{k: v for k, v in raw.items() if k in own and v is not None})
