"""`larqlpy serve`'s HTTP side: starlette routes, SSE through sse-starlette, OpenAI-style errors.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /metrics.
A generation request is read into a `Request`, prepared into a sequence (every refusal a 400 before
it queues) on a small pool of threads, never on the event loop (the chat template renders there,
for up to its time bound, while /health and other requests are answered), and handed to the engine
thread; one event source (`events`) serves both the whole answer and the stream, and a client that
goes away cancels its sequence either way.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from larqlpy.config import ServeConfig
from larqlpy.errors import LarqlError
from larqlpy.pipeline.prepare import prepare_all
from larqlpy.pipeline.request import Request
from larqlpy.server import openai, protocol
from larqlpy.server.engine import Handle, QueueFull, ServeEngine, ShuttingDown
from larqlpy.server.metrics import Metrics
from larqlpy.server.protocol import ApiError
from larqlpy.state.prefix_cache import PrefixCache
from larqlpy.weights.loader import LoadedModel

LOG = logging.getLogger("uvicorn.error")  # uvicorn's own log: what the server prints
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
    preparing: ThreadPoolExecutor = field(default_factory=preparing_pool)


def served(request: HttpRequest) -> Served:
    return request.app.state.served


async def health(request: HttpRequest):
    s, snap = served(request), served(request).engine.snapshot
    return JSONResponse({"status": "ok" if s.engine.accepting else "shutting down", "model": s.name,
                         "live": snap.live, "waiting": snap.waiting})


async def models(request: HttpRequest):
    return JSONResponse({"object": "list", "data": [{"id": served(request).name, "object": "model", "created": 0,
                                                      "owned_by": "larqlpy"}]})


async def metrics(request: HttpRequest):
    return Response(served(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def completions(request: HttpRequest):
    return await generate(request, chat=False)


async def chat_completions(request: HttpRequest):
    return await generate(request, chat=True)


async def generate(request: HttpRequest, chat: bool):
    s = served(request)
    body = protocol.parse_body(await read_limited(request, s.cfg.max_body_bytes), s.cfg.max_body_bytes)
    protocol.check_model(body, s.name)
    stream, include_usage = openai.streaming(body)
    if chat and not s.has_template:
        raise ApiError(400, f"the model '{s.name}' has no chat template: use /v1/completions")
    try:
        req = openai.read_request(body, chat, s.cfg.max_tokens_limit, s.default)
        seqs = await asyncio.get_running_loop().run_in_executor(s.preparing, partial(prepare_all, s.loaded, req,
                                                                                     source=s.cache))
    except LarqlError as e:
        raise protocol.invalid(e) from None
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
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    if stream:
        return EventSourceResponse(streamed(request, handles, rid, chat, include_usage), ping=15, sep="\n")
    return await whole(request, handles, rid, chat)


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


async def whole(request: HttpRequest, handles: list[Handle], rid: str, chat: bool):
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
    return JSONResponse(openai.response(rid, chat, s.name, seqs))


async def streamed(request: HttpRequest, handles: list[Handle], rid: str, chat: bool, include_usage: bool):
    s, seqs = served(request), [h.seq for h in handles]
    deltas = [openai.ChatDeltas(seq.request.tools) for seq in seqs]
    pending = [[] for _ in seqs]  # log-probabilities of tokens whose text has not gone out yet
    sent, ended, cut = [0] * len(seqs), 0, False  # text sent per choice
    if chat:
        for i in range(len(seqs)):
            yield json.dumps(openai.chunk(rid, chat, s.name, None, None, first=True, index=i))
    async with aclosing(events(request, handles)) as source:
        async for i, kind, value in source:
            seq = seqs[i]
            if kind == "error":
                yield json.dumps(ApiError(500, value, kind="server_error").body())
                return
            if kind == "token":
                pending[i].append((value.id, value.logprob))
                for out in (deltas[i].feed(value.text) if chat else [value.text]) if value.text else []:
                    yield json.dumps(openai.chunk(rid, chat, s.name, out, None, index=i,
                                                  lps=openai.logprobs(seq, chat, pending[i], sent[i])))
                    pending[i] = []
                sent[i] += len(value.text)
                continue
            cut, ended = cut or kind == "cut", ended + 1
            for out in deltas[i].close() if chat else []:
                yield json.dumps(openai.chunk(rid, chat, s.name, out, None, index=i))
            finish = "tool_calls" if deltas[i].n else seq.finish_reason or "length"
            last = openai.chunk(rid, chat, s.name, None if chat else "", finish, index=i,
                                lps=openai.logprobs(seq, chat, pending[i], sent[i]) if pending[i] else None)
            last["larqlpy"] = openai.extra(seq)
            yield json.dumps(last)
    if ended < len(seqs):
        return  # the client went away
    if cut:  # ended where they stood, their finish "length"; the error says why; then [DONE]
        yield json.dumps(ApiError(503, CUT, kind="server_error").body())
        yield "[DONE]"
        return
    if include_usage:
        yield json.dumps({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                          "created": int(time.time()), "model": s.name, "choices": [],
                          "usage": openai.usage(seqs)})
    s.metrics.served(seqs)
    yield "[DONE]"


async def on_api_error(request: HttpRequest, e: ApiError):
    served(request).metrics.failed(e.status)
    return JSONResponse(e.body(), status_code=e.status)


async def on_http_error(request: HttpRequest, e: HTTPException):
    served(request).metrics.failed(e.status_code)
    return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)


async def on_error(request: HttpRequest, e: Exception):
    served(request).metrics.failed(500)
    return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}", kind="server_error").body(), status_code=500)


ROUTES = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
          Route("/v1/completions", completions, methods=["POST"]),
          Route("/v1/chat/completions", chat_completions, methods=["POST"])]


def build_app(s: Served) -> Starlette:
    @asynccontextmanager
    async def lifespan(app):
        yield
        s.preparing.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, s.engine.stop, s.cfg.shutdown_grace_s)

    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers={
        ApiError: on_api_error, HTTPException: on_http_error, Exception: on_error})
    app.state.served = s
    app.add_middleware(Guard, served=s)
    return app


class Guard:
    """Before any route: the bearer token (when the server has one) and the body size."""

    def __init__(self, app, served: Served):
        self.app, self.served = app, served

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.served.cfg.api_key
        if key is not None:
            given = headers.get("authorization", "")
            if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())):
                return await self.refuse(scope, receive, send, ApiError(
                    401, "a valid API key is required (Authorization: Bearer ...)", kind="authentication_error",
                    code="invalid_api_key"))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.served.cfg.max_body_bytes):
            return await self.refuse(scope, receive, send, ApiError(
                413, f"the request body is over the limit of {self.served.cfg.max_body_bytes:,} bytes"))
        return await self.app(scope, receive, send)

    async def refuse(self, scope, receive, send, e: ApiError):
        self.served.metrics.failed(e.status)
        await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)


async def read_limited(request: HttpRequest, limit: int) -> bytes:
    """The body, refused once it passes `limit` (a chunked body declares no length). A client that
    gives up halfway is one line in the log."""
    parts, n = [], 0
    try:
        async for part in request.stream():
            n += len(part)
            if n > limit:
                raise ApiError(413, f"the request body is over the limit of {limit:,} bytes")
            parts.append(part)
    except ClientDisconnect:
        client = request.client
        LOG.warning("a client%s went away while sending its request body (%s bytes of it came)",
                    f" ({client.host}:{client.port})" if client else "", f"{n:,}")
        raise ApiError(499, "the client went away while sending its request body") from None
    return b"".join(parts)
