"""How busy each replica is, as the router in front of them counts it (server/ray_router.py): the
requests it accepted and has not finished, and the ones ranked for it but not yet sent.

A burst of new conversations is ranked before any of it reaches a replica (Ray Serve's routing
tasks wait on the replicas' queue lengths meanwhile, and those lag a burst), so counting only what
replicas accepted sends the whole burst to one. A request is counted on the replica it is first
ranked for (`plan`) until it lands (`placed`); a plan that never lands (its client went away before)
is dropped after `PLAN_S`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

PLAN_S = 30.0


@dataclass
class Load:
    busy: Counter = field(default_factory=Counter)  # replica -> requests accepted, not finished
    plans: OrderedDict = field(default_factory=OrderedDict)  # request id -> (replica, when), oldest first
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ranked(self, replicas: list[str], request: str | None = None, first: str | None = None) -> list[str]:
        """`replicas`, `first` (the one holding the request's state) then the least busy (ties by
        id); the first is planned for `request`."""
        with self.lock:
            now = time.monotonic()
            while self.plans and next(iter(self.plans.values()))[1] < now - PLAN_S:
                self.plans.popitem(last=False)
            planned = Counter(r for q, (r, _) in self.plans.items() if q != request)
            order = sorted(replicas, key=lambda r: (r != first, self.busy[r] + planned[r], r))
            if request is not None and order:
                self.plans[request] = (order[0], now)
            return order

    def placed(self, request: str | None, replica: str) -> None:
        """`request` was accepted by `replica`."""
        with self.lock:
            self.plans.pop(request, None)
            self.busy[replica] += 1

    def done(self, replica: str) -> None:
        """A request `replica` accepted finished (answered, failed or cancelled)."""
        with self.lock:
            self.busy[replica] = max(0, self.busy[replica] - 1)


# The router's process's one count (as affinity.SHARED: the router class is shipped by value)
SHARED = Load()
