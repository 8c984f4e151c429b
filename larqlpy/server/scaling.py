"""How many replicas `larqlpy serve --ray` runs (server/ray_serve.py), and the CPUs each takes; no
Ray here, so the command line can check it before Ray loads."""

from __future__ import annotations

from dataclasses import dataclass

from larqlpy.errors import LarqlError


@dataclass(frozen=True)
class Scale:
    """`replicas` replicas of `replica_cpus` CPUs each (their torch and numba threads). With
    `min_replicas` or `max_replicas`: autoscaled on queue depth, starting at `replicas`."""

    replicas: int = 1
    replica_cpus: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None

    def __post_init__(self):
        if self.replicas < 1 or self.replica_cpus < 1 or any(
                n is not None and n < 1 for n in (self.min_replicas, self.max_replicas)):
            raise LarqlError("`replicas`, `replica_cpus`, `min_replicas` and `max_replicas` must be >= 1")
        if self.autoscaled and self.bounds[0] > self.bounds[1]:
            raise LarqlError(f"`min_replicas` {self.bounds[0]} is more than `max_replicas` {self.bounds[1]}")

    @property
    def autoscaled(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    @property
    def bounds(self) -> tuple[int, int]:
        lo = self.min_replicas if self.min_replicas is not None else 1
        return lo, self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)

    def most(self) -> int:
        """The most replicas it may run: what a local cluster needs CPUs for."""
        return self.bounds[1] if self.autoscaled else self.replicas
