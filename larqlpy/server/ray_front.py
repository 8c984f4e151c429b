"""The HTTP side of `larqlpy serve --ray`, in the process that runs the command: every request goes
to the replica StateRouter picks (it runs here, beside the map of server/affinity.py) from the keys
of its body, and its answer comes back as the replica streams it (server/ray_replica.py).

    client -> this process (uvicorn: the body read, its keys taken) -> StateRouter picks a replica
           -> Replica.run over gRPC: status and first event back on the call; an SSE answer's
              later events on that replica's one channel to here, a decode step's events together

No Ray proxy and no ingress actor: an event crosses one process boundary, not three. Every path goes
to a replica as it came (method, path, query, headers, body); only `GET /router` is the front's own:
the router's counts (hit, moved, new).

A replica that dies: requests it had not begun to answer are sent again (at most `RETRIES` times) to
another replica, which finds the conversation's state in the shared state directory. A stream cut
after its first bytes cannot be sent again: it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from larqlpy.server.affinity import SHARED as AFFINITY, Keys, keys_of
from larqlpy.server.guard import error_response
from larqlpy.server.protocol import ApiError
from larqlpy.server.ray_replica import DIED, Call

RETRIES = 3
RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[0-9a-f]{32})"')
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


class Front:
    def __init__(self, handle, max_body: int):
        self.handle, self.max_body, self.name = handle, max_body, uuid.uuid4().hex
        self.waiting: dict[str, tuple[str, asyncio.Queue]] = {}  # request -> (replica, its later events)
        self.channels: dict[str, asyncio.Task] = {}  # replica -> the task reading its channel

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/router", self.router, methods=["GET"]),
                                 Route("/{path:path}", self.forward, methods=METHODS)], lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """The router on this event loop (no hand-over between loops for each event), and the replicas
        reached over gRPC, not as Ray actor calls."""
        self.handle._init(_run_router_in_separate_loop=False)
        self.replicas = self.handle.options(stream=True, _by_reference=False, response_serialization="pickle")
        yield
        for task in self.channels.values():
            task.cancel()

    async def router(self, request: HttpRequest):
        return JSONResponse(AFFINITY.stats())

    async def forward(self, request: HttpRequest):
        body = bytearray()
        async for chunk in request.stream():  # past the limit, the replica's guard says 413 from the headers
            body += chunk
            if len(body) > self.max_body:
                break
        scope = request.scope
        call = Call(request.method, scope["path"], scope.get("query_string", b""), tuple(scope["headers"]),
                    bytes(body), keys_of(bytes(body)), scope.get("client"), scope.get("server"),
                    rid=uuid.uuid4().hex, front=self.name)
        for attempt in range(RETRIES + 1):
            self.waiting[call.rid] = ("", asyncio.Queue())  # before the call: its events may come first
            stream = self.replicas.run.remote(call)
            try:
                _, replica, status, headers = await stream.__anext__()
                AFFINITY.record(call.keys, replica)
                if b"text/event-stream" in dict(headers).get(b"content-type", b""):
                    self.waiting[call.rid] = (replica, self.waiting[call.rid][1])
                    self._listen(replica)
                    first = await anext(stream, None)
                    if first is None:
                        self.waiting.pop(call.rid, None)
                    self._learn(call.keys, replica, first[1] if first else b"")
                    return StreamingResponse(self._rest(stream, call.rid, first and first[1]), status_code=status,
                                             headers=_dict(headers))
                whole = b"".join([part async for _, part in stream])
            except DIED:
                stream.cancel()
                self.waiting.pop(call.rid, None)
                await asyncio.sleep(0.2 * (attempt + 1))  # the router hears of the death meanwhile
                continue
            self.waiting.pop(call.rid, None)
            self._learn(call.keys, replica, whole)
            return Response(whole, status_code=status, headers=_dict(headers))
        return error_response(call.path, ApiError(503, f"the replicas serving this request died {RETRIES + 1} "
                                                       "times", kind="server_error"))

    def _listen(self, replica: str) -> None:
        """Read `replica`'s channel, if this front does not yet."""
        if replica not in self.channels:
            self.channels[replica] = asyncio.create_task(self._channel(replica))

    async def _channel(self, replica: str) -> None:
        stream = self.replicas.channel.remote(Call("", "", b"", (), b"", Keys(), front=self.name, to=replica))
        opened = False  # not if it reached another replica: `replica` is gone
        try:
            async for batch in stream:
                opened = True
                for rid, data in batch:
                    if rid in self.waiting:
                        self.waiting[rid][1].put_nowait(data)
        except DIED:
            opened = False  # the replica died: its streams end where they were cut
        finally:
            stream.cancel()
            self.channels.pop(replica, None)
        ours = [later for where, later in self.waiting.values() if where == replica]
        if not opened:
            for later in ours:
                later.put_nowait(None)
        elif ours:  # it closed while idle (so a replica scaled down can go) as a stream began
            self._listen(replica)

    async def _rest(self, stream, rid: str, first: bytes | None):
        """An SSE answer: its first event, then what its replica's channel brings, to its end."""
        try:
            if first is None:
                return
            yield first
            later = self.waiting[rid][1]
            while (data := await later.get()) is not None:
                yield data
        finally:
            self.waiting.pop(rid, None)
            stream.cancel()  # the replica's app hears the client went away, if it had not finished

    @staticmethod
    def _learn(keys: Keys, replica: str, head: bytes) -> None:
        """A Responses answer's id, from the start of its body or its first event, is a key too."""
        m = RESPONSE_ID.search(head[:8192])
        if m:
            AFFINITY.record(Keys(), replica, m.group(1).decode())


def _dict(headers) -> dict:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
            if k.lower() not in (b"content-length", b"transfer-encoding")}
