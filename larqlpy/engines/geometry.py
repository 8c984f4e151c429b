"""What a KV engine knows of one layer: its index, its sliding window, its KV heads and head_dim."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def kind(self) -> str:
        return "global" if self.window is None else "sliding"

    @property
    def row_bytes_f32(self) -> int:
        """Bytes of one position's K and V rows in f32."""
        return 2 * self.n_kv_heads * self.head_dim * 4

    def read_start(self, q_start: int) -> int:
        """First logical position a block of queries starting at `q_start` may read."""
        return 0 if self.window is None else max(0, q_start - self.window + 1)

    def readable_rows(self, positions: int) -> int:
        """Rows a later query can still read after `positions` positions: all on a global layer,
        the window on a sliding one (what window/v1, codec/v1 and cells/v1 retain)."""
        return positions if self.window is None else min(positions, self.window)
