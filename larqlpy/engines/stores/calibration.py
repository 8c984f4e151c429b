"""The key calibration as engines use it: per layer and KV head, the keys' mean and a per-channel
scale (measured by larqlpy.calibration, read from kv_calibration.safetensors by the model).

Codes hold y = (k - m_p) * scale; reconstruction is plain algebra -- k' = y' / scale + m_p, and
q . k' = (q / scale) . y' + q . m_p -- so a codec needs nothing else to use it. A head's mean m_p
is the same at every position, or one taken before RoPE and rotated to the row's position p
(RoPE's rotation, rotate-half layout, with the layer's inverse frequencies). A constant mean
misses what RoPE spins: a key bias (Qwen2) turns at the speed of its channel pair, so most of it
stays in the rows; the turning mean takes it out at every position.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.errors import LarqlError
from larqlpy.kernels.kvcodec import tq_step


class _Turns:
    """cos and sin of every (position, channel pair) angle, (P, D/2) each, grown on demand: one per
    set of frequencies and device, shared by the layers and states that use it. Computed as the
    model's RoPE tables are (position * freq in float32), so m_p is the model's own R(p) mean."""

    _all: dict = {}
    _lock = threading.Lock()

    def __init__(self, freq: torch.Tensor):
        self.freq = freq
        self.cs = torch.empty(0, 2 * freq.shape[0], device=freq.device)
        self.array = self.cs.numpy() if freq.device.type == "cpu" else None  # `cs` for the CPU's kernels

    @classmethod
    def of(cls, freq: torch.Tensor) -> "_Turns":
        key = (freq.cpu().numpy().tobytes(), str(freq.device))
        with cls._lock:
            return cls._all.setdefault(key, cls(freq))

    def rows(self, first: int, n: int) -> torch.Tensor:
        """[cos | sin] of positions first..first+n-1: (n, D)."""
        cs = self.cs
        if first + n > cs.shape[0]:
            with self._lock:
                if first + n > self.cs.shape[0]:
                    p = max(2 * self.cs.shape[0], first + n, 1024)
                    ang = torch.arange(p, device=self.freq.device).float()[:, None] * self.freq[None, :]
                    self.cs = torch.cat((ang.cos(), ang.sin()), dim=-1)
                    self.array = self.cs.numpy() if self.cs.device.type == "cpu" else None
                cs = self.cs
        return cs[first:first + n]

    def rows_array(self, first: int, n: int) -> np.ndarray:
        """`rows` as a numpy view (CPU)."""
        if first + n > self.array.shape[0]:
            self.rows(first, n)
        return self.array[first:first + n]


def _turns(freq: torch.Tensor | None) -> _Turns | None:
    return None if freq is None else _Turns.of(freq)


@dataclass(frozen=True)
class KeyCalibration:
    """One layer's: mean, scale (Hkv, D) float32; a head's mean m_p = mean + R(p) turning, `mean`
    the same at every position and `turning` taken before RoPE and turned to each row's position
    with the layer's inverse frequencies `freq` (D/2,); either may be zero (larqlpy.calibration
    measures which form serves each head). digest names it all (states record it)."""

    mean: torch.Tensor
    scale: torch.Tensor
    digest: str
    turning: torch.Tensor | None = None
    freq: torch.Tensor | None = None
    turns: _Turns | None = field(default=None, compare=False, repr=False)
    inv_scale: torch.Tensor = field(init=False, compare=False, repr=False)  # 1 / scale, divided exactly once

    def __post_init__(self):
        object.__setattr__(self, "inv_scale", 1.0 / self.scale)

    @classmethod
    def of(cls, mean: torch.Tensor, scale: torch.Tensor, turning: torch.Tensor | None = None,
           freq: torch.Tensor | None = None) -> "KeyCalibration":
        mean, scale = mean.float().contiguous(), scale.float().contiguous()
        named = mean.cpu().numpy().tobytes() + scale.cpu().numpy().tobytes()
        if turning is not None and bool(turning.any()):
            turning, freq = turning.float().contiguous(), freq.float().contiguous()
            named += b"rope" + turning.cpu().numpy().tobytes() + freq.cpu().numpy().tobytes()
        else:
            turning = freq = None
        return cls(mean, scale, hashlib.sha256(named).hexdigest()[:16], turning, freq, _turns(freq))

    def to(self, device: torch.device) -> "KeyCalibration":
        turning, freq = (None, None) if self.freq is None else (self.turning.to(device), self.freq.to(device))
        return KeyCalibration(self.mean.to(device), self.scale.to(device), self.digest, turning, freq,
                              _turns(freq))

    def means(self, first: int, n: int) -> torch.Tensor:
        """The mean at positions first..first+n-1: (Hkv, n, D), or (Hkv, 1, D) when none turns."""
        if self.turning is None:
            return self.mean[:, None]
        cs = self.turns.rows(first, n)
        half = self.mean.shape[-1] // 2
        cos, sin = cs[:, :half], cs[:, half:]
        a, b = self.turning[:, None, :half], self.turning[:, None, half:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).add_(self.mean[:, None])

    def apply(self, k: torch.Tensor, first: int) -> torch.Tensor:
        """Keys (Hkv, N, D) at positions first.. -> what the codes hold: (k - m_p) * scale. One row on
        the CPU (a decode step's) in one kernel call, the same bits (`apply_row`)."""
        if k.shape[1] == 1 and k.device.type == "cpu":
            return self.apply_row(k, first)
        return (k.float() - self.means(first, k.shape[1])) * self.scale[:, None]

    def undo(self, y: torch.Tensor, first: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decoded codes (Hkv, N, D) at positions first.. -> keys: y / scale + m_p (into `out` when
        given; it may be y)."""
        return torch.div(y, self.scale[:, None], out=out).add_(self.means(first, y.shape[1]))

    @cached_property
    def _arrays(self) -> tuple[np.ndarray, ...]:
        """(1 / scale, mean, turning or empty, scale) as numpy views, made once (CPU)."""
        turning = NONE if self.turning is None else self.turning.numpy()
        return self.inv_scale.numpy(), self.mean.numpy(), turning, self.scale.numpy()

    def _cs(self, first: int, n: int) -> np.ndarray:
        return NONE if self.turning is None else self.turns.rows_array(first, n)

    def kernel_args(self, first: int, n: int) -> tuple[np.ndarray, ...]:
        """For the fused decode kernel (kernels/kvcodec/tq_attend.py), rows at positions first..first+n-1:
        (1 / scale, mean, turning (Hkv, D), [cos | sin] rows (n, D)), the last two empty when no head
        turns. CPU only."""
        return *self._arrays[:3], self._cs(first, n)

    def step_args(self, first: int) -> tuple[np.ndarray, ...]:
        """For a decode step's keys at position `first` (kernels/kvcodec/tq_step.py): (mean, scale, turning
        (Hkv, D), the position's [cos | sin] row (1, D)), the last two empty when no head turns."""
        _, mean, turning, scale = self._arrays
        return mean, scale, turning, self._cs(first, 1)

    def apply_row(self, k: torch.Tensor, first: int) -> torch.Tensor:
        """`apply` for a decode step's keys (Hkv, 1, D) on the CPU, in one kernel call: the bits of
        torch's ops."""
        out = np.empty(k.shape, np.float32)
        tq_step.calibrate_rows(k.float().contiguous().numpy(), *self.step_args(first), out)
        return torch.from_numpy(out)


NONE = np.zeros((0, 0), np.float32)  # a part the kernel is not given
NO_CALIBRATION = (NONE,) * 4


def require_calibration(geometries: Sequence[LayerGeometry], who: str) -> None:
    """Refuse, in one line, an engine asked to use a key calibration the model does not have."""
    missing = next((g for g in geometries if g.key_calibration is None), None)
    if missing is not None:
        if missing.calibration_problem:
            raise LarqlError(f"{who} needs the model's key calibration, and it is unusable: "
                             f"{missing.calibration_problem}")
        raise LarqlError(f"{who} needs the model's key calibration (kv_calibration.safetensors beside the "
                         "weights); run `calibrate`")
