"""What a KV engine knows of one layer: its index, its sliding window, its KV heads and head_dim, and
the dtype its exact rows are kept in."""

from __future__ import annotations

from dataclasses import dataclass, field

from larqlpy.errors import LarqlError

KV_DTYPES = {"f32": 4, "f16": 2, "bf16": 2}  # the dtypes exact K/V rows are kept in: bytes per value


def check_kv_dtype(name: str | None) -> str | None:
    """A kv_dtype as given (None: the default, chosen by the weights), or a one-line refusal."""
    if name is not None and name not in KV_DTYPES:
        raise LarqlError(f"`kv_dtype`: expected {' | '.join(KV_DTYPES)}, got {name!r}")
    return name


def default_kv_dtype(weights: str) -> str:
    """Exact rows in f32 beside f32 weights (the exact baseline), else f16: half the bytes, and the
    weights' own rounding already dwarfs f16's."""
    return "f32" if weights == "f32" else "f16"


@dataclass(frozen=True)
class LayerGeometry:
    index: int
    window: int | None  # rows a query sees, itself included; None on global layers
    n_kv_heads: int
    head_dim: int
    # the model's measured key statistics for this layer (engines.stores.calibration.KeyCalibration),
    # for codecs that use them
    key_calibration: object = field(default=None, compare=False, repr=False)
    # why the model has no usable calibration (a stale or damaged file), for the engines that need one
    calibration_problem: str | None = field(default=None, compare=False, repr=False)
    kv_dtype: str = "f32"  # exact rows (canonical/v1, window/v1, sinks, exact keys, ACTIVE cells): KV_DTYPES
    # one row a position serves as its key and its value (MLA's latent rows: model/mla.py): stores that
    # keep exact rows keep it once; the attention output's columns past the value's are the model's to drop
    values_are_keys: bool = False
    # the earlier layer whose rows this one attends over (Gemma 4's shared K/V): it stores none of its
    # own, and no engine builds or counts a store for it (`storing`; engines/stores/shared.py)
    reads: int | None = None

    @property
    def kind(self) -> str:
        return "global" if self.window is None else "sliding"

    @property
    def exact_bytes(self) -> int:
        """Bytes of one position's K or V row, exact (in `kv_dtype`)."""
        return self.n_kv_heads * self.head_dim * KV_DTYPES[self.kv_dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one position's K and V rows, exact (one row when the values are the keys)."""
        return self.exact_bytes if self.values_are_keys else 2 * self.exact_bytes

    def read_start(self, q_start: int) -> int:
        """First logical position a block of queries starting at `q_start` may read."""
        return 0 if self.window is None else max(0, q_start - self.window + 1)

    def readable_rows(self, positions: int) -> int:
        """Rows a later query can still read after `positions` positions: all on a global layer,
        the window on a sliding one (what window/v1, codec/v1 and cells/v1 retain)."""
        return positions if self.window is None else min(positions, self.window)


def storing(geometries) -> list[LayerGeometry]:
    """The layers that keep rows of their own: all but those reading an earlier layer's."""
    return [g for g in geometries if g.reads is None]


def calibrated_everywhere(geometries) -> bool:
    """Whether every layer has the model's key calibration (what `calib=auto` turns on for)."""
    return bool(geometries) and all(g.key_calibration is not None for g in geometries)
