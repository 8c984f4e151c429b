"""Ray Serve's request router for larqlpy's replicas: a request goes to the replica that holds its
conversation's state (server/affinity.py: its keys, recorded by the front as answers come back),
otherwise, or when that replica's queue is full, to the least busy one (server/balance.py: the
requests sent it and not finished, counted as they are ranked, so a burst spreads evenly). A front's
channel call (server/ray_replica.py) goes to the replica it names.

The router runs in the process that calls the replicas -- the front (server/ray_front.py) -- and
shares that process's one map with it (`affinity.SHARED`: Ray ships this module by value, so
it holds no state of its own). A replica that goes leaves its keys behind; they are
skipped until a request of theirs lands elsewhere and records its new replica, so the map follows
replicas as they come and go. Turns are counted (hit, moved, new) here and exported through Ray's
metrics as `larqlpy_router_turns_total{result}`.
"""

from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.util.metrics import Counter

from larqlpy.server import affinity, balance
from larqlpy.server.affinity import Keys


def keys_of_request(pending: Optional[PendingRequest]) -> Keys:
    """The keys the front passed with the call (its first argument's `keys`)."""
    if pending is None or not pending.args:
        return Keys()
    return getattr(pending.args[0], "keys", None) or Keys()


def request_id(pending: Optional[PendingRequest]) -> str | None:
    return getattr(getattr(pending, "metadata", None), "internal_request_id", None)


class StateRouter(RequestRouter):
    def initialize_state(self, **kwargs):
        self.turns = Counter("larqlpy_router_turns", "requests by where they landed: hit (the replica holding "
                             "their state), moved (it was gone or full), new (no state known)", tag_keys=("result",))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        """Ranks, one replica each: the replica holding the request's state first, then the others,
        the least busy first (Ray Serve takes the first with room in its queue)."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        to = getattr(pending_request.args[0], "to", None) if pending_request and pending_request.args else None
        if to in by_id:  # a front's channel to this replica
            return [[by_id[to]]]
        held = affinity.SHARED.lookup(keys_of_request(pending_request), by_id)
        return [[by_id[i]] for i in balance.SHARED.ranked(list(by_id), request_id(pending_request), held)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        balance.SHARED.placed(request_id(pending_request), replica_id.unique_id)
        landed = affinity.SHARED.count(keys_of_request(pending_request), replica_id.unique_id)
        if landed is not None:
            self.turns.inc(1, tags={"result": landed})

    def decrement_queue_len_cache(self, replica_id: ReplicaID) -> None:
        """A request the replica accepted finished (answered, failed or cancelled)."""
        super().decrement_queue_len_cache(replica_id)
        balance.SHARED.done(replica_id.unique_id)
