"""What every route's flow shares, whatever API it speaks: the `Served` state (the model, the
engine, the kept states, the settings), a body read and checked, a request prepared on the
preparing pool (never on the event loop) and handed to the engine thread, its events as they come,
and the whole answer once every choice is done."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from larqlpy.config import ServeConfig
from larqlpy.errors import LarqlError
from larqlpy.pipeline.prepare import prepare_all
from larqlpy.pipeline.request import Request
from larqlpy.server import protocol
from larqlpy.server.engine import Handle, QueueFull, ServeEngine, ShuttingDown
from larqlpy.server.guard import read_limited
from larqlpy.server.metrics import Metrics
from larqlpy.server.protocol import ApiError
from larqlpy.server.response_store import ResponseStore
from larqlpy.state.prefix_cache import PrefixCache
from larqlpy.weights.loader import LoadedModel

PREPARING = 4  # threads preparing requests: a template stuck till its bound holds one, not the others


def preparing_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(PREPARING, thread_name_prefix="larqlpy-prepare")


@dataclass
class Served:
    """Everything a route needs: the loaded model, its name, the engine and its kept states, the
    settings, and the engine requests run when they name none."""

    loaded: LoadedModel
    name: str
    engine: ServeEngine
    cache: PrefixCache
    cfg: ServeConfig
    default: Request
    metrics: Metrics
    has_template: bool
    responses: ResponseStore
    preparing: ThreadPoolExecutor = field(default_factory=preparing_pool)


def served(request: HttpRequest) -> Served:
    return request.app.state.served


async def body_of(request: HttpRequest, chat: bool) -> dict:
    s = served(request)
    body = protocol.parse_body(await read_limited(request, s.cfg.max_body_bytes), s.cfg.max_body_bytes)
    protocol.check_model(body, s.name)
    if chat and not s.has_template:
        raise ApiError(400, f"the model '{s.name}' has no chat template: use /v1/completions")
    return body


async def prepared(s: Served, read, work=None):
    """The body read into a Request (`read`, here), then `work` on it (its sequences, by default)
    on the preparing pool; a refusal is a 400."""
    work = work or partial(prepare_all, source=s.cache)
    try:
        req = read()
        return await asyncio.get_running_loop().run_in_executor(s.preparing, partial(work, s.loaded, req))
    except LarqlError as e:
        raise protocol.invalid(e) from None


def submit(s: Served, seqs) -> list[Handle]:
    handles = []
    try:
        for seq in seqs:
            handles.append(s.engine.submit(seq))
    except (QueueFull, ShuttingDown) as e:
        for h in handles:
            s.engine.cancel(h)
        if isinstance(e, QueueFull):
            raise ApiError(429, "too many requests are waiting; retry later", kind="rate_limit_error") from None
        raise ApiError(503, "the server is shutting down", kind="server_error") from None
    return handles


async def events(request: HttpRequest, handles: list[Handle]) -> AsyncIterator[tuple[int, str, object]]:
    """The request's events as they come, with the choice they belong to: (i, "token", Token) ...,
    then (i, "done", seq) or (i, "error", message) for each choice. Ends early when the client goes
    away; then, or when its reader stops, the choices still going are cancelled."""
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(i: int, h: Handle) -> None:
        kind = "token"
        while kind == "token":
            kind, value = await h.events.get()
            merged.put_nowait((i, kind, value))

    tasks = [asyncio.create_task(forward(i, h)) for i, h in enumerate(handles)]
    going = set(range(len(handles)))
    try:
        while going:
            try:
                i, kind, value = await asyncio.wait_for(merged.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if kind != "token":
                going.discard(i)
            yield i, kind, value
    finally:
        for t in tasks:
            t.cancel()
        for i in going:
            served(request).engine.cancel(handles[i])


CUT = "the server shut down before this answer was complete"


async def whole(request: HttpRequest, handles: list[Handle], shape):
    """The answer once every choice is done, in `shape` (its sequences -> the body)."""
    s, done = served(request), 0
    async with aclosing(events(request, handles)) as source:
        async for _, kind, value in source:
            if kind == "error":
                raise ApiError(500, value, kind="server_error")
            if kind == "cut":
                raise ApiError(503, CUT, kind="server_error")
            done += kind == "done"
    if done < len(handles):
        return Response(status_code=499)  # the client went away
    seqs = [h.seq for h in handles]
    s.metrics.served(seqs)
    return JSONResponse(shape(seqs))


