"""codec/v1 and friends: window/v1's retention, rows kept as codes (approximate).

- `codec/v1` (`--engine turbo-quant:bits=N`): TurboQuant, `bits` 3 or 4 for both K and V; mixed
  precision: `k_bits` / `v_bits` (2, 3, 4, 5, 6, 8) give keys and values their own widths, `sink=N`
  keeps the first N positions' K and V exact in f32, `layer_bits=5:8/4,11:exact` sets widths (or f32
  rows) per layer, `recent=N` keeps the newest N rows' K and V a second time at `recent_bits`
  (default 8) and reads them there, `calib=on` quantizes keys as (k - mean) * scale with the
  model's key calibration (larqlpy.calibration).
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
from larqlpy.calibration import require_calibration
from larqlpy.engines.spec import EngineSpec, OptionSpec, int_in, parse_engine_spec
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
    """K and V rows as codes (each tensor its own codec), plus optional copies of some rows: the
    newest `tier` rows' K and V again at a wider width (`tier_codecs`), the newest `exact_recent` K
    rows in f32, and the K and V rows of the first `sink` positions in f32 (attention sinks).
    With a key calibration (larqlpy.calibration), K codes hold (k - mean) * scale."""

    def __init__(self, geometry: LayerGeometry, device: torch.device, codec: RowCodec, keep: int | None,
                 scratch: Scratch, exact_recent: int = 0, v_codec: RowCodec | None = None, sink: int = 0,
                 tier: int = 0, tier_codecs: tuple[RowCodec, RowCodec] | None = None, calibration=None):
        super().__init__(geometry, device)
        self.k_codec, self.v_codec, self.scratch = codec, v_codec or codec, scratch
        self.codecs = {"k": self.k_codec, "v": self.v_codec}
        self.rows = Rows(geometry.n_kv_heads, self._field_specs(self.codecs), device, keep)
        d = geometry.head_dim
        self.recent = (Rows(geometry.n_kv_heads, {"k": ((d,), torch.float32)}, device, exact_recent)
                       if exact_recent else None)
        self.tier_codecs = dict(zip("kv", tier_codecs)) if tier else None
        self.tier = Rows(geometry.n_kv_heads, self._field_specs(self.tier_codecs), device, tier) if tier else None
        self.sink = sink
        self.sinks = (Rows(geometry.n_kv_heads, {t: ((d,), torch.float32) for t in ("k", "v")}, device,
                           min_capacity=sink) if sink else None)
        self.calibration = None if calibration is None else calibration.to(device)
        self.fused = all(c.fused for c in (self.k_codec, self.v_codec, *(self.tier_codecs or {}).values()))
        self.last = False  # the last layer frees the shared scratch when a block is done

    @staticmethod
    def _field_specs(codecs: dict[str, RowCodec]) -> dict:
        return {f"{t}_{name}": spec for t, c in codecs.items() for name, spec in c.fields.items()}

    @property
    def codec(self) -> RowCodec:
        return self.k_codec

    def meta(self):
        return {} if self.calibration is None else {"key_calibration": self.calibration.digest}

    def _encode(self, x: torch.Tensor, prefix: str, codecs: dict[str, RowCodec]) -> dict[str, torch.Tensor]:
        hkv, t, _ = x.shape
        if prefix == "k" and self.calibration is not None:
            x = self.calibration.apply(x)
        enc = codecs[prefix].encode(x.reshape(hkv * t, -1))
        return {f"{prefix}_{name}": val.view(hkv, t, *val.shape[1:]) for name, val in enc.items()}

    def _decode(self, r: dict[str, torch.Tensor], prefix: str, codec: RowCodec, out: torch.Tensor) -> None:
        """Rows' `prefix` fields -> out (Hkv, N, D) f32, calibration undone."""
        hkv, n, d = out.shape
        flat = {name: r[f"{prefix}_{name}"].reshape(hkv * n, *r[f"{prefix}_{name}"].shape[2:]).contiguous()
                for name in codec.fields}
        direct = out.is_contiguous()  # a slice of the scratch spans heads: decode beside it, then copy
        got = codec.decode(flat, out=out.view(hkv * n, d) if direct else None)
        if not direct or got.data_ptr() != out.data_ptr():
            out.copy_(got.view(hkv, n, d))
        if prefix == "k" and self.calibration is not None:
            self.calibration.undo(out, out=out)

    def append(self, k, v):
        q_start = self.end
        self.rows.append({**self._encode(k, "k", self.codecs), **self._encode(v, "v", self.codecs)})
        if self.tier is not None:
            self.tier.append({**self._encode(k, "k", self.tier_codecs), **self._encode(v, "v", self.tier_codecs)})
        if self.recent is not None:
            self.recent.append({"k": k.float()})
        if self.sinks is not None and q_start < self.sink:
            n = min(self.sink - q_start, k.shape[1])
            self.sinks.append({"k": k[:, :n].float(), "v": v[:, :n].float()})
        self.end = self.rows.end

    @staticmethod
    def _fields(r: dict[str, torch.Tensor], prefix: str, codec: RowCodec, head: int, hi: int | None = None):
        return {name: r[f"{prefix}_{name}"][head, :hi] for name in codec.fields}

    def _exact_from(self, start: int) -> int:
        """First position whose K row is exact (end when none is)."""
        return self.end if self.recent is None else max(start, self.recent.base)

    def _tier_from(self, start: int) -> int:
        """First position whose rows are read from the wider tier (end when there is none)."""
        return self.end if self.tier is None else max(start, self.tier.base)

    def _sink_end(self, start: int) -> int:
        """Sink rows a read from `start` sees: positions [start, returned)."""
        return start if self.sinks is None else max(start, min(self.sinks.end, self.end))

    def read(self, start, dtype):
        hkv, d, n = self.geometry.n_kv_heads, self.geometry.head_dim, self.end - start
        buf = self.scratch.get(2, hkv, n, d)
        tier = self._tier_from(start)
        r = self.rows.read(start, tier)
        for i, (prefix, codec) in enumerate(self.codecs.items()):
            self._decode(r, prefix, codec, buf[i][:, :tier - start])
        if tier < self.end:
            r = self.tier.read(tier, self.end)
            for i, (prefix, codec) in enumerate(self.tier_codecs.items()):
                self._decode(r, prefix, codec, buf[i][:, tier - start:])
        lo = self._exact_from(start)
        if lo < self.end:
            buf[0][:, lo - start:] = self.recent.read(lo, self.end)["k"]
        hi = self._sink_end(start)
        if hi > start:
            s = self.sinks.read(start, hi)
            buf[0][:, :hi - start], buf[1][:, :hi - start] = s["k"], s["v"]
        return buf[0].to(dtype), buf[1].to(dtype)

    def _scores(self, codec: RowCodec, qr, f, bias):
        s = codec.scores(qr, f)
        return s if bias is None else s.add_(bias[:, None])

    def attend(self, q, k, v, p):
        if q.shape[1] != 1 or not self.fused:
            return super().attend(q, k, v, p)
        q_start = self.end
        self.append(k, v)
        start = self.geometry.read_start(q_start)
        tier = self._tier_from(start)
        lo = min(tier, self._exact_from(start))  # K rows from here on come from the tier or are exact
        r = self.rows.read(start, tier)
        t = self.tier.read(tier, self.end) if tier < self.end else None
        exact = self.recent.read(lo, self.end)["k"] if self.recent is not None and lo < self.end else None
        ns = self._sink_end(start) - start
        sinks = self.sinks.read(start, start + ns) if ns else None
        hkv = self.geometry.n_kv_heads
        group = q.shape[0] // hkv
        out = torch.empty(q.shape[0], 1, q.shape[2], dtype=torch.float32)
        for h in range(hkv):
            qh = q[h * group:(h + 1) * group, 0].float()
            qk, bias = qh, None
            if self.calibration is not None:  # q . k' = (q / scale) . y' + q . mean
                qk, bias = qh / self.calibration.scale[h], qh @ self.calibration.mean[h]
            qr = self.k_codec.rotate(qk)  # every width shares the rotation: one per head
            parts = [self._scores(self.k_codec, qr, self._fields(r, "k", self.k_codec, h, lo - start), bias)]
            if t is not None:
                tk = self.tier_codecs["k"]
                parts.append(self._scores(tk, qr, self._fields(t, "k", tk, h), bias))
            if exact is not None:
                parts.append(qh @ exact[h].T)
            s = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            if sinks is not None:
                s[:, :ns] = qh @ sinks["k"][h].T
            probs = torch.softmax(s * p.scale, dim=-1)
            if sinks is not None:
                head = probs[:, :ns].clone()
                probs[:, :ns] = 0.0
            o = self.v_codec.weighted_sum(probs[:, :tier - start].contiguous(), self._fields(r, "v", self.v_codec, h))
            if t is not None:
                tv = self.tier_codecs["v"]
                o += tv.weighted_sum(probs[:, tier - start:].contiguous(), self._fields(t, "v", tv, h))
            out[h * group:(h + 1) * group, 0] = o if sinks is None else o + head @ sinks["v"][h]
        self.release()
        return out.to(q.dtype)

    def release(self):
        self.rows.commit()
        for ring in (self.recent, self.tier):
            if ring is not None:
                ring.commit()
        if self.last:
            self.scratch.release()

    def row_sets(self):
        label = self.k_codec.label if self.k_codec.label == self.v_codec.label \
            else f"{self.k_codec.label}/{self.v_codec.label}"
        sets = {"main": (self.rows, "QUANTIZED", label)}
        if self.recent is not None:
            sets["recent"] = (self.recent, "ACTIVE", "f32")
        if self.tier is not None:
            sets["tier"] = (self.tier, "QUANTIZED", self.tier_codecs["k"].label)
        if self.sinks is not None:
            sets["sink"] = (self.sinks, "ACTIVE", "f32")
        return sets

    def set_end(self, name, end):
        return min(end, self.sink) if name == "sink" else end

    def can_trim(self, end):
        # the recent rings' rows below the old end are gone: only the newest position can be redone
        for ring in (self.recent, self.tier):
            if ring is not None and ring.base > max(0, end - ring.keep):
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
RECENT = OptionSpec("recent", int_in(1, 4096), help="the newest N rows' K and V also kept at recent_bits")
RECENT_BITS = OptionSpec("recent_bits", int_in(2, 8, choices=WIDTHS),
                         help="width of the newest `recent` rows (default 8); " + WIDTH_HELP)


