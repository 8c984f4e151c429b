"""The codec engines' layer store: window/v1's retention, rows kept as codes (see engines/codec.py).

Reading: prefill blocks decode the rows they may see into one scratch buffer shared by all layers
(bounded by one layer) and run the usual attention. Decode steps on the CPU attend on the codes
directly, in one kernel call per layer (kernels/kvcodec/tq_attend.py): every KV head, the main codes, the
recent tier, exact keys and sinks, the calibration's bias, the softmax and the sum of values.
"""

from __future__ import annotations

import numpy as np
import torch

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.calibration import NO_CALIBRATION, require_calibration
from larqlpy.engines.stores.kvcodec import KVCodec
from larqlpy.engines.stores.kvdtype import torch_dtype
from larqlpy.engines.stores.rows import Rows
from larqlpy.engines.stores.rowstore import RowSet, RowStore
from larqlpy.engines.stores.stack import Stack, stack_sets
from larqlpy.engines.stores.state import EngineState, Scratch
from larqlpy.kernels.kvcodec import tq_attend, tq_step
from larqlpy.kernels.kvcodec.rowcodec import TurboQuantCodec, row_codec


class CodecStore(RowStore):
    """K and V rows as codes (`codec`) over the newest `keep` positions (None: all of them), plus
    optional copies of some rows: the newest `recent` rows' K and V again at a wider width
    (`recent_codec`), the newest `exact_keys` K rows exact, and the K and V rows of the first
    `sink` positions exact (attention sinks), exact rows in the layer's kv_dtype. Decode steps
    attend on the codes where the codecs allow it; `fused=False` decodes them into the scratch
    instead, as prefill blocks do."""

    def __init__(self, geometry: LayerGeometry, device: torch.device, *, codec: KVCodec, keep: int | None,
                 scratch: Scratch, exact_keys: int = 0, sink: int = 0, recent: int = 0,
                 recent_codec: KVCodec | None = None, fused: bool = True):
        super().__init__(geometry, device)
        self.codec, self.scratch = codec, scratch
        hkv, d = geometry.n_kv_heads, geometry.head_dim
        self.exact_dtype = torch_dtype(geometry.kv_dtype)
        row = ((d,), self.exact_dtype)
        self.rows = Rows(hkv, codec.fields, device, keep)
        self.exact_keys = Rows(hkv, {"k": row}, device, exact_keys) if exact_keys else None
        self.recent_codec = recent_codec if recent else None
        self.recent = Rows(hkv, recent_codec.fields, device, recent) if recent else None
        self.sink = sink
        self.sinks = Rows(hkv, {"k": row, "v": row}, device, min_capacity=sink) if sink else None
        # codes written and read in place by the CPU kernels (tq_step, tq_attend); `fused` reads them so
        self.in_place = codec.fused and (recent_codec is None or recent_codec.fused)
        self.fused = fused and self.in_place
        self._sink_arrays_at: tuple | None = None  # (K buffer, start, rows, arrays): `_sink_arrays`
        self._no_rows = np.zeros((hkv, 0, d), np.float32)  # no exact rows, as the kernels take them
        self._sets = self._row_sets()  # a token's metrics read them every step

    def meta(self):
        cal = self.codec.calibration
        return {} if cal is None else {"key_calibration": cal.digest}

    def append(self, k, v):
        if k.shape[1] == 1:
            return self._append_step(k, v)
        q_start = self.end
        self.rows.append(self.codec.encode(k, v, q_start))
        if self.recent is not None:
            self.recent.append(self.recent_codec.encode(k, v, q_start))
        self._append_exact(k, v, q_start)
        self.end = self.rows.end

    def _append_exact(self, k, v, first: int):
        """The exact copies beside the codes: recent K rows, and the rows of sink positions."""
        if self.exact_keys is not None:
            self.exact_keys.append({"k": k.to(self.exact_dtype)})
        if self.sinks is not None and first < self.sink:
            n = min(self.sink - first, k.shape[1])
            self.sinks.append({"k": k[:, :n].to(self.exact_dtype), "v": v[:, :n].to(self.exact_dtype)})
            self._sink_arrays_at = None

    def _code_sets(self) -> list[tuple[KVCodec, Rows]]:
        return [(c, r) for c, r in ((self.codec, self.rows), (self.recent_codec, self.recent)) if r is not None]

    def _append_step(self, k, v):
        """A decode step's row: its codes written straight into a claimed row of each code set (a
        ring's oldest row makes way at once, so the tier holds the newest `recent` rows, this one
        among them), the keys calibrated once for both (the tier's calibration is the layer's)."""
        first, sets = self.end, self._code_sets()
        slots = [rows.claim_row() for _, rows in sets]  # first: claiming may grow (replace) the buffers
        if self.in_place:
            self._encode_step(k, v, first, [(c, r.arrays()) for c, r in sets], slots)
        else:
            keys = self.codec.calibrate(k, first)
            for (codec, rows), slot in zip(sets, slots):
                codec.encode_into(keys, v, rows.buf, slot)
        self._append_exact(k, v, first)
        self.end = self.rows.end

    def _encode_step(self, k, v, first: int, sets: list[tuple[KVCodec, dict]], slots: list[int]) -> None:
        """Rows k, v (Hkv, B, D) of position `first` (a step's, or a family's B branches') into row
        slots[i] of each code set's numpy buffers (branch after branch), calibrated, in one kernel call."""
        cal = self.codec.calibration
        tq_step.append_step(k.float().contiguous().numpy(), v.float().contiguous().numpy(),
                            NO_CALIBRATION if cal is None else cal.step_args(first), self.codec.k.signs,
                            tuple(codec.code_set(arrays) for codec, arrays in sets), tuple(slots))

    def _exact_from(self, start: int, end: int | None = None) -> int:
        """First position whose K row is exact (end when none is), for a read ending at `end` (by
        default the newest): the newest `exact_keys` rows as they were then."""
        return self._newest(self.exact_keys, start, end)

    def _recent_from(self, start: int, end: int | None = None) -> int:
        """First position whose rows are read from the wider recent tier (end when there is none),
        as `_exact_from`."""
        return self._newest(self.recent, start, end)

    def _newest(self, rows: Rows | None, start: int, end: int | None) -> int:
        """First position of a ring of the newest rows read from `start` to `end`: where it began
        when the layer ended there (a later layer's verification steps read a ring that has moved on;
        its slack still holds them)."""
        end = self.end if end is None else end
        if rows is None:
            return end
        return max(start, rows.base if end == self.end else end - rows.keep)

    def _sink_end(self, start: int) -> int:
        """Sink rows a read from `start` sees: positions [start, returned)."""
        return start if self.sinks is None else max(start, min(self.sinks.end, self.end))

    def read(self, start, dtype):
        hkv, d, n = self.geometry.n_kv_heads, self.geometry.head_dim, self.end - start
        buf = self.scratch.get(2, hkv, n, d)
        mid = self._recent_from(start)
        for codec, rows, lo, hi in ((self.codec, self.rows, start, mid),
                                    (self.recent_codec, self.recent, mid, self.end)):
            for r in rows.pieces(lo, hi) if lo < hi else ():
                n = next(iter(r.values())).shape[1]
                for i, t in enumerate("kv"):
                    codec.decode(r, t, buf[i][:, lo - start:lo + n - start], lo)
                lo += n
        lo = self._exact_from(start)
        if lo < self.end:
            buf[0][:, lo - start:] = self.exact_keys.read(lo, self.end)["k"]
        hi = self._sink_end(start)
        if hi > start:
            s = self.sinks.read(start, hi)
            buf[0][:, :hi - start], buf[1][:, :hi - start] = s["k"], s["v"]
        return buf[0].to(dtype), buf[1].to(dtype)

    def decode_rows(self, k, v):
        return None  # scores are computed on the codes (attend)

    def attend(self, q, k, v, p):
        if q.shape[1] != 1 or not self.fused:
            return super().attend(q, k, v, p)
        self.append(k, v)
        out = self._attend_step(q, p)
        self.done()
        return out

    def attend_read(self, q, q_start, p):
        """A later layer's decode step attends on the codes too (a verification's, at its own position)."""
        if q.shape[1] == 1 and self.fused:
            return self._attend_step(q, p, q_start + 1)
        return super().attend_read(q, q_start, p)

    def _bounds(self, end: int) -> tuple[int, int, int]:
        """A decode step's (first row read, first from the tier, first whose K is from the tier or
        exact), by position, its rows ending at `end`."""
        start = self.geometry.read_start(end - 1)
        mid = self._recent_from(start, end)
        return start, mid, min(mid, self._exact_from(start, end))

    def _attend_step(self, q, p, end: int | None = None):
        """The step's query (H, 1, D) attending on the codes, its row (position end - 1; by default
        the newest) already appended."""
        end = self.end if end is None else end
        start, mid, lo = self._bounds(end)
        hkv, (n_heads, _, d), n = self.geometry.n_kv_heads, q.shape, end - start
        main = self.codec.sides(self.rows.spans(start, mid, arrays=True))
        tier = self.recent_codec.sides(self.recent.spans(mid, end, arrays=True)) if mid < end \
            else _no_tier(main)
        out = np.empty((hkv, n_heads // hkv, d), np.float32)
        tq_attend.attend(q[:, 0].float().contiguous().view(out.shape).numpy(), self._calibration(start, n),
                         self.codec.k.signs, main, tier, (self._exact_keys(lo, end), *self._sink_arrays(start)),
                         (lo - start, mid - start, n), np.float32(p.scale), np.float32(p.softcap or 0.0), p.sink_logits,
                         out)
        return torch.from_numpy(out).view(n_heads, 1, d).to(q.dtype)

    def _tier_args(self, tier: dict | None, mid: int, b: int) -> tuple:
        """The family's recent tiers for the kernel: their stack (B, Hkv, ring, ...) with its codebooks,
        the slot of position `mid` and the rows from it before the ring wraps; no rows without a tier."""
        hkv = self.geometry.n_kv_heads
        if tier is None:  # the main codes' books stand in, of the types the kernel takes
            c = self.codec
            return (*_no_rows(b, hkv, self.rows.buf["k_code"].shape[2]), c.k.centroids, c.k.bits, c.v.centroids,
                    c.v.bits, 0, 0)
        c, first = self.recent_codec, self.recent.slot(mid)
        return (*_as_branches(tier), c.k.centroids, c.k.bits, c.v.centroids, c.v.bits, first,
                min(self.end - mid, self.recent.ring - first))

    def _calibration(self, start: int, n: int) -> tuple:
        cal = self.codec.calibration
        return NO_CALIBRATION if cal is None else cal.kernel_args(start, n)

    def family(self):
        """A branch reading its prompt's codes in place, at its position: its siblings at the same
        position read the same codes, so their steps are attended in one call (a ring, exact keys
        and the unfused path attend alone)."""
        if not self.rows.offset or self.rows.keep is not None or not self.fused or self.exact_keys is not None:
            return None
        return ("codes", id(self.rows.prefix["k_code"]), self.rows.offset, self.end,
                None if self.recent is None else self.recent.ring)

    def attend_family(self, stores, q, k, v, p):
        """Branches' decode steps (`family`) in one kernel call: the prompt's codes decoded once for
        all of them, each branch's own rows and tier read in place from the family's stacks, each
        output the bits its own `attend` gives (tq_attend.attend_family)."""
        if len(stores) == 1:
            return self.attend(q, k, v, p)
        own, tier = self._append_family(stores, k, v)
        _, mid, lo = self._bounds(self.end)  # a growing layer: rows from position 0
        (n_heads, b, d), hkv, n = q.shape, self.geometry.n_kv_heads, self.end
        shared = self.codec.sides(self.rows.spans(0, mid, arrays=True))  # the prompt's piece first: in every branch
        out = np.empty((b, hkv, n_heads // hkv, d), np.float32)
        tq_attend.attend_family(q.transpose(0, 1).float().contiguous().view(out.shape).numpy(),
                                self._calibration(0, n), self.codec.k.signs,
                                (*shared[0], *shared[4], shared[2], shared[3], shared[6], shared[7]),
                                _as_branches(own), self._tier_args(tier, mid, b), self._sink_arrays(0),
                                (lo, mid, n), np.float32(p.scale), np.float32(p.softcap or 0.0), p.sink_logits, out)
        for s in stores:
            s.done()
        return torch.from_numpy(out).view(b, n_heads, d).transpose(0, 1).to(q.dtype)

    def _append_family(self, stores, k, v) -> tuple[Stack, Stack | None]:
        """The branches' step rows k, v (Hkv, B, D), as `_append_step` appends each: every set's row
        claimed, then written, calibrated, in one kernel call into the family's stacks
        (stack.stack_sets). Returns the stacks of the main codes and of the tier."""
        first, sets = self.end, self._code_sets()
        groups = [[s.rows for s in stores]] + ([[s.recent for s in stores]] if self.recent is not None else [])
        slots = [{r.claim_row() for r in group} for group in groups]  # first: claiming may grow the buffers
        assert all(len(slot) == 1 for slot in slots), "a family's rows take one slot"
        stacks = [stack_sets(group) for group in groups]
        self._encode_step(k, v, first, [(codec, stack.arrays()) for (codec, _), stack in zip(sets, stacks)],
                          [slot.pop() for slot in slots])
        for i, s in enumerate(stores):
            if first < self.sink:
                s._append_exact(k[:, i:i + 1], v[:, i:i + 1], first)
            s.end = s.rows.end
        return stacks[0], stacks[1] if len(stacks) > 1 else None

    def _exact_keys(self, lo: int, end: int) -> np.ndarray:
        """The fused kernel's exact K rows, positions [lo, end), float32 (none without them)."""
        if self.exact_keys is None or lo >= end:
            return self._no_rows
        assert self.recent is None, "exact keys and a recent tier are never configured together"
        return self.exact_keys.read(lo, end)["k"].float().contiguous().numpy()

    def _sink_arrays(self, start: int) -> tuple[np.ndarray, np.ndarray]:
        """The sinks' K and V rows a read from `start` sees, float32: made again only when they change."""
        ns, buf = self._sink_end(start) - start, None if self.sinks is None else self.sinks.buf["k"]
        held = self._sink_arrays_at
        if held is None or held[0] is not buf or held[1:3] != (start, ns):
            rows = self.sinks.read(start, start + ns) if ns else {}
            arrays = tuple(rows[t].float().contiguous().numpy() if ns else self._no_rows for t in "kv")
            held = self._sink_arrays_at = (buf, start, ns, arrays)
        return held[3]

    def fork(self, other):
        """Growing codes are shared whole: attention reads the prompt's codes and the branch's own as
        one run of rows (`Rows.spans`), so a branch's numbers are those of a sequence that never
        forked. A ring (a sliding layer's window), the recent tier, exact keys and sinks are copied."""
        if self.rows.keep is not None:
            return super().fork(other)
        self.rows.share(other.rows, other.rows.end)
        rest = [name for name in self.row_sets() if name != "main"]
        self.restore(other.end, other.export(rest), rest)

    def release(self):
        for rows in (self.rows, self.exact_keys, self.recent):
            if rows is not None:
                rows.commit()

    def row_sets(self):
        return self._sets

    def _row_sets(self) -> dict[str, RowSet]:
        sets = {"main": RowSet(self.rows, "QUANTIZED", self.codec.label)}
        if self.exact_keys is not None:
            sets["exact_keys"] = RowSet(self.exact_keys, "ACTIVE", self.geometry.kv_dtype)
        if self.recent is not None:
            sets["recent"] = RowSet(self.recent, "QUANTIZED", self.recent_codec.label)
        if self.sinks is not None:
            sets["sink"] = RowSet(self.sinks, "ACTIVE", self.geometry.kv_dtype, first_positions=self.sink)
        return sets


_CODE_FIELDS = ("k_norm", "k_code", "v_norm", "v_code")


def _as_branches(stack: Stack) -> tuple:
    """A family's stack (stack.stack_sets) as the kernel reads it: (K norms (B, Hkv, cap), K codes
    (B, Hkv, cap, bytes), V norms, V codes), in place."""
    branches = stack.branches()
    return tuple(branches[n] for n in _CODE_FIELDS)


def _no_rows(b: int, hkv: int, nbytes: int) -> tuple:
    """`_as_branches`'s arrays for b branches of no rows."""
    return tuple(np.zeros((b, hkv, 0, nbytes), np.uint8) if "code" in n else np.zeros((b, hkv, 0), np.float32)
                 for n in _CODE_FIELDS)


def _no_tier(main: tuple) -> tuple:
    """A tier of no rows, typed as the kernel takes one: `main`'s sides with 0-row pieces."""
    def empty(piece):
        return (*piece[:2], 0, 0)
    return empty(main[0]), empty(main[1]), *main[2:4], empty(main[4]), empty(main[5]), *main[6:]


def layer_codec(provider, g: LayerGeometry, device: torch.device) -> KVCodec:
    """The K/V codec pair `provider` (engines/codec.py) stores layer `g`'s rows with."""
    cal = g.key_calibration.to(device) if provider.calibrated(g) else None
    return KVCodec(*(row_codec(provider.row_format(g, t), g.head_dim, device) for t in "kv"), cal)


def new_codec_state(provider, geometries, device: torch.device) -> EngineState:
    if provider.options.get("calib") == "on":  # accounting (residency) needs no calibration; rows do
        require_calibration(geometries, f"{provider.identity} calib=on")
    scratch = Scratch(device)
    stores = []
    for g in geometries:
        recent = provider.recent(g)
        cal = g.key_calibration.to(device) if provider.calibrated(g) else None
        wide = KVCodec(*(TurboQuantCodec(g.head_dim, provider.recent_bits(), device) for _ in "kv"), cal) \
            if recent else None
        stores.append(CodecStore(g, device, codec=layer_codec(provider, g, device), keep=g.window, scratch=scratch,
                                 exact_keys=provider.exact_keys(), sink=provider.sink(), recent=recent,
                                 recent_codec=wide))
    return EngineState(provider.identity, provider.resolved(geometries), stores, shared=[scratch])
