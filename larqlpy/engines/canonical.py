"""canonical/v1: every K/V row kept (in the model's kv_dtype) -- the exact baseline every other engine
is held to."""

from __future__ import annotations

from larqlpy.engines.provider import Provider


class Canonical(Provider):
    identity = "canonical/v1"
    summary = "every K/V row; exact baseline (sliding layers read only their window)"

    def make_store(self, geometry, device):
        from larqlpy.engines.stores.exact import ExactStore  # torch: loaded when rows are first stored

        return ExactStore(geometry, device)

    def retained_rows(self, geometry, positions):
        return positions
