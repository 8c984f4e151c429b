"""codec/v1 and friends: window/v1's retention, rows kept as codes (approximate).

- `codec/v1` (V2: `engine` turbo-quant:bits=N): TurboQuant, `bits` 3 or 4 for both K and V; mixed
  precision: `k_bits` / `v_bits` (2, 3, 4, 5, 6, 8) give keys and values their own widths, `sink=N`
  keeps the first N positions' K and V exact in f32, `layer_bits=5:8/4,11:exact` sets widths (or f32
  rows) per layer, `recent=N` keeps the newest N rows' K and V a second time at `recent_bits`
  (default 8) and reads them there, `calib=on` quantizes keys as (k - mean) * scale with the
  model's key calibration (engines/stores/calibration.py).
- `codec-recent/v1`: the same codes, plus the newest `exact_recent_k` K rows kept exact in f32.
  Every row is encoded once, when it arrives, from its own values, so the codes are the bytes
  codec/v1 writes; the exact copy of a K row is dropped as it ages out of the newest k.
- `int4-group/v1`: the seed article's symmetric group-wise INT4 (one float16 scale per `group`
  values), for comparison at (nearly) equal bits.

This module declares them and accounts for their bytes; the store is engines/stores/codec.py.
"""

from __future__ import annotations

from larqlpy.engines.geometry import LayerGeometry, calibrated_everywhere
from larqlpy.engines.options import OptionSpec, canonical_layer_bits, int_in, one_of, parse_layer_bits, width_in
from larqlpy.engines.presets import CODEC_DEFAULTS, CODEC_PLAIN, RECOMMENDED
from larqlpy.engines.provider import Provider
from larqlpy.errors import LarqlError
from larqlpy.kernels.kvcodec import tqformat
from larqlpy.kernels.kvcodec.tqformat import WIDTHS

WIDTH_HELP = "bits per coordinate: " + ", ".join(map(str, WIDTHS))
BITS = OptionSpec("bits", width_in((3, 4)), help="bits per coordinate of K and V: 3 or 4")
K_BITS = OptionSpec("k_bits", width_in(), help="key width (overrides bits); " + WIDTH_HELP)
V_BITS = OptionSpec("v_bits", width_in(), help="value width (overrides bits); " + WIDTH_HELP)
SINK = OptionSpec("sink", int_in(0, 4096), help="the first N positions' K and V rows kept exact (attention sinks)")
RECENT = OptionSpec("recent", int_in(0, 4096), help="the newest N rows' K and V also kept at recent_bits (0: none)")
RECENT_BITS = OptionSpec("recent_bits", width_in(), help="width of the newest `recent` rows (default 8); " + WIDTH_HELP)
CALIB = OptionSpec("calib", one_of("auto", "on", "off"),
                   help="on: keys quantized as (k - mean) * scale from the model's key calibration; "
                        "auto: on where the model has one (the request pipeline measures it once)")
LAYER_BITS = OptionSpec("layer_bits", canonical_layer_bits,
                        help="per-layer widths, e.g. 5:8/4,11:exact (LAYER:K_BITS/V_BITS or LAYER:exact)")


def check_format(fmt: tuple, d: int) -> None:
    """Refuse (ValueError) a row format that cannot hold a head of `d` values."""
    if fmt[0] == "tq":
        tqformat.check_dim(d)
    elif fmt[0] == "int4g" and (fmt[1] < 2 or d % fmt[1] or fmt[1] % 2):
        raise ValueError(f"group {fmt[1]} must be even and divide head_dim {d}")


