"""A family's row sets as one stack: branches of one prompt at one position keep their own rows
in slices of one buffer per field, so a decode kernel reads and writes every branch in one call."""

from __future__ import annotations

import numpy as np
import torch

from larqlpy.engines.stores.rows import Rows


class Stack:
    """Row sets' buffers as one tensor per field, (B * Hkv, capacity, ...) (`stack_sets`), and as
    numpy arrays (B, Hkv, capacity, ...) for the kernels, made once."""

    def __init__(self, fields: dict[str, torch.Tensor], sets: list[Rows]):
        self.fields, self.sets, self.n_kv = fields, sets, sets[0].n_kv
        self.live = True  # every set still holds its buffers here (a set that replaces them says so)
        self._arrays: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None

    def _views(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        if self._arrays is None:
            flat = {name: f.numpy() for name, f in self.fields.items()}
            self._arrays = flat, {name: a.reshape(-1, self.n_kv, *a.shape[1:]) for name, a in flat.items()}
        return self._arrays

    def arrays(self) -> dict[str, np.ndarray]:
        """Each field as (B * Hkv, capacity, ...), views."""
        return self._views()[0]

    def branches(self) -> dict[str, np.ndarray]:
        """Each field as (B, Hkv, capacity, ...), views."""
        return self._views()[1]


def stack_sets(sets: list[Rows]) -> Stack:
    """Row sets of one layout at one position (branches' own rows growing from one offset, or their
    rings of one size) as one buffer per field, (B * Hkv, capacity, ...), set b's rows at
    [b * Hkv, (b + 1) * Hkv): a kernel reads and writes all branches' rows in one call. The first
    time, each set's buffers become views of the stack (at the largest capacity of the sets, which
    never moves a ring's slots); it is found again while no set has replaced its buffers."""
    first, n_kv = sets[0], sets[0].n_kv
    held = first.stack
    if held is not None and held.live and held.sets == sets:  # the same sets, in order
        return held
    assert all(r.end == first.end and r.ring == first.ring and r.offset == first.offset and r.pending is None
               for r in sets), "stacked sets share one layout"
    cap = max(r.capacity for r in sets)
    fields = {}
    for name, old in first.buf.items():
        fields[name] = torch.zeros((len(sets) * n_kv, cap, *old.shape[2:]), dtype=old.dtype, device=old.device)
        for b, r in enumerate(sets):
            fields[name][b * n_kv:(b + 1) * n_kv, :r.capacity] = r.buf[name]
    stack = Stack(fields, list(sets))
    for b, r in enumerate(sets):
        r.buf = {name: f[b * n_kv:(b + 1) * n_kv] for name, f in fields.items()}
        r.stack = stack
    return stack
