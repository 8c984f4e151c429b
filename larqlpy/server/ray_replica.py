"""A replica of `larqlpy serve --ray` (server/ray_serve.py): one whole server, and the request as
the front (server/ray_front.py) hands it over.

An answer comes back as items of a Ray Serve stream: its status, then its body. An SSE answer's
first event comes that way too (its time to first token, and the Responses id the front learns);
its later events go through the replica's one `channel` to the front, which carries, as one item,
what every stream of the replica queued meanwhile -- a decode step's events of all its sequences.
Each streamed item costs the replica about as much CPU as decoding a token (gRPC and Ray Serve's
bookkeeping), so one item per step instead of one per sequence and step is what keeps the replicas'
cores decoding.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from dataclasses import dataclass

import grpc
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, WorkerCrashedError

from larqlpy.batch.local import Setup
from larqlpy.config import ServeConfig
from larqlpy.server.affinity import Keys
from larqlpy.server.app import build_app
from larqlpy.server.main import ready
from larqlpy.server.ray_metrics import Mirror

GATHER_S = 0.005
IDLE_S = 2.0
# a replica gone: as Ray says it, or as the gRPC call to it breaks (Ray Serve maps only UNAVAILABLE)
DIED = (RayActorError, ActorUnavailableError, WorkerCrashedError, grpc.aio.AioRpcError)


@dataclass(frozen=True)
class Call:
    """One HTTP request as the front hands it to a replica, with its routing keys."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    keys: Keys
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None
    rid: str = ""  # the front's name for it: an SSE answer's later events come back through its channel
    front: str = ""  # that front's channel
    to: str | None = None  # a channel call: the replica it must go to


async def asgi_call(app, call: Call):
    """`call` through the ASGI `app`: ("start", status, headers), then ("body", bytes) ... When the
    caller stops reading (its client went away), the app hears a disconnect."""
    out: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    given = False

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method,
             "scheme": "http", "path": call.path, "raw_path": call.path.encode(), "root_path": "",
             "query_string": call.query, "headers": list(call.headers), "client": call.client,
             "server": call.server, "state": {}}
    task = asyncio.create_task(app(scope, receive, out.put))
    task.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while (m := await out.get()) is not None:
            if m["type"] == "http.response.start":
                yield "start", m["status"], tuple(m.get("headers", ()))
            elif m["type"] == "http.response.body" and m.get("body"):
                body, ended = m["body"], False
                while not out.empty() and not ended:  # what queued meanwhile goes as one item
                    more = out.get_nowait()
                    ended = more is None
                    body += b"" if ended else more.get("body", b"")
                yield "body", body
                if ended:
                    break
        task.result()
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5)
            except (asyncio.TimeoutError, Exception):
                pass


class Replica:
    """One server: the model loaded once, `ready` as `larqlpy serve` makes it, kept states written
    to its own directory under the shared `state_dir` (named by its Ray Serve replica id)."""

    def __init__(self, setup: Setup, cfg: ServeConfig):
        self.name = serve.get_replica_context().replica_id.unique_id
        if cfg.state_dir is not None:
            cfg = dataclasses.replace(cfg, replica=self.name)
        self.served = ready(setup.load(), cfg)
        self.app = build_app(self.served)
        self.mirror = Mirror(self.served.metrics.registry, self.name).start()
        self.outboxes: dict[str, asyncio.Queue] = {}  # a front's name -> (request, bytes | None) for its channel
        self.streaming: Counter = Counter()  # a front's name -> its SSE answers under way here

    async def run(self, call: Call):
        """("start", replica, status, headers), the first ("body", bytes); an SSE answer's later
        events go through the channel of `call.front` (`channel`), the rest of others' bodies here.
        Open until the app is done, so Ray Serve counts the request as long as the engine runs it."""
        sse, sent = False, 0  # items sent through the call
        out = self.outboxes.setdefault(call.front, asyncio.Queue())
        try:
            async for item in asgi_call(self.app, call):
                if item[0] == "start":  # the replica's name goes with the status: the front records where the state is
                    sse = b"text/event-stream" in dict(item[2]).get(b"content-type", b"")
                    item = (item[0], self.name, *item[1:])
                    self.streaming[call.front] += sse
                if sse and sent == 2:
                    out.put_nowait((call.rid, item[1]))
                else:
                    sent += 1
                    yield item
        finally:
            if sse and sent == 2:
                out.put_nowait((call.rid, None))  # its end
            self.streaming[call.front] -= sse

    async def channel(self, call: Call):
        """The events of every SSE answer this replica streams to `call.front`, as they queued: one
        item for the events of a decode step's sequences, where each would cost one gRPC message."""
        if call.to != self.name:
            return  # the replica it was for is gone: the router sent it here
        out = self.outboxes.setdefault(call.front, asyncio.Queue())
        yield []  # opened: the front knows it reached its replica
        while True:
            try:
                batch = [await asyncio.wait_for(out.get(), IDLE_S)]
            except asyncio.TimeoutError:
                if not self.streaming[call.front]:
                    return  # closed while idle, so a replica scaled down is not held by it
                continue
            await asyncio.sleep(GATHER_S)  # the step's other sequences' events, on their way
            while not out.empty():
                batch.append(out.get_nowait())
            yield batch

    def __del__(self):
        """Ray Serve's shutdown: the requests in flight were waited for; the kept states are on disk."""
        if not hasattr(self, "mirror"):
            return  # it never came up
        self.mirror.close()
        self.served.preparing.shutdown(wait=False, cancel_futures=True)
        self.served.engine.stop(self.served.cfg.shutdown_grace_s)
