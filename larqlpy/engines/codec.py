"""codec/v1 and friends: window/v1's retention, rows kept as codes (approximate).

- `codec/v1` (`--engine turbo-quant:bits=N`): TurboQuant, `bits` 3 or 4, nothing else.
- `codec-recent/v1`: the same codes, plus the newest `exact_recent_k` K rows kept exact in f32.
  Every row is encoded once, when it arrives, from its own values, so the codes are the bytes
  codec/v1 writes; the exact copy of a K row is dropped as it ages out of the newest k.
- `int4-group/v1`: the seed article's symmetric group-wise INT4 (one float16 scale per `group`
  values), for comparison at (nearly) equal bits.

Reading: prefill blocks decode the rows they may see into one scratch buffer shared by all layers
(bounded by one layer) and run the usual attention. Decode steps on CPU attend on the codes
directly: rotate the query once per head, score against centroid values times the stored norms,
accumulate the values in the rotated domain and rotate back once per head.
"""

from __future__ import annotations

import torch

from larqlpy.engines.base import EngineState, LayerGeometry, LayerStore, Provider
from larqlpy.engines.rows import Rows
from larqlpy.engines.spec import OptionSpec, int_in
from larqlpy.errors import LarqlError
from larqlpy.kernels.rowcodec import Int4GroupCodec, RowCodec, TurboQuantCodec


