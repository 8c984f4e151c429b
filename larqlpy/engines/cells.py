"""cells/v1: attention state as KV cells with a lifecycle, driven by YAML rules and a memory budget.

A cell is `cell_size` consecutive positions of one layer. New rows go into the newest cell (ACTIVE,
f32). After every block, cells below the layer's horizon are EVICTED, and while the resident bytes
of all cells exceed the budget, MEMORY_PRESSURE moves the coldest cell (lowest positions first)
one step down as the rules allow: ACTIVE -> QUANTIZED (TurboQuant codes, on layers the policy lets
quantize) -> PERSISTED (bytes in an append-only spill file, read back through mmap, not resident).
The newest `keep_active_recent` positions and the newest cell of each layer stay ACTIVE. Reading a
PERSISTED cell is CACHE_MISS (-> RECOVERING) then WRITE_BACK (-> PERSISTED): its rows are decoded
into the shared scratch for the read and nothing stays in memory.

With no budget, or rules that only ever persist f32 cells, cells/v1 is exact (bit-identical to
canonical/v1: the same rows in the same order reach attention).

This module declares the engine; the rules are lifecycle.py, the store engines/stores/cells.py.
"""

from __future__ import annotations

import dataclasses

from larqlpy.engines.codec import CALIB
from larqlpy.engines.geometry import LayerGeometry, calibrated_everywhere, storing
from larqlpy.engines.lifecycle import load_rules
from larqlpy.engines.options import OptionSpec, parse_size, width_in
from larqlpy.engines.provider import Provider
from larqlpy.errors import LarqlError


class Cells(Provider):
    identity = "cells/v1"
    summary = "KV cells with a lifecycle (YAML rules) under a memory budget; exact unless cells quantize"
    exact = False

    @classmethod
    def option_specs(cls):
        return (OptionSpec("budget", parse_size, help="resident KV budget, e.g. 64MiB"),
                OptionSpec("rules", str, help="rules YAML file (default: the packaged rules)"),
                OptionSpec("bits", width_in((3, 4)), help="override the rules' codec width (3 or 4)"),
                CALIB)

    @classmethod
    def defaults(cls):
        return (("calib", "auto"),)  # QUANTIZED keys calibrated wherever the model has (or gets) one

    @classmethod
    def saved_defaults(cls):
        return (("calib", "off"),)

    def calibrated(self, geometries) -> bool:
        """QUANTIZED keys under the key calibration: the rules' `calib: on`, or the option (`auto`:
        where every layer has one)."""
        calib = self.options.get("calib", "off")
        return self.rules.policy.calib or calib == "on" or (calib == "auto" and calibrated_everywhere(geometries))

    def wants_calibration(self) -> bool:
        return self.rules.policy.calib or self.options.get("calib", "off") in ("auto", "on")

    def resolved(self, geometries):
        return self.calib_resolved(self.calibrated(geometries))

    def __init__(self, options):
        super().__init__(options)
        self.rules = load_rules(self.options.get("rules"))
        if "bits" in self.options:
            self.rules.policy = dataclasses.replace(self.rules.policy, bits=int(self.options["bits"]))

    def cell_bytes(self, g: LayerGeometry) -> int:
        return self.rules.cell_size * self.row_bytes(g)

    def row_bytes(self, g: LayerGeometry) -> int:
        return 2 * g.exact_bytes  # a cell holds K and V apart, MLA's latent rows (values_are_keys) too

    def state_bytes(self, geometries, positions, slack=0):
        """Its own budget bounds what it holds (with a cell per layer of slack while a block lands)."""
        rows = super().state_bytes(geometries, positions, slack)
        budget = self.options.get("budget")
        return rows if budget is None else min(rows, budget + sum(self.cell_bytes(g) for g in storing(geometries)))

    def check_geometry(self, geometries):
        budget = self.options.get("budget")
        if budget is None:
            return
        if not self.rules.can_reach_disk():
            raise LarqlError(f"cells/v1: the rules in {self.rules.source} cannot keep resident KV under a budget: "
                             "no MEMORY_PRESSURE path takes an ACTIVE cell to PERSISTED")
        geometries = storing(geometries)  # a layer reading an earlier layer's rows holds no cells
        keep_cells = -(-self.rules.policy.keep_active_recent // self.rules.cell_size) + 1
        floor = sum(min(keep_cells, -(-(g.window or 10**12) // self.rules.cell_size) + 1) * self.cell_bytes(g)
                    for g in geometries)
        slack = sum(self.cell_bytes(g) for g in geometries)
        if floor - slack > budget:
            raise LarqlError(f"cells/v1: budget {budget:,} B is below what the rules keep ACTIVE "
                             f"({floor - slack:,} B for keep_active_recent={self.rules.policy.keep_active_recent} "
                             f"on {len(geometries)} layers)")

    @classmethod
    def check_options(cls, options, where):
        load_rules(options.get("rules"))  # a bad rules file is refused before any weights load

    def build_state(self, geometries, device):
        from larqlpy.engines.stores.cells import new_cells_state  # torch: loaded when rows are first stored

        self.check_geometry(geometries)
        return new_cells_state(self, geometries, device)