def on_off(text: str) -> str:
    if text not in ("on", "off"):
        raise ValueError(f"expected on or off, got {text!r}")
    return text


CALIB = OptionSpec("calib", on_off, help="on: keys quantized as (k - mean) * scale from the model's key calibration "
                                         "(`larqlpy calibrate`)")


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
# suggests when codec options are missing or not understood. About 4.4 bits per value at 1.5K
# positions on the 270M, KL 0.005; COMPACT: about 3.4 bits, KL 0.02 (beats llama.cpp's q4_0 KV).
RECOMMENDED = ("codec/v1", (("bits", 4), ("calib", "on"), ("recent", 16), ("sink", 1)))
COMPACT = ("codec/v1", (("bits", 3), ("calib", "on"), ("recent", 16), ("sink", 1)))


def config_spec(config=RECOMMENDED) -> EngineSpec:
    """A named configuration (RECOMMENDED, COMPACT) as the spec a run takes."""
    return parse_engine_spec(continuation=config[0], continuation_options=[f"{k}={v}" for k, v in config[1]])


def recommended_flags(rec=RECOMMENDED) -> str:
    return f"--continuation {rec[0]} " + " ".join(f"--continuation-option {k}={v}" for k, v in rec[1])


class Codec(Provider):
    identity = "codec/v1"
    summary = ("TurboQuant 2-8-bit K/V rows (key/value widths, calibrated keys, a wider recent tier, exact sinks) "
               "over window/v1's retention")
    exact = False

    @classmethod
    def option_specs(cls):
        return (BITS, K_BITS, V_BITS, SINK, LAYER_BITS, RECENT, RECENT_BITS, CALIB)

    @classmethod
    def hint(cls) -> str:
        return f"recommended: {recommended_flags()}"

    @classmethod
    def check_options(cls, options, where):
        missing = [t for t in ("k_bits", "v_bits") if t not in options and "bits" not in options]
        if missing:
            raise LarqlError(f"{where}: {cls.identity} requires option bits (or k_bits and v_bits); "
                             f"{cls.hint()}")
        if "recent_bits" in options and "recent" not in options:
            raise LarqlError(f"{where}: recent_bits needs recent=N (how many of the newest rows); {cls.hint()}")

    @classmethod
    def residency_variants(cls):
        return ((("bits", 4),), (("bits", 3),), RECOMMENDED[1], COMPACT[1])

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

    def tier(self) -> int:
        return int(self.options.get("recent", 0))

    def tier_codecs(self, geometry: LayerGeometry, device: torch.device) -> tuple[RowCodec, RowCodec] | None:
        if not self.tier() or self.widths(geometry.index) is None:  # a layer kept exact needs no tier
            return None
        bits = int(self.options.get("recent_bits", 8))
        return TurboQuantCodec(geometry.head_dim, bits, device), TurboQuantCodec(geometry.head_dim, bits, device)

    def layer_calibration(self, geometry: LayerGeometry):
        """The layer's key calibration when `calib=on` and the layer's keys are codes, else None."""
        if self.options.get("calib", "off") != "on" or self.widths(geometry.index) is None:
            return None
        return geometry.key_calibration

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
        if self.options.get("calib") == "on":  # accounting (residency) needs no calibration; rows do
            require_calibration(geometries, f"{self.identity} calib=on")
        scratch = Scratch(device)
        stores = [self._store(g, device, scratch) for g in geometries]
        stores[-1].last = True
        return EngineState(self.identity, self.options, stores, extras=[scratch])

    def _store(self, g: LayerGeometry, device: torch.device, scratch: Scratch) -> CodecStore:
        tier = self.tier_codecs(g, device)
        return CodecStore(g, device, self.make_codec(g, device, "k"), g.window, scratch, self.exact_recent(),
                          v_codec=self.make_codec(g, device, "v"), sink=self.sink(),
                          tier=min(self.tier(), g.window or self.tier()) if tier else 0, tier_codecs=tier,
                          calibration=self.layer_calibration(g))

    def retained_rows(self, geometry, positions):
        return positions if geometry.window is None else min(positions, geometry.window)

    def row_bytes(self, geometry):
        meta = torch.device("meta")
        return geometry.n_kv_heads * sum(self.make_codec(geometry, meta, t).row_bytes for t in ("k", "v"))

    def layer_bytes(self, geometry, positions):
        f32 = geometry.n_kv_heads * geometry.head_dim * 4  # one exact row of one tensor
        exact = min(positions, self.exact_recent()) * f32 + min(positions, self.sink()) * 2 * f32
        tier = self.tier_codecs(geometry, torch.device("meta"))
        if tier:
            rows = min(positions, self.tier(), self.retained_rows(geometry, positions))
            exact += rows * geometry.n_kv_heads * sum(c.row_bytes for c in tier)
        return self.retained_rows(geometry, positions) * self.row_bytes(geometry) + exact


class CodecRecent(Codec):
    identity = "codec-recent/v1"
    summary = "codec/v1 plus the newest exact_recent_k K rows kept exact in f32"

    @classmethod
    def option_specs(cls):
        return (BITS, K_BITS, V_BITS, SINK, LAYER_BITS, CALIB,
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