class Scratch:
    """One decode buffer for a whole engine state, reused by every layer (grows to the largest)."""

    def __init__(self, device: torch.device):
        self.buf = torch.empty(0, dtype=torch.float32, device=device)

    def get(self, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        if n > self.buf.numel():
            self.buf = torch.empty(n, dtype=torch.float32, device=self.buf.device)
        return self.buf[:n].view(*shape)

    def nbytes(self) -> int:
        return self.buf.untyped_storage().nbytes()

    def release(self) -> None:
        """Free it between blocks: decode steps attend on codes and need none."""
        self.buf = torch.empty(0, dtype=torch.float32, device=self.buf.device)


class CodecStore(LayerStore):
    def __init__(self, geometry: LayerGeometry, device: torch.device, codec: RowCodec, keep: int | None,
                 scratch: Scratch, exact_recent: int = 0):
        super().__init__(geometry, device)
        self.codec, self.scratch = codec, scratch
        fields = {f"{t}_{name}": spec for t in ("k", "v") for name, spec in codec.fields.items()}
        self.rows = Rows(geometry.n_kv_heads, fields, device, keep)
        self.recent = (Rows(geometry.n_kv_heads, {"k": ((geometry.head_dim,), torch.float32)}, device, exact_recent)
                       if exact_recent else None)
        self.last = False  # the last layer frees the shared scratch when a block is done

    def _encode(self, x: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
        hkv, t, _ = x.shape
        enc = self.codec.encode(x.reshape(hkv * t, -1))
        return {f"{prefix}_{name}": val.view(hkv, t, *val.shape[1:]) for name, val in enc.items()}

    def append(self, k, v):
        self.rows.append({**self._encode(k, "k"), **self._encode(v, "v")})
        if self.recent is not None:
            self.recent.append({"k": k.float()})
        self.end = self.rows.end

    def _fields(self, r: dict[str, torch.Tensor], prefix: str, head: int, hi: int | None = None):
        return {name: r[f"{prefix}_{name}"][head, :hi] for name in self.codec.fields}

    def _exact_from(self, start: int) -> int:
        """First position whose K row is exact (end when none is)."""
        return self.end if self.recent is None else max(start, self.recent.base)

    def read(self, start, dtype):
        hkv, d, n = self.geometry.n_kv_heads, self.geometry.head_dim, self.end - start
        r = self.rows.read(start, self.end)
        buf = self.scratch.get(2, hkv, n, d)
        for i, prefix in enumerate(("k", "v")):
            flat = {name: r[f"{prefix}_{name}"].reshape(hkv * n, *r[f"{prefix}_{name}"].shape[2:]).contiguous()
                    for name in self.codec.fields}
            out = self.codec.decode(flat, out=buf[i].view(hkv * n, d))
            if out.data_ptr() != buf[i].data_ptr():
                buf[i].view(hkv * n, d).copy_(out)
        lo = self._exact_from(start)
        if lo < self.end:
            buf[0][:, lo - start:] = self.recent.read(lo, self.end)["k"]
        return buf[0].to(dtype), buf[1].to(dtype)

    def attend(self, q, k, v, p):
        if q.shape[1] != 1 or not self.codec.fused:
            return super().attend(q, k, v, p)
        q_start = self.end
        self.append(k, v)
        start = self.geometry.read_start(q_start)
        r = self.rows.read(start, self.end)
        lo = self._exact_from(start)
        exact = self.recent.read(lo, self.end)["k"] if lo < self.end else None
        hkv = self.geometry.n_kv_heads
        group = q.shape[0] // hkv
        out = torch.empty(q.shape[0], 1, q.shape[2], dtype=torch.float32)
        for h in range(hkv):
            qh = q[h * group:(h + 1) * group, 0].float()
            s = self.codec.scores(self.codec.rotate(qh), self._fields(r, "k", h, lo - start))
            if exact is not None:
                s = torch.cat((s, qh @ exact[h].T), dim=1)
            probs = torch.softmax(s * p.scale, dim=-1)
            out[h * group:(h + 1) * group, 0] = self.codec.weighted_sum(probs, self._fields(r, "v", h))
        self.release()
        return out.to(q.dtype)

    def release(self):
        self.rows.commit()
        if self.recent is not None:
            self.recent.commit()
        if self.last:
            self.scratch.release()

    def row_sets(self):
        sets = {"main": (self.rows, "QUANTIZED", self.codec.label)}
        if self.recent is not None:
            sets["recent"] = (self.recent, "ACTIVE", "f32")
        return sets

    def can_trim(self, end):
        # the exact recent K rows below the old end are gone: only the newest position can be redone
        if self.recent is not None and self.recent.base > max(0, end - self.recent.keep):
            return False
        return super().can_trim(end)

    def retained(self):
        return self.rows.base, self.rows.end

    def resident_bytes(self):
        return self.rows.nbytes() + (self.recent.nbytes() if self.recent is not None else 0)


BITS = OptionSpec("bits", int_in(3, 4, choices=(3, 4)), required=True, help="bits per coordinate: 3 or 4")


class Codec(Provider):
    identity = "codec/v1"
    summary = "TurboQuant 3/4-bit K/V rows over window/v1's retention; approximate"
    exact = False

    @classmethod
    def option_specs(cls):
        return (BITS,)

    @classmethod
    def residency_variants(cls):
        return ((("bits", 4),), (("bits", 3),))

    def make_codec(self, geometry: LayerGeometry, device: torch.device) -> RowCodec:
        return TurboQuantCodec(geometry.head_dim, int(self.options["bits"]), device)

    def exact_recent(self) -> int:
        return 0

    def check_geometry(self, geometries):
        # kv_dim is always whole heads here (the geometry is heads x head_dim), so only the head's
        # own shape can be refused: the codec's constructor says what it needs.
        for g in geometries:
            try:
                self.make_codec(g, torch.device("meta"))
            except ValueError as e:
                raise LarqlError(f"{self.identity}: layer {g.index}: {e}") from None

    def new_state(self, geometries, device):
        self.check_geometry(geometries)
        scratch = Scratch(device)
        stores = [CodecStore(g, device, self.make_codec(g, device), g.window, scratch, self.exact_recent())
                  for g in geometries]
        stores[-1].last = True
        return EngineState(self.identity, self.options, stores, extras=[scratch])

    def retained_rows(self, geometry, positions):
        return positions if geometry.window is None else min(positions, geometry.window)

    def row_bytes(self, geometry):
        return 2 * geometry.n_kv_heads * self.make_codec(geometry, torch.device("meta")).row_bytes

    def layer_bytes(self, geometry, positions):
        exact = min(positions, self.exact_recent()) * geometry.n_kv_heads * geometry.head_dim * 4
        return self.retained_rows(geometry, positions) * self.row_bytes(geometry) + exact


class CodecRecent(Codec):
    identity = "codec-recent/v1"
    summary = "codec/v1 plus the newest exact_recent_k K rows kept exact in f32"

    @classmethod
    def option_specs(cls):
        return (BITS, OptionSpec("exact_recent_k", int_in(1), required=True, help="newest K rows kept exact"))

    @classmethod
    def residency_variants(cls):
        return ((("bits", 4), ("exact_recent_k", 64)),)

    def exact_recent(self) -> int:
        return int(self.options["exact_recent_k"])


class Int4Group(Codec):
    identity = "int4-group/v1"
    summary = "symmetric group-wise INT4 (float16 scale per group), the seed article's scheme"

    @classmethod
    def option_specs(cls):
        return (OptionSpec("group", int_in(2), help="values per scale (default 32)"),)

    @classmethod
    def residency_variants(cls):
        return ((),)

    def make_codec(self, geometry, device):
        return Int4GroupCodec(geometry.head_dim, int(self.options.get("group", 32)), device)
