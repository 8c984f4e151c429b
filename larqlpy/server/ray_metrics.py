"""A replica's /metrics through Ray's Prometheus export: every few seconds the figures of its own
registry (server/metrics.py) are copied into `ray.util.metrics` of the same names and labels, which
each node's metrics agent exports (as ray_larqlpy_...), each series tagged with its replica. Counters
advance by what they grew since the last copy, so they stay counters."""

from __future__ import annotations

import threading

from ray.util.metrics import Counter, Gauge

EVERY_S = 5.0


class Mirror:
    def __init__(self, registry, replica: str):
        self.registry, self.replica = registry, replica  # each series is tagged with its replica
        self.metrics: dict[str, Counter | Gauge] = {}
        self.last: dict[tuple, float] = {}  # a counter's series -> its value at the last copy
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="larqlpy-ray-metrics", daemon=True)

    def start(self) -> "Mirror":
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop.wait(EVERY_S):
            self.copy()

    def copy(self) -> None:
        for family in self.registry.collect():
            counter = family.type == "counter"
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                name = family.name if counter else s.name  # Ray names a counter's series NAME_total itself
                tags = {**s.labels, "replica": self.replica}
                if name not in self.metrics:
                    kind = Counter if counter else Gauge
                    self.metrics[name] = kind(name, family.documentation, tag_keys=tuple(sorted(tags)))
                if counter:
                    series = (name, tuple(sorted(s.labels.items())))
                    grew = s.value - self.last.get(series, 0.0)
                    self.last[series] = s.value
                    if grew > 0:
                        self.metrics[name].inc(grew, tags=tags)
                else:
                    self.metrics[name].set(s.value, tags=tags)

    def close(self) -> None:
        self.stop.set()
