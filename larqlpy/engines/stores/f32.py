"""f32 K/V rows: canonical/v1 keeps every one, window/v1 a ring of the newest `keep` on sliding layers."""

from __future__ import annotations

import torch

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.rows import Rows, RowSet, RowStore
from larqlpy.kernels.attention import Span


class F32Store(RowStore):
    """K/V rows in f32: all of them (keep=None) or the newest `keep` (a ring)."""

    def __init__(self, geometry: LayerGeometry, device: torch.device, keep: int | None = None):
        super().__init__(geometry, device)
        row = ((geometry.head_dim,), torch.float32)
        self.rows = Rows(geometry.n_kv_heads, {"k": row, "v": row}, device, keep)
        self._sets = {"main": RowSet(self.rows, "ACTIVE", "f32")}  # asked for by every token's metrics

    def append(self, k, v):
        self.rows.append({"k": k.float(), "v": v.float()})
        self.end = self.rows.end

    def decode_rows(self, k, v):
        # the buffers as they are: the kernel writes the step's row into the slot claimed here (a ring
        # of keep >= window rows never holds a readable row in that slot)
        r, start = self.rows, self.geometry.read_start(self.end)
        r.claim_row()
        self.end = r.end
        buf = r.buf
        return Span(buf["k"], buf["v"], r.slot(start), self.end - start, r.keep or 0, True)

    def read(self, start, dtype):
        r = self.rows.read(start, self.end)
        k, v = r["k"], r["v"]
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))

    def release(self):
        self.rows.commit()

    def row_sets(self):
        return self._sets
