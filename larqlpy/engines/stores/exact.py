"""Exact K/V rows in the layer's kv_dtype: canonical/v1 keeps every one, window/v1 a ring of the
newest `keep` on sliding layers. Both round a row to the dtype once, when it is stored, and every
read (prefill's and the decode kernel's) sees the stored value, so the two stay bit-identical at
any one dtype. Where a layer's values are its keys (MLA's latent rows) a row is kept once and read
as both."""

from __future__ import annotations

import torch

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.kvdtype import torch_dtype
from larqlpy.engines.stores.rows import Rows
from larqlpy.engines.stores.rowstore import RowSet, RowStore
from larqlpy.kernels.attention.decode import CHUNK, Span


class ExactStore(RowStore):
    """K/V rows in the layer's kv_dtype: all of them (keep=None) or the newest `keep` (a ring)."""

    def __init__(self, geometry: LayerGeometry, device: torch.device, keep: int | None = None):
        super().__init__(geometry, device)
        self.dtype = torch_dtype(geometry.kv_dtype)
        row = ((geometry.head_dim,), self.dtype)
        self.v = "k" if geometry.values_are_keys else "v"  # the field values are read from
        self.rows = Rows(geometry.n_kv_heads, {"k": row} if self.v == "k" else {"k": row, "v": row}, device, keep)
        self._sets = {"main": RowSet(self.rows, "ACTIVE", geometry.kv_dtype)}  # asked for by every token's metrics

    def append(self, k, v):
        self.rows.append({"k": k.to(self.dtype)} if self.v == "k" else {"k": k.to(self.dtype), "v": v.to(self.dtype)})
        self.end = self.rows.end

    def decode_rows(self, k, v):
        # the buffers as they are: the kernel writes the step's row into the slot claimed here (a ring
        # of keep >= window rows never holds a readable row in that slot); a branch reads its
        # prompt's shared rows first
        self.rows.claim_row()
        self.end = self.rows.end
        return self._step_span(self.end)

    def decode_steps(self, k, v):
        # every row claimed before any span is made: a claim may grow (move) the buffers; a ring
        # needs slack for the block's later rows not to take slots its earlier ones read
        r, n = self.rows, k.shape[1]
        if r.keep is not None and r.slack < n - 1:
            return None
        for _ in range(n):
            r.claim_row()
        first, self.end = self.end, r.end
        return [self._step_span(end) for end in range(first + 1, self.end + 1)]

    def _step_span(self, end: int):
        """Where the decode query at position end - 1 reads, its own row the kernel's to write."""
        r, start = self.rows, self.geometry.read_start(end - 1)
        buf, lo = r.buf, max(start, r.offset)
        own = Span(buf["k"], buf[self.v], r.slot(lo), end - lo, r.ring or 0, True)
        if start >= r.offset:
            return own
        return Span(r.prefix["k"], r.prefix[self.v], start, r.offset - start), own

    def fork(self, other):
        """Growing rows are shared up to a whole chunk of the decode kernel (so a branch's chunks,
        and its numbers, are those of a sequence that never forked), and on a sliding layer up to
        where its window begins; the rest is copied. A ring is copied."""
        if self.rows.keep is not None:
            return super().fork(other)
        upto = other.end // CHUNK * CHUNK
        if self.geometry.window:
            upto = min(upto, max(0, other.end - self.geometry.window))
        self.rows.share(other.rows, upto)
        self.end = other.end

    def read(self, start, dtype):
        r = self.rows.read(start, self.end)
        k, v = r["k"], r[self.v]
        return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))

    def release(self):
        self.rows.commit()

    def row_sets(self):
        return self._sets
