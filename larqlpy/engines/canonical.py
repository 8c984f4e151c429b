"""canonical/v1: every K/V row kept in f32 -- the exact baseline every other engine is held to."""

from __future__ import annotations

import torch

from larqlpy.engines.base import LayerGeometry, LayerStore, Provider


class GrowingRows:
    """Rows for positions [0, n) in an f32 buffer (Hkv, capacity, D) that doubles when full."""

    MIN_CAPACITY = 256

    def __init__(self, n_kv: int, head_dim: int, device: torch.device):
        self.n_kv, self.head_dim, self.device = n_kv, head_dim, device
        self.k = torch.empty(n_kv, 0, head_dim, dtype=torch.float32, device=device)
        self.v = torch.empty_like(self.k)
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        t = k.shape[1]
        if self.n + t > self.k.shape[1]:
            cap = max(self.MIN_CAPACITY, 2 * self.k.shape[1], self.n + t)
            self.k = _regrow(self.k, self.n, cap)
            self.v = _regrow(self.v, self.n, cap)
        self.k[:, self.n:self.n + t] = k
        self.v[:, self.n:self.n + t] = v
        self.n += t

    def slice(self, lo: int, hi: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, lo:hi].to(dtype), self.v[:, lo:hi].to(dtype)

    def nbytes(self) -> int:
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()


def _regrow(buf: torch.Tensor, n: int, capacity: int) -> torch.Tensor:
    new = torch.empty(buf.shape[0], capacity, buf.shape[2], dtype=buf.dtype, device=buf.device)
    new[:, :n] = buf[:, :n]
    return new


class CanonicalStore(LayerStore):
    def __init__(self, geometry: LayerGeometry, device: torch.device):
        super().__init__(geometry, device)
        self.rows = GrowingRows(geometry.n_kv_heads, geometry.head_dim, device)

    def append(self, k, v):
        self.rows.append(k, v)
        self.end = self.rows.n

    def read(self, start, dtype):
        return self.rows.slice(start, self.end, dtype)

    def retained(self):
        return 0, self.end

    def resident_bytes(self):
        return self.rows.nbytes()


class Canonical(Provider):
    identity = "canonical/v1"
    summary = "every f32 K/V row; exact baseline (sliding layers read only their window)"

    def make_store(self, geometry, device):
        return CanonicalStore(geometry, device)

    def retained_rows(self, geometry, positions):
        return positions
