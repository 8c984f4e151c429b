"""The key calibration as engines use it: per layer and KV head, the keys' mean and a per-channel
scale (measured by larqlpy.calibration, read from kv_calibration.safetensors by the model).

Codes hold y = (k - mean) * scale; reconstruction is plain algebra -- k' = y' / scale + mean, and
q . k' = (q / scale) . y' + q . mean -- so a codec needs nothing else to use it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.errors import LarqlError


@dataclass(frozen=True)
class KeyCalibration:
    """One layer's: mean and scale are (Hkv, D) float32; digest names them (saved with states)."""

    mean: torch.Tensor
    scale: torch.Tensor
    digest: str

    @classmethod
    def of(cls, mean: torch.Tensor, scale: torch.Tensor) -> "KeyCalibration":
        mean, scale = mean.float().contiguous(), scale.float().contiguous()
        h = hashlib.sha256(mean.numpy().tobytes() + scale.numpy().tobytes()).hexdigest()[:16]
        return cls(mean, scale, h)

    def to(self, device: torch.device) -> "KeyCalibration":
        return KeyCalibration(self.mean.to(device), self.scale.to(device), self.digest)

    def apply(self, k: torch.Tensor) -> torch.Tensor:
        """Keys (Hkv, N, D) -> what the codes hold: (k - mean) * scale."""
        return (k.float() - self.mean[:, None]) * self.scale[:, None]

    def undo(self, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decoded codes (Hkv, N, D) -> keys: y / scale + mean (into `out` when given; it may be y)."""
        return torch.div(y, self.scale[:, None], out=out).add_(self.mean[:, None])

    def query(self, q: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries (G, D) of one KV head -> (q / scale, q . mean): what scores on codes take."""
        return q / self.scale[head], q @ self.mean[head]


def require_calibration(geometries: Sequence[LayerGeometry], who: str) -> None:
    """Refuse, in one line, an engine asked to use a key calibration the model does not have."""
    missing = next((g for g in geometries if g.key_calibration is None), None)
    if missing is not None:
        if missing.calibration_problem:
            raise LarqlError(f"{who} needs the model's key calibration, and it is unusable: "
                             f"{missing.calibration_problem}")
        raise LarqlError(f"{who} needs the model's key calibration (kv_calibration.safetensors beside the "
                         "weights); run `calibrate`")
