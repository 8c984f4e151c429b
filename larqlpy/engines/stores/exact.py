"""Exact K/V rows in the layer's kv_dtype: canonical/v1 keeps every one, window/v1 a ring of the
newest `keep` on sliding layers. Both round a row to the dtype once, when it is stored, and every
read (prefill's and the decode kernel's) sees the stored value, so the two stay bit-identical at
any one dtype."""

from __future__ import annotations

import torch

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.kvdtype import torch_dtype
from larqlpy.engines.stores.rows import Rows, RowSet, RowStore
from larqlpy.kernels.attention import Span


class ExactStore(RowStore):
    """K/V rows in the layer's kv_dtype: all of them (keep=None) or the newest `keep` (a ring)."""

    def __init__(self, geometry: LayerGeometry, device: torch.device, keep: int | None = None):
        super().__init__(geometry, device)
        self.dtype = torch_dtype(geometry.kv_dtype)
        row = ((geometry.head_dim,), self.dtype)
        self.rows = Rows(geometry.n_kv_heads, {"k": row, "v": row}, device, keep)
        self._sets = {"main": RowSet(self.rows, "ACTIVE", geometry.kv_dtype)}  # asked for by every token's metrics

    def append(self, k, v):
        self.rows.append({"k": k.to(self.dtype), "v": v.to(self.dtype)})
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
