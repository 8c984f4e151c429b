"""A continuation provider: an identity string, the options it declares, what it would retain, and
the per-layer stores it builds.

Declaring and accounting need no torch: option refusals, `residency` and `--help` run without it.
The stores (engines/stores/) are torch; a provider imports its store module when it builds a state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Sequence

from larqlpy.engines.geometry import LayerGeometry, storing
from larqlpy.engines.options import OptionSpec

if TYPE_CHECKING:
    import torch

    from larqlpy.engines.presets import Preset
    from larqlpy.engines.stores.base import LayerStore
    from larqlpy.engines.stores.state import EngineState


class Provider:
    identity: ClassVar[str]
    summary: ClassVar[str]
    exact: ClassVar[bool] = True

    def __init__(self, options: dict):
        self.options = dict(options)

    # -- declaration -------------------------------------------------------------------------
    @classmethod
    def option_specs(cls) -> tuple[OptionSpec, ...]:
        """The options this provider declares; anything else is refused."""
        return ()

    @classmethod
    def suggestion(cls) -> "Preset | None":
        """A configuration to suggest beside option refusals (e.g. the recommended one)."""
        return None

    @classmethod
    def defaults(cls) -> tuple[tuple[str, object], ...]:
        """Options taken when not given (spec validation fills them in, so states record them)."""
        return ()

    @classmethod
    def saved_defaults(cls) -> tuple[tuple[str, object], ...]:
        """What an option missing from a saved state meant: its value before it had a default."""
        return ()

    @classmethod
    def check_options(cls, options: dict, where: str) -> None:
        """Cross-option checks after each value parsed; raise LarqlError to refuse."""

    def wants_calibration(self) -> bool:
        """Whether this engine would use the model's key calibration (the request pipeline measures
        one first when the model has none)."""
        return False

    def resolved(self, geometries: Sequence[LayerGeometry]) -> dict:
        """The options as they apply on this model (an `auto` made on or off): what states record and
        what a resumed state must match."""
        return dict(self.options)

    def calib_resolved(self, on: bool) -> dict:
        """The options with `calib=auto` made what it applies as (`on`: the keys are calibrated)."""
        out = dict(self.options)
        if out.get("calib") == "auto":
            out["calib"] = "on" if on else "off"
        return out

    def check_geometry(self, geometries: Sequence[LayerGeometry]) -> None:
        """Refuse a model this provider cannot serve, before any row is stored."""

    # -- accounting (what residency reports) -------------------------------------------------
    def retained_rows(self, geometry: LayerGeometry, positions: int) -> int:
        """Rows the store holds after `positions` positions: by default, those a later query can read."""
        return geometry.readable_rows(positions)

    def row_bytes(self, geometry: LayerGeometry) -> int:
        return geometry.row_bytes

    def layer_bytes(self, geometry: LayerGeometry, positions: int) -> int:
        """Bytes one layer's store holds after `positions` positions."""
        return self.retained_rows(geometry, positions) * self.row_bytes(geometry)

    def state_bytes(self, geometries: Sequence[LayerGeometry], positions: int, slack: int = 0) -> int:
        """Bytes a whole state holds after `positions` positions: what a budget reserves for it.
        `slack`: rows each layer also holds to go back that far (speculative decoding's proposals,
        `EngineState.keep_rollback`), counted at a stored row's size."""
        return sum(self.layer_bytes(g, positions) + min(slack, positions) * self.row_bytes(g)
                   for g in storing(geometries))  # a layer reading an earlier layer's rows holds none

    # -- stores ------------------------------------------------------------------------------
    def make_store(self, geometry: LayerGeometry, device: "torch.device") -> "LayerStore":
        raise NotImplementedError

    def new_state(self, geometries: Sequence[LayerGeometry], device: "torch.device") -> "EngineState":
        """A fresh state: stores built for the layers that keep rows (`build_state`), and at each layer
        that reads an earlier layer's rows a view of that layer's store (engines/stores/shared.py)."""
        from larqlpy.engines.stores.shared import with_readers  # torch: loaded when rows are first stored

        return with_readers(self.build_state(storing(geometries), device), geometries)

    def build_state(self, geometries: Sequence[LayerGeometry], device: "torch.device") -> "EngineState":
        """The state of `geometries`, every one a layer that keeps rows of its own."""
        from larqlpy.engines.stores.state import EngineState  # torch: loaded when rows are first stored

        self.check_geometry(geometries)
        return EngineState(self.identity, self.resolved(geometries), [self.make_store(g, device) for g in geometries])
