"""canonical/v1: every K/V row kept in f32 -- the exact baseline every other engine is held to."""

from __future__ import annotations

import torch

from larqlpy.engines.base import LayerGeometry, LayerStore, Provider
from larqlpy.engines.rows import Rows


class F32Store(LayerStore):
    """K/V rows in f32: all of them (keep=None) or the newest `keep` (a ring)."""

    def __init__(self, geometry: LayerGeometry, device: torch.device, keep: int | None = None):
        super().__init__(geometry, device)
        row = ((geometry.head_dim,), torch.float32)
        self.rows = Rows(geometry.n_kv_heads, {"k": row, "v": row}, device, keep)

    def append(self, k, v):
        self.rows.append({"k": k.float(), "v": v.float()})
        self.end = self.rows.end

    def read(self, start, dtype):
        r = self.rows.read(start, self.end)
        return r["k"].to(dtype), r["v"].to(dtype)

    def release(self):
        self.rows.commit()

    def row_sets(self):
        return {"main": (self.rows, "ACTIVE", "f32")}

    def retained(self):
        return self.rows.base, self.rows.end

    def resident_bytes(self):
        return self.rows.nbytes()


class Canonical(Provider):
    identity = "canonical/v1"
    summary = "every f32 K/V row; exact baseline (sliding layers read only their window)"

    def make_store(self, geometry, device):
        return F32Store(geometry, device)

    def retained_rows(self, geometry, positions):
        return positions