def format_bytes(fmt: tuple, d: int) -> int:
    """Bytes of one head row of `d` values in a row format."""
    if fmt[0] == "tq":
        return tqformat.row_bytes(d, fmt[1])
    if fmt[0] == "int4g":
        return 2 * (d // fmt[1]) + d // 2  # float16 scales, 4-bit codes
    return 4 * d


class Codec(Provider):
    identity = "codec/v1"
    summary = ("TurboQuant 2-8-bit K/V rows (key/value widths, calibrated keys, a wider recent tier, exact sinks) "
               "over window/v1's retention")
    exact = False

    @classmethod
    def option_specs(cls):
        return (BITS, K_BITS, V_BITS, SINK, LAYER_BITS, RECENT, RECENT_BITS, CALIB)

    @classmethod
    def suggestion(cls):
        return RECOMMENDED

    @classmethod
    def defaults(cls):
        return CODEC_DEFAULTS

    @classmethod
    def saved_defaults(cls):
        return CODEC_PLAIN

    @classmethod
    def check_options(cls, options, where):
        missing = [t for t in ("k_bits", "v_bits") if t not in options and "bits" not in options]
        if missing:
            raise LarqlError(f"{where}: {cls.identity} requires option bits (or k_bits and v_bits)",
                             suggest=cls.suggestion())
        if "recent_bits" in options and not options.get("recent"):
            raise LarqlError(f"{where}: recent_bits needs recent=N (how many of the newest rows)",
                             suggest=cls.suggestion())

    # -- what each layer stores ----------------------------------------------------------------
    def widths(self, layer: int) -> tuple[int, int] | None:
        """(K bits, V bits) on `layer`, or None where the layer keeps f32 rows."""
        per = dict(parse_layer_bits(self.options["layer_bits"])) if "layer_bits" in self.options else {}
        if layer in per:
            return per[layer]
        bits = self.options.get("bits")
        return int(self.options.get("k_bits", bits)), int(self.options.get("v_bits", bits))

    def exact_keys(self) -> int:
        """The newest K rows also kept in f32 (codec-recent/v1)."""
        return 0

    def sink(self) -> int:
        return int(self.options.get("sink", 0))

    def recent(self, geometry: LayerGeometry) -> int:
        """Rows of the wider recent tier on this layer (none on a layer kept exact)."""
        n = int(self.options.get("recent", 0))
        if not n or self.widths(geometry.index) is None:
            return 0
        return min(n, geometry.window or n)

    def recent_bits(self) -> int:
        return int(self.options.get("recent_bits", 8))

    def calibrated(self, geometry: LayerGeometry) -> bool:
        """Keys quantized under the model's key calibration: `calib=on` (or `auto` on a model that has
        one), on layers whose keys are codes."""
        calib = self.options.get("calib", "off")
        on = calib == "on" or (calib == "auto" and geometry.key_calibration is not None)
        return on and self.widths(geometry.index) is not None

    def wants_calibration(self) -> bool:
        return self.options.get("calib", "off") in ("auto", "on")

    def resolved(self, geometries):
        return self.calib_resolved(calibrated_everywhere(geometries))

    def row_format(self, geometry: LayerGeometry, tensor: str) -> tuple:
        """How this layer stores one head's row of K ("k") or V ("v"): ("tq", bits), or ("f32",) on a
        layer kept exact (kernels/rowcodec.row_codec builds the codec from it)."""
        w = self.widths(geometry.index)
        return ("f32",) if w is None else ("tq", w[0] if tensor == "k" else w[1])

    def check_head(self, geometry: LayerGeometry) -> None:
        """Refuse (ValueError) a head this provider's codes cannot hold."""
        for t in "kv":
            check_format(self.row_format(geometry, t), geometry.head_dim)

    def check_geometry(self, geometries):
        n = len(geometries)
        bad = [i for i, _ in parse_layer_bits(self.options["layer_bits"]) if i >= n] \
            if "layer_bits" in self.options else []
        if bad:
            raise LarqlError(f"{self.identity}: layer_bits names layer {bad[0]}, the model has {n} layers")
        for g in geometries:
            try:
                self.check_head(g)
            except ValueError as e:
                raise LarqlError(f"{self.identity}: layer {g.index}: {e}") from None

    def build_state(self, geometries, device):
        from larqlpy.engines.stores.codec import new_codec_state  # torch: loaded when rows are first stored

        self.check_geometry(geometries)
        return new_codec_state(self, geometries, device)

    # -- accounting ----------------------------------------------------------------------------
    def row_bytes(self, geometry):
        return geometry.n_kv_heads * sum(format_bytes(self.row_format(geometry, t), geometry.head_dim) for t in "kv")

    def layer_bytes(self, geometry, positions):
        one = geometry.exact_bytes  # one exact row of one tensor
        extra = min(positions, self.exact_keys()) * one + min(positions, self.sink()) * 2 * one
        recent = self.recent(geometry)
        if recent:
            rows = min(positions, recent, self.retained_rows(geometry, positions))
            extra += rows * geometry.n_kv_heads * 2 * tqformat.row_bytes(geometry.head_dim, self.recent_bits())
        return self.retained_rows(geometry, positions) * self.row_bytes(geometry) + extra


class CodecRecent(Codec):
    identity = "codec-recent/v1"
    summary = "codec/v1 plus the newest exact_recent_k K rows kept exact"

    @classmethod
    def option_specs(cls):
        return (BITS, K_BITS, V_BITS, SINK, LAYER_BITS, CALIB,
                OptionSpec("exact_recent_k", int_in(1), required=True, help="newest K rows kept exact"))

    @classmethod
    def defaults(cls):
        return ()  # its own recipe (exact recent keys): codec/v1's defaults are not its

    @classmethod
    def saved_defaults(cls):
        return ()

    def exact_keys(self) -> int:
        return int(self.options["exact_recent_k"])


class Int4Group(Codec):
    identity = "int4-group/v1"
    summary = "symmetric group-wise INT4 (float16 scale per group), the seed article's scheme"

    @classmethod
    def option_specs(cls):
        return (OptionSpec("group", int_in(2), help="values per scale (default 32)"),)

    @classmethod
    def defaults(cls):
        return ()

    @classmethod
    def saved_defaults(cls):
        return ()

    @classmethod
    def check_options(cls, options, where):
        pass

    def widths(self, layer):
        return (4, 4)

    def group(self) -> int:
        return int(self.options.get("group", 32))

    def row_format(self, geometry, tensor):
        return ("int4g", self.group())
