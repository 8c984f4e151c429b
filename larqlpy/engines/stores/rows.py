"""Physical row storage the engines share: per-position fields for the logical range [base, end)
(a layer store kept in named sets of them: rowstore.py).

Two shapes of storage:
- growing (keep=None): every row from position 0, in buffers that double when full;
- ring (keep=N): only the newest N rows, in buffers of exactly N rows. A block's rows wait in
  `pending` while its queries read them, then `commit()` folds the newest N into the ring. A ring
  with `slack` S holds S rows more than it retains (N + S physical rows), so that it can be trimmed
  back S positions (speculative decoding rolls back rejected tokens) to exactly the N it would hold.

Fields are tensors of shape (Hkv, rows, *field_shape): K/V rows in the kv_dtype for the exact engines,
norms and packed codes for the codec engines. Reads come back in position order.

Growing storage may begin at `offset` > 0: the positions before it are another state's rows, shared
read-only (`prefix`, its buffers) -- a branch of a prompt forked n ways (`share`).
"""

from __future__ import annotations

import numpy as np
import torch

CELL_POSITIONS = 64  # saved states cut each row set into cells of this many positions
FieldSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Rows:
    MIN_CAPACITY = 256

    def __init__(self, n_kv: int, fields: FieldSpec, device: torch.device, keep: int | None = None,
                 min_capacity: int = MIN_CAPACITY):
        # min_capacity: the first allocation; a set that never holds more (e.g. a few sink rows) says so
        self.n_kv, self.fields, self.device, self.keep = n_kv, fields, device, keep
        self.min_capacity = min_capacity
        self.stack = None  # the family's stack.Stack that holds these buffers (stack.stack_sets)
        self.buf = {name: torch.zeros((n_kv, 0, *shape), dtype=dtype, device=device)
                    for name, (shape, dtype) in fields.items()}
        self.base = self.end = 0
        # growing only: buffer row 0 is position `offset`; before it, the first `offset` rows of `prefix`
        # (another state's whole buffers)
        self.offset, self.prefix, self._prefix_arrays = 0, None, None
        self.pending: dict[str, torch.Tensor] | None = None  # ring only: the current block's rows
        self.slack = 0  # ring only: rows held past `keep`, so that a trim can go back this far
        self.floor = 0  # ring only: the oldest position whose slot no newer row has taken

    @property
    def buf(self) -> dict[str, torch.Tensor]:
        return self._buf

    @buf.setter
    def buf(self, fields: dict[str, torch.Tensor]) -> None:
        self._buf = fields
        self._replaced()

    def _replaced(self) -> None:
        """The buffers were replaced: their numpy views (`arrays`) and allocation (`nbytes`) are taken
        again, and a family's stack no longer holds them."""
        self._arrays = self._buf_bytes = None
        self._capacity = next(iter(self._buf.values())).shape[1]
        if self.stack is not None:
            self.stack.live = False
            self.stack = None

    def arrays(self) -> dict[str, np.ndarray]:
        """The buffers as numpy arrays, views made once while the buffers stay: a decode kernel reads
        them every step (CPU; codes and norms)."""
        if self._arrays is None:
            self._arrays = {name: f.numpy() for name, f in self._buf.items()}
        return self._arrays

    @property
    def ring(self) -> int | None:
        """A ring's physical size: the rows it retains and its slack (None: growing)."""
        return None if self.keep is None else self.keep + self.slack

    def set_slack(self, slack: int) -> None:
        """Hold `slack` rows past `keep` from now on (a ring that has wrapped is laid out again)."""
        if self.keep is None or slack == self.slack:
            return
        assert self.pending is None
        if self.end > min(self.capacity, self.ring) or slack < self.slack:  # wrapped: rows move to new slots
            base = max(self.base, self.end - self.keep - slack)
            held = self.read(base, self.end) if self.end > base else None
            self.slack = slack
            self.restore(base, self.end, [(base, held)] if held is not None else [])
            self.base = max(base, self.end - self.keep)
        else:
            self.slack = slack

    @property
    def capacity(self) -> int:
        return self._capacity

    def append(self, values: dict[str, torch.Tensor]) -> None:
        t = next(iter(values.values())).shape[1]
        if self.keep is not None:
            assert self.pending is None, "append twice without commit"
            self.pending = values
        else:
            n = self.end - self.offset
            self._reserve(n + t)
            for name, v in values.items():
                self.buf[name][:, n:n + t] = v
        self.end += t

    def claim_row(self) -> int:
        """Room for the row at position `end`, which the caller writes straight into the buffers (a
        decode kernel); the row counts as stored at once. Returns its buffer row."""
        assert self.pending is None, "claim beside a pending block"
        held, keep = self.end - self.offset, self.keep  # a decode step per layer and set: kept lean
        if held >= self._capacity and (keep is None or self._capacity < keep + self.slack):  # full: grow
            self._reserve(held + 1)  # (a ring up to its size)
        self.end += 1
        if keep is None:
            return held
        ring = keep + self.slack
        self.base = max(0, self.end - keep)
        self.floor = max(self.floor, self.end - ring)
        return (self.end - 1) % ring

    def slot(self, position: int) -> int:
        """The buffer row of a retained position (at or past `offset`)."""
        return position - self.offset if self.keep is None else position % self.ring

    def _reserve(self, rows: int, exact: bool = False) -> None:
        """Grow the buffers (doubling, or to exactly `rows` when the caller knows the final count) to
        hold `rows` rows; a ring grows this way up to `keep`, so a short sequence costs what it holds,
        and wraps only once it is full."""
        if self.keep is not None:
            rows = min(rows, self.ring)
        if rows <= self.capacity:
            return
        cap = rows if exact else max(self.min_capacity, 2 * self.capacity, rows)
        if self.keep is not None:
            cap = min(cap, self.ring)
        n = min(self.end - self.offset - self.pending_rows(), self.capacity)
        for name, old in self.buf.items():
            new = torch.zeros((self.n_kv, cap, *old.shape[2:]), dtype=old.dtype, device=self.device)
            new[:, :n] = old[:, :n]
            self._buf[name] = new
        self._replaced()

    def reserve(self, rows: int) -> None:
        """Allocate room for the rows up to position `rows` now, exactly: later appends up to there
        never reallocate."""
        self._reserve(rows - self.offset, exact=True)

    def pending_rows(self) -> int:
        return next(iter(self.pending.values())).shape[1] if self.pending else 0

    def _stored_end(self) -> int:
        return self.end - (next(iter(self.pending.values())).shape[1] if self.pending else 0)

    def read(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Fields for positions [lo, hi), in order: views for growing storage, copies for a ring."""
        if self.keep is None:
            parts = self.pieces(lo, hi)
            return parts[0] if len(parts) == 1 else {name: torch.cat([p[name] for p in parts], dim=1)
                                                     for name in self.buf}
        self._check(lo, hi)
        if lo >= hi:  # an empty range of a ring (no slices to join)
            return {name: b[:, :0] for name, b in self.buf.items()}
        stored_end = self._stored_end()
        out = {}
        for name, b in self.buf.items():
            pieces = self._ring_slices(lo, min(hi, stored_end), b)
            if self.pending and hi > stored_end:
                pieces.append(self.pending[name][:, max(0, lo - stored_end):hi - stored_end])
            out[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        return out

    def pieces(self, lo: int, hi: int) -> list[dict[str, torch.Tensor]]:
        """Fields for positions [lo, hi) in order, as pieces never joined: a branch's shared prompt
        rows and its own, views both; otherwise one piece (a ring's as `read` gives it)."""
        if self.keep is not None:
            return [self.read(lo, hi)]
        return [{name: f[:, first:first + n] for name, f in fields.items()} for fields, first, n in self.spans(lo, hi)]

    def spans(self, lo: int, hi: int, arrays: bool = False) -> list[tuple[dict, int, int]]:
        """Positions [lo, hi) for kernels that read buffers in place, as (whole buffers, first buffer
        row, rows) in order: a branch's shared prompt rows and its own, or a wrapped ring's two runs
        (one span otherwise); the buffers as numpy arrays with `arrays`. Decode steps read them: a ring
        holds no pending block then."""
        self._check(lo, hi)
        buf = self.arrays() if arrays else self.buf
        if self.keep is not None:
            assert self.pending is None, "a pending block's rows are not in the ring yet"
            a, n = self.slot(lo), hi - lo
            return [(buf, a, n)] if a + n <= self.ring else [(buf, a, self.ring - a), (buf, 0, n - self.ring + a)]
        out = []
        if lo < self.offset:
            if arrays and self._prefix_arrays is None:
                self._prefix_arrays = {name: f.numpy() for name, f in self.prefix.items()}
            out.append((self._prefix_arrays if arrays else self.prefix, lo, min(hi, self.offset) - lo))
        if hi > self.offset or not out:
            first = max(lo, self.offset) - self.offset
            out.append((buf, first, max(hi, self.offset) - self.offset - first))
        return out

    def _check(self, lo: int, hi: int) -> None:
        # a ring's slack still holds rows before `base` (a later layer reading this one's rows steps
        # through a verification that has already moved `base` on: engines/stores/shared.py)
        if lo < self.oldest() or hi > self.end:
            raise RuntimeError(f"rows [{lo}, {hi}) outside the retained [{self.base}, {self.end})")

    def _ring_slices(self, lo: int, hi: int, b: torch.Tensor) -> list[torch.Tensor]:
        if lo >= hi:
            return []
        a, z = lo % self.ring, (hi - 1) % self.ring + 1
        return [b[:, a:z]] if a < z else [b[:, a:], b[:, :z]]

    def commit(self) -> None:
        """Ring: write the block's newest rows into the ring (its size's worth); older ones are gone."""
        if self.pending is None:
            return
        self._reserve(self.end)
        values, self.pending = self.pending, None
        t = next(iter(values.values())).shape[1]
        n = min(t, self.ring)
        a = (self.end - n) % self.ring
        head = min(n, self.ring - a)
        for name, v in values.items():
            rows = v[:, t - n:]
            self.buf[name][:, a:a + head] = rows[:, :head]
            self.buf[name][:, :n - head] = rows[:, head:]  # the wrapped part (empty when it fits)
        self.base = max(0, self.end - self.keep)
        self.floor = max(self.floor, self.end - self.ring)

    def _write(self, lo: int, values: dict[str, torch.Tensor]) -> None:
        t = next(iter(values.values())).shape[1]
        if self.keep is None:
            for name, v in values.items():
                self.buf[name][:, lo:lo + t] = v
            return
        a = lo % self.ring
        head = min(t, self.ring - a)
        for name, v in values.items():
            self.buf[name][:, a:a + head] = v[:, :head]
            self.buf[name][:, :t - head] = v[:, head:]

    def restore(self, base: int, end: int, pieces: list[tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Refill from saved rows: `pieces` are (first position, fields) covering [base, end)."""
        self.pending, self.offset, self.prefix, self._prefix_arrays = None, 0, None, None
        cap = max(self.min_capacity, end) if self.keep is None else min(self.ring, max(self.min_capacity, end))
        self.buf = {name: torch.zeros((self.n_kv, cap, *shape), dtype=dtype, device=self.device)
                    for name, (shape, dtype) in self.fields.items()}
        for lo, values in pieces:
            self._write(lo, {k: v.to(self.device) for k, v in values.items()})
        self.base, self.end, self.floor = base, end, base

    def trim(self, end: int) -> None:
        """Forget positions from `end` on (the caller checked the rows it still needs are here); a
        ring retains its newest `keep` again, from its slack."""
        assert self.pending is None and self.oldest() <= end <= self.end and end >= self.offset
        self.end = end
        if self.keep is not None:  # back to `keep` rows as far as the slack still holds them
            self.base = max(0, self.floor, end - self.keep)

    def oldest(self) -> int:
        """The oldest position still stored: `base`, or in a ring as far back as no newer row has
        taken its slot (its slack, before `base`)."""
        return self.base if self.keep is None else self.floor

    def share(self, rows: "Rows", upto: int) -> None:
        """Become a branch of `rows` (growing, at its end): positions below `upto` are read from its
        buffers, shared; those from there to its end are copied into this one's own."""
        assert self.keep is None and rows.keep is None and rows.pending is None and upto <= rows.end
        self.prefix = dict(rows.buf) if rows.offset == 0 else \
            {name: f.contiguous() for name, f in rows.read(0, upto).items()}  # a branch of a branch: joined once
        self._prefix_arrays = None
        self.offset, self.base, self.end = upto, 0, upto
        tail = rows.read(upto, rows.end)
        self._reserve(rows.end - upto, exact=True)
        self.append(tail)  # to rows.end

    def nbytes(self) -> int:
        """Bytes of the allocations held: a token's metrics ask for them every step."""
        if self._buf_bytes is None:  # its own slice of a family's stack, not the stack
            self._buf_bytes = sum(b.nbytes for b in self.buf.values())
        live = self._buf_bytes
        if self.pending:
            live += sum(v.untyped_storage().nbytes() for v in self.pending.values())
        return live
