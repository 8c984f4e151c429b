"""codec/v1 and friends: window/v1's retention, rows kept as codes (approximate).

- `codec/v1` (`--engine turbo-quant:bits=N`): TurboQuant, `bits` 3 or 4 for both K and V; mixed
  precision: `k_bits` / `v_bits` (2, 3, 4, 5, 6, 8) give keys and values their own widths, `sink=N`
  keeps the first N positions' K and V exact in f32, `layer_bits=5:8/4,11:exact` sets widths (or f32
  rows) per layer.
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
from larqlpy.kernels.rowcodec import ExactCodec, Int4GroupCodec, RowCodec, TurboQuantCodec
from larqlpy.kernels.turboquant import WIDTHS


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
    """K and V rows as codes (each tensor its own codec), plus optional exact f32 copies: the newest
    `exact_recent` K rows, and the K and V rows of the first `sink` positions (attention sinks)."""

    def __init__(self, geometry: LayerGeometry, device: torch.device, codec: RowCodec, keep: int | None,
                 scratch: Scratch, exact_recent: int = 0, v_codec: RowCodec | None = None, sink: int = 0):
        super().__init__(geometry, device)
        self.k_codec, self.v_codec, self.scratch = codec, v_codec or codec, scratch
        self.codecs = {"k": self.k_codec, "v": self.v_codec}
        fields = {f"{t}_{name}": spec for t, c in self.codecs.items() for name, spec in c.fields.items()}
        self.rows = Rows(geometry.n_kv_heads, fields, device, keep)
        d = geometry.head_dim
        self.recent = (Rows(geometry.n_kv_heads, {"k": ((d,), torch.float32)}, device, exact_recent)
                       if exact_recent else None)
        self.sink = sink
        self.sinks = (Rows(geometry.n_kv_heads, {t: ((d,), torch.float32) for t in ("k", "v")}, device)
                      if sink else None)
        self.fused = self.k_codec.fused and self.v_codec.fused
        self.last = False  # the last layer frees the shared scratch when a block is done

    @property
    def codec(self) -> RowCodec:
        return self.k_codec

    def _encode(self, x: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
        hkv, t, _ = x.shape
        enc = self.codecs[prefix].encode(x.reshape(hkv * t, -1))
        return {f"{prefix}_{name}": val.view(hkv, t, *val.shape[1:]) for name, val in enc.items()}

    def append(self, k, v):
        q_start = self.end
        self.rows.append({**self._encode(k, "k"), **self._encode(v, "v")})
        if self.recent is not None:
            self.recent.append({"k": k.float()})
        if self.sinks is not None and q_start < self.sink:
            n = min(self.sink - q_start, k.shape[1])
            self.sinks.append({"k": k[:, :n].float(), "v": v[:, :n].float()})
        self.end = self.rows.end

    def _fields(self, r: dict[str, torch.Tensor], prefix: str, head: int, hi: int | None = None):
        return {name: r[f"{prefix}_{name}"][head, :hi] for name in self.codecs[prefix].fields}

    def _exact_from(self, start: int) -> int:
        """First position whose K row is exact (end when none is)."""
        return self.end if self.recent is None else max(start, self.recent.base)

    def _sink_end(self, start: int) -> int:
        """Sink rows a read from `start` sees: positions [start, returned)."""
        return start if self.sinks is None else max(start, min(self.sinks.end, self.end))

    def read(self, start, dtype):
        hkv, d, n = self.geometry.n_kv_heads, self.geometry.head_dim, self.end - start
        r = self.rows.read(start, self.end)
        buf = self.scratch.get(2, hkv, n, d)
        for i, (prefix, codec) in enumerate(self.codecs.items()):
            flat = {name: r[f"{prefix}_{name}"].reshape(hkv * n, *r[f"{prefix}_{name}"].shape[2:]).contiguous()
                    for name in codec.fields}
            out = codec.decode(flat, out=buf[i].view(hkv * n, d))
            if out.data_ptr() != buf[i].data_ptr():
                buf[i].view(hkv * n, d).copy_(out)
        lo = self._exact_from(start)
        if lo < self.end:
            buf[0][:, lo - start:] = self.recent.read(lo, self.end)["k"]
        hi = self._sink_end(start)
        if hi > start:
            s = self.sinks.read(start, hi)
            buf[0][:, :hi - start], buf[1][:, :hi - start] = s["k"], s["v"]
        return buf[0].to(dtype), buf[1].to(dtype)

    def attend(self, q, k, v, p):
        if q.shape[1] != 1 or not self.fused:
            return super().attend(q, k, v, p)
        q_start = self.end
        self.append(k, v)
        start = self.geometry.read_start(q_start)
        r = self.rows.read(start, self.end)
        lo = self._exact_from(start)
        exact = self.recent.read(lo, self.end)["k"] if lo < self.end else None
        ns = self._sink_end(start) - start
        sinks = self.sinks.read(start, start + ns) if ns else None
        hkv = self.geometry.n_kv_heads
        group = q.shape[0] // hkv
        out = torch.empty(q.shape[0], 1, q.shape[2], dtype=torch.float32)
        for h in range(hkv):
            qh = q[h * group:(h + 1) * group, 0].float()
            s = self.k_codec.scores(self.k_codec.rotate(qh), self._fields(r, "k", h, lo - start))
            if exact is not None:
                s = torch.cat((s, qh @ exact[h].T), dim=1)
            if sinks is not None:
                s[:, :ns] = qh @ sinks["k"][h].T
            probs = torch.softmax(s * p.scale, dim=-1)
            if sinks is not None:
                head = probs[:, :ns].clone()
                probs[:, :ns] = 0.0
            o = self.v_codec.weighted_sum(probs, self._fields(r, "v", h))
            out[h * group:(h + 1) * group, 0] = o if sinks is None else o + head @ sinks["v"][h]
        self.release()
        return out.to(q.dtype)

    def release(self):
        self.rows.commit()
        if self.recent is not None:
            self.recent.commit()
        if self.last:
            self.scratch.release()

    def row_sets(self):
        label = self.k_codec.label if self.k_codec.label == self.v_codec.label \
            else f"{self.k_codec.label}/{self.v_codec.label}"
        sets = {"main": (self.rows, "QUANTIZED", label)}
        if self.recent is not None:
            sets["recent"] = (self.recent, "ACTIVE", "f32")
        if self.sinks is not None:
            sets["sink"] = (self.sinks, "ACTIVE", "f32")
        return sets

    def set_end(self, name, end):
        return min(end, self.sink) if name == "sink" else end

    def can_trim(self, end):
        # the exact recent K rows below the old end are gone: only the newest position can be redone
        if self.recent is not None and self.recent.base > max(0, end - self.recent.keep):
            return False
        return super().can_trim(end)

    def retained(self):
        return self.rows.base, self.rows.end

    def resident_bytes(self):
        return sum(rows.nbytes() for rows, _, _ in self.row_sets().values())


BITS = OptionSpec("bits", int_in(3, 4, choices=(3, 4)), help="bits per coordinate of K and V: 3 or 4")
WIDTH_HELP = "bits per coordinate: " + ", ".join(map(str, WIDTHS))
K_BITS = OptionSpec("k_bits", int_in(2, 8, choices=WIDTHS), help="key width (overrides bits); " + WIDTH_HELP)
V_BITS = OptionSpec("v_bits", int_in(2, 8, choices=WIDTHS), help="value width (overrides bits); " + WIDTH_HELP)
SINK = OptionSpec("sink", int_in(1, 4096), help="the first N positions' K and V rows kept exact (attention sinks)")


def parse_layer_bits(text: str) -> tuple[tuple[int, tuple[int, int] | None], ...]:
    """`5:8/4,11:exact` -> ((5, (8, 4)), (11, None)): per-layer K/V widths, or f32 rows."""
    out: dict[int, tuple[int, int] | None] = {}
    for item in text.split(","):
        layer, sep, width = item.strip().partition(":")
        try:
            index = int(layer, 10)
        except ValueError:
            index = -1
        if not sep or index < 0:
            raise ValueError(f"expected LAYER:K/V or LAYER:exact items, got {item.strip()!r}")
        if index in out:
            raise ValueError(f"layer {index} given twice")
        if width.strip() == "exact":
            out[index] = None
            continue
        kb, slash, vb = width.partition("/")
        pair = []
        for w in (kb, vb):
            try:
                pair.append(int(w, 10))
            except ValueError:
                pair.append(-1)
        if not slash or any(w not in WIDTHS for w in pair):
            raise ValueError(f"layer {index}: expected K/V widths from {', '.join(map(str, WIDTHS))} or 'exact', "
                             f"got {width!r}")
        out[index] = (pair[0], pair[1])
    return tuple(sorted(out.items()))


def canonical_layer_bits(text: str) -> str:
    """The option's value as stored (and saved with states): sorted `LAYER:K/V` / `LAYER:exact` items."""
    return ",".join(f"{i}:exact" if w is None else f"{i}:{w[0]}/{w[1]}" for i, w in parse_layer_bits(text))


