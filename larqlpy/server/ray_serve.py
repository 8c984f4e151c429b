"""`larqlpy serve` on Ray Serve: N replicas, each the whole server (server/main.py `ready`, app.py
`build_app`: its own engine thread, kept states and routes), behind one ingress that routes each
request to the replica holding its conversation's state (server/ray_router.py).

    client -> Ray Serve's HTTP proxy -> ingress (any route: the body read, its keys taken)
           -> StateRouter picks a replica -> Replica.run: the request through the server's own
              ASGI app, its response's messages streamed back -> the client

The ingress knows no route: every path goes to a replica as it came (method, path, query, headers,
body), so every route the server has works, /health and /metrics included (answered by the replica
the router picks). Only `GET /router` is the ingress's own: the router's counts (hit, moved, new).

A replica that dies: requests it had not begun to answer are sent again (at most `RETRIES` times) to
another replica, which finds the conversation's state in the shared state directory (each replica
writes its kept states there as it keeps them: state/prefix_cache.py), so the answer is the one the
dead replica would have given. A stream cut after its first bytes cannot be sent again: it ends.

Ray is optional (`pip install 'larqlpy[ray]'`); this module is imported only when `--ray` is given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import threading
from dataclasses import dataclass

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError, WorkerCrashedError
from ray.serve.config import RequestRouterConfig
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from larqlpy.batch.local import Setup
from larqlpy.batch.ray import connect
from larqlpy.config import ServeConfig, default_parallel
from larqlpy.server.affinity import SHARED as AFFINITY, Keys, keys_of
from larqlpy.server.app import build_app
from larqlpy.server.guard import error_response
from larqlpy.server.main import ready
from larqlpy.server.protocol import ApiError
from larqlpy.server.ray_metrics import Mirror
from larqlpy.server.ray_router import StateRouter
from larqlpy.server.scaling import Scale

APP = "larqlpy"
RETRIES = 3
DIED = (RayActorError, ActorUnavailableError, WorkerCrashedError)
RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[0-9a-f]{32})"')
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


@dataclass(frozen=True)
class Call:
    """One HTTP request as the ingress hands it to a replica, with its routing keys."""

    method: str
    path: str
    query: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    keys: Keys
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None


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
                while not out.empty() and not ended:  # what queued meanwhile goes as one item: a Ray item costs CPU
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

    async def run(self, call: Call):
        first = True
        async for item in asgi_call(self.app, call):
            if first:  # the replica's name goes with the status: the ingress records where the state is
                item, first = (item[0], self.name, *item[1:]), False
            yield item

    def __del__(self):
        """Ray Serve's shutdown: the requests in flight were waited for; the kept states are on disk."""
        if not hasattr(self, "mirror"):
            return  # it never came up
        self.mirror.close()
        self.served.preparing.shutdown(wait=False, cancel_futures=True)
        self.served.engine.stop(self.served.cfg.shutdown_grace_s)


class Ingress:
    """Every request to a replica, chosen by StateRouter from the keys of its body."""

    def __init__(self, replicas, max_body: int):
        self.replicas, self.max_body = replicas.options(stream=True), max_body

    def __serve_build_asgi_app__(self):
        return Starlette(routes=[Route("/router", self.router, methods=["GET"]),
                                 Route("/{path:path}", self.forward, methods=METHODS)])

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
                    bytes(body), keys_of(bytes(body)), scope.get("client"), scope.get("server"))
        for attempt in range(RETRIES + 1):
            stream = self.replicas.run.remote(call)
            try:
                _, replica, status, headers = await stream.__anext__()
                AFFINITY.record(call.keys, replica)
                if b"text/event-stream" in dict(headers).get(b"content-type", b""):
                    first = (await anext(stream, ("body", b"")))[1]
                    self._learn(call.keys, replica, first)
                    return StreamingResponse(_rest(stream, first), status_code=status, headers=_dict(headers))
                parts = [part async for _, part in stream]
            except DIED:
                stream.cancel()
                await asyncio.sleep(0.2 * (attempt + 1))  # the router hears of the death meanwhile
                continue
            whole = b"".join(parts)
            self._learn(call.keys, replica, whole)
            return Response(whole, status_code=status, headers=_dict(headers))
        return error_response(call.path, ApiError(503, f"the replicas serving this request died {RETRIES + 1} "
                                                       "times", kind="server_error"))

    @staticmethod
    def _learn(keys: Keys, replica: str, head: bytes) -> None:
        """A Responses answer's id, from the start of its body or its first event, is a key too."""
        m = RESPONSE_ID.search(head[:8192])
        if m:
            AFFINITY.record(Keys(), replica, m.group(1).decode())


async def _rest(stream, first: bytes):
    try:
        yield first
        async for _, part in stream:
            yield part
    except DIED:
        return  # the replica died mid-stream: the client sees the stream end unfinished
    finally:
        stream.cancel()


def _dict(headers) -> dict:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
            if k.lower() not in (b"content-length", b"transfer-encoding")}


def deployment_options(cfg: ServeConfig, scale: Scale) -> dict:
    """The replicas' Ray Serve options: their CPUs, how many, the router, and as many requests at
    once as one server takes before it answers 429 (its live slots and its queue)."""
    slots = cfg.parallel or default_parallel(scale.replica_cpus)
    if scale.autoscaled:  # more when a replica's requests pass what it decodes together: they queue
        lo, hi = scale.bounds
        scaling = {"autoscaling_config": {"min_replicas": lo, "max_replicas": hi,
                                          "initial_replicas": min(max(scale.replicas, lo), hi),
                                          "target_ongoing_requests": slots}}
    else:
        scaling = {"num_replicas": scale.replicas}
    return {"ray_actor_options": {"num_cpus": scale.replica_cpus}, "max_ongoing_requests": slots + cfg.queue_size,
            "graceful_shutdown_timeout_s": cfg.shutdown_grace_s + 5,
            "request_router_config": RequestRouterConfig(request_router_class=StateRouter), **scaling}


def application(setup: Setup, cfg: ServeConfig, scale: Scale):
    replica = serve.deployment(Replica).options(name="replica", **deployment_options(cfg, scale))
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(setup, cfg), cfg.max_body_bytes)


def serve_on_ray(address: str, setup: Setup, cfg: ServeConfig, scale: Scale, announce=None) -> None:
    """Deploy on the cluster at `address` ("local": one started here with the CPUs the replicas
    take) and serve until SIGTERM / Ctrl-C; then the application is deleted (each replica drains
    and saves its states) and a local cluster stopped."""
    ray, _ = connect(address, scale.most() * scale.replica_cpus)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        serve.run(application(setup, cfg, scale), name=APP, route_prefix="/")
        if announce is not None:
            announce({"replicas": scale.replicas, "url": f"http://{cfg.host}:{cfg.port}", "address": address,
                      "cluster": ray.get_runtime_context().gcs_address, "state_dir": cfg.state_dir})
        stop.wait()
        # each replica drains (its requests in flight finish) and saves; bounded, since a signal sent to
        # the terminal's process group also reaches a local cluster's own processes
        deleting = threading.Thread(target=serve.delete, args=(APP,), daemon=True)
        deleting.start()
        deleting.join(timeout=cfg.shutdown_grace_s + 30)
    finally:
        if address == "local":
            ray.shutdown()
