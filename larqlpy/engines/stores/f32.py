"""f32 K/V rows: canonical/v1 keeps every one, window/v1 a ring of the newest `keep` on sliding layers."""

from __future__ import annotations

import torch

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.rows import Rows, RowSet, RowStore


class F32Store(RowStore):
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
        k, v = r["k"], r["v"]
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))

    def release(self):
        self.rows.commit()

    def row_sets(self):
        return {"main": RowSet(self.rows, "ACTIVE", "f32")}