LAYER_BITS = OptionSpec("layer_bits", canonical_layer_bits,
                        help="per-layer widths, e.g. 5:8/4,11:exact (LAYER:K_BITS/V_BITS or LAYER:exact)")

# The recommended approximate configuration (bench/kv_mixed.py, docs/codec.md): what the CLI
# suggests when codec options are missing or not understood.
RECOMMENDED = ("codec/v1", (("k_bits", 5), ("sink", 4), ("v_bits", 3)))


def recommended_flags(rec=RECOMMENDED) -> str:
    return f"--continuation {rec[0]} " + " ".join(f"--continuation-option {k}={v}" for k, v in rec[1])


class Codec(Provider):
    identity = "codec/v1"
    summary = "TurboQuant 2-8-bit K/V rows (separate key/value widths, exact sinks) over window/v1's retention"
    exact = False

    @classmethod
    def option_specs(cls):
        return (BITS, K_BITS, V_BITS, SINK, LAYER_BITS)

    @classmethod
    def hint(cls) -> str:
        return f"recommended: {recommended_flags()}"

    @classmethod
    def check_options(cls, options, where):
        missing = [t for t in ("k_bits", "v_bits") if t not in options and "bits" not in options]
        if missing:
            raise LarqlError(f"{where}: {cls.identity} requires option bits (or k_bits and v_bits); "
                             f"{cls.hint()}")

    @classmethod
    def residency_variants(cls):
        return ((("bits", 4),), (("bits", 3),), RECOMMENDED[1])

    def widths(self, layer: int) -> tuple[int, int] | None:
        """(K bits, V bits) on `layer`, or None where the layer keeps f32 rows."""
        per = dict(parse_layer_bits(self.options["layer_bits"])) if "layer_bits" in self.options else {}
        if layer in per:
            return per[layer]
        bits = self.options.get("bits")
        return int(self.options.get("k_bits", bits)), int(self.options.get("v_bits", bits))

    def make_codec(self, geometry: LayerGeometry, device: torch.device, tensor: str = "k") -> RowCodec:
        w = self.widths(geometry.index)
        if w is None:
            return ExactCodec(geometry.head_dim, device)
        return TurboQuantCodec(geometry.head_dim, w[0] if tensor == "k" else w[1], device)

    def exact_recent(self) -> int:
        return 0

    def sink(self) -> int:
        return int(self.options.get("sink", 0))

    def check_geometry(self, geometries):
        # kv_dim is always whole heads here (the geometry is heads x head_dim), so only the head's
        # own shape can be refused: the codec's constructor says what it needs.
        n = len(geometries)
        bad = [i for i, _ in parse_layer_bits(self.options.get("layer_bits", "")) if i >= n] \
            if "layer_bits" in self.options else []
        if bad:
            raise LarqlError(f"{self.identity}: layer_bits names layer {bad[0]}, the model has {n} layers")
        for g in geometries:
            try:
                self.make_codec(g, torch.device("meta"))
            except ValueError as e:
                raise LarqlError(f"{self.identity}: layer {g.index}: {e}") from None

    def new_state(self, geometries, device):
        self.check_geometry(geometries)
        scratch = Scratch(device)
        stores = [CodecStore(g, device, self.make_codec(g, device, "k"), g.window, scratch, self.exact_recent(),
                             v_codec=self.make_codec(g, device, "v"), sink=self.sink())
                  for g in geometries]
        stores[-1].last = True
        return EngineState(self.identity, self.options, stores, extras=[scratch])

    def retained_rows(self, geometry, positions):
        return positions if geometry.window is None else min(positions, geometry.window)

    def row_bytes(self, geometry):
        meta = torch.device("meta")
        return geometry.n_kv_heads * sum(self.make_codec(geometry, meta, t).row_bytes for t in ("k", "v"))

    def layer_bytes(self, geometry, positions):
        f32 = geometry.n_kv_heads * geometry.head_dim * 4  # one exact row of one tensor
        exact = min(positions, self.exact_recent()) * f32 + min(positions, self.sink()) * 2 * f32
        return self.retained_rows(geometry, positions) * self.row_bytes(geometry) + exact


class CodecRecent(Codec):
    identity = "codec-recent/v1"
    summary = "codec/v1 plus the newest exact_recent_k K rows kept exact in f32"

    @classmethod
    def option_specs(cls):
        return (*Codec.option_specs(),
                OptionSpec("exact_recent_k", int_in(1), required=True, help="newest K rows kept exact"))

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
    def check_options(cls, options, where):
        pass

    @classmethod
    def residency_variants(cls):
        return ((),)

    def widths(self, layer):
        return (4, 4)

    def make_codec(self, geometry, device, tensor="k"):
        return Int4GroupCodec(geometry.head_dim, int(self.options.get("group", 32)), device)
