"""`larqlpy serve`'s HTTP side: starlette routes, SSE through sse-starlette, OpenAI-style errors.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from larqlpy.config import ServeConfig
from larqlpy.engines import EngineSpec
from larqlpy.errors import LarqlError
from larqlpy.model.chat_template import ChatTemplate
from larqlpy.runner import fit_context
from larqlpy.server import protocol
from larqlpy.server.engine import Pending, QueueFull, ServeEngine, ShuttingDown
from larqlpy.server.metrics import Metrics
from larqlpy.server.protocol import ApiError, Generation


class StopText:
    """`stop` strings over streamed text: holds back what could still begin a stop string, and cuts
    the text where one appears."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.held = stops, ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string ended it)."""
        if not self.stops:
            return text, False
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.held = self.held[:cut], ""
            return out, True
        keep = min(self.hold, len(self.held))
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass
class Served:
    """Everything a route needs: the loaded model, its name, the engine, the settings."""

    loaded: object
    name: str
    engine: ServeEngine
    cfg: ServeConfig
    spec: EngineSpec
    metrics: Metrics


def build_app(served: Served) -> Starlette:
    try:
        template = ChatTemplate.for_tokenizer(served.loaded.tokenizer)
    except LarqlError:
        template = None  # chat requests are refused; completions work

    async def health(request: Request):
        return JSONResponse({"status": "ok" if served.engine.accepting else "shutting down", "model": served.name,
                             "live": served.engine.live(), "waiting": served.engine.waiting()})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                                          "owned_by": "larqlpy"}]})

    async def metrics(request: Request):
        return Response(served.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool):
        body = protocol.parse_body(await read_limited(request, served.cfg.max_body_bytes), served.cfg.max_body_bytes)
        g = protocol.check(body, chat, served.name, served.cfg.max_tokens_limit, served.spec)
        ids, notes, gen = prompt_ids(g)
        try:
            p = served.engine.submit(ids, g.spec, gen)
        except QueueFull:
            raise ApiError(429, "too many requests are waiting; retry later", kind="rate_limit_error") from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down", kind="server_error") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        if g.stream:
            return EventSourceResponse(stream(request, p, g, rid, notes), ping=15, sep="\n")
        return await whole(request, p, g, rid, notes)

    def prompt_ids(g: Generation):
        tok = served.loaded.tokenizer
        try:
            if g.chat:
                if template is None:
                    raise ApiError(400, f"the model '{served.name}' has no chat template: use /v1/completions")
                ids = tok.encode(template.render(g.messages), add_bos=False)
            elif isinstance(g.prompt, list):
                ids = list(g.prompt)
                if max(ids) >= served.loaded.config.vocab_size or min(ids) < 0:
                    raise ApiError(400, f"'prompt' token ids must be in [0, {served.loaded.config.vocab_size})",
                                   param="prompt")
            else:
                ids = tok.encode(g.prompt)
            gen, notes = fit_context(g.gen, len(ids), served.loaded.config.max_position_embeddings)
        except LarqlError as e:
            raise ApiError(400, str(e)) from None
        return ids, notes, gen

    def extra(p: Pending, out: list[int], notes) -> dict:
        return {"engine": p.spec.describe(), "cached_tokens": p.cached, "continuation_refused": p.refused,
                "tokens": out, "notes": notes}

    async def next_event(request: Request, p: Pending):
        while True:
            try:
                return await asyncio.wait_for(p.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    served.engine.cancel(p)
                    return None

    async def whole(request: Request, p: Pending, g: Generation, rid: str, notes):
        stops, texts, finish, out = StopText(g.stop), [], "length", []
        while True:
            item = await next_event(request, p)
            if item is None:
                return Response(status_code=499)
            kind, value = item
            if kind == "error":
                raise ApiError(500, value, kind="server_error")
            if kind == "done":
                texts.append(stops.flush())
                break
            out.append(value.id)
            text, stopped = stops.feed(value.text)
            texts.append(text)
            finish = value.finish_reason or finish
            if stopped:
                served.engine.cancel(p)
                finish = "stop"
                break
        use = protocol.usage(len(p.ids), len(out), p.cached)
        served.metrics.served(len(p.ids), len(out), p.cached)
        return JSONResponse(protocol.response(rid, g, served.name, "".join(texts), finish, use, extra(p, out, notes)))

    async def stream(request: Request, p: Pending, g: Generation, rid: str, notes):
        stops, finish, out = StopText(g.stop), "length", []
        try:
            if g.chat:
                yield json.dumps(protocol.chunk(rid, g, served.name, None, None, first=True))
            while True:
                kind, value = await p.events.get()
                if kind == "error":
                    yield json.dumps(ApiError(500, value, kind="server_error").body())
                    return
                if kind == "done":
                    tail = stops.flush()
                    if tail:
                        yield json.dumps(protocol.chunk(rid, g, served.name, tail, None))
                    break
                out.append(value.id)
                text, stopped = stops.feed(value.text)
                finish = value.finish_reason or finish
                if stopped:
                    finish = "stop"
                    served.engine.cancel(p)
                if text:
                    yield json.dumps(protocol.chunk(rid, g, served.name, text, None))
                if stopped:
                    break
            last = protocol.chunk(rid, g, served.name, None if g.chat else "", finish)
            last["larqlpy"] = extra(p, out, notes)
            yield json.dumps(last)
            use = protocol.usage(len(p.ids), len(out), p.cached)
            if g.include_usage:
                yield json.dumps({"id": rid, "object": last["object"], "created": last["created"], "model": served.name,
                                  "choices": [], "usage": use})
            served.metrics.served(len(p.ids), len(out), p.cached)
            yield "[DONE]"
        finally:  # a client that disconnects cancels its generation and frees its slot
            served.engine.cancel(p)

    async def on_api_error(request: Request, e: ApiError):
        served.metrics.failed(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    async def on_http_error(request: Request, e: HTTPException):
        served.metrics.failed(e.status_code)
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def on_error(request: Request, e: Exception):
        served.metrics.failed(500)
        return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}", kind="server_error").body(), status_code=500)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.get_running_loop().run_in_executor(None, served.engine.stop, served.cfg.shutdown_grace_s)

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_error},
        lifespan=lifespan)
    app.add_middleware(Guard, served=served)
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
                return await self.refuse(scope, receive, send, ApiError(401, "a valid API key is required (Authorization: Bearer ...)",
                                                        kind="authentication_error", code="invalid_api_key"))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.served.cfg.max_body_bytes):
            return await self.refuse(scope, receive, send, ApiError(413, f"the request body is over the limit of "
                                                         f"{self.served.cfg.max_body_bytes:,} bytes"))
        return await self.app(scope, receive, send)

    async def refuse(self, scope, receive, send, e: ApiError):
        self.served.metrics.failed(e.status)
        await JSONResponse(e.body(), status_code=e.status)(scope, receive, send)


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, refused once it passes `limit` (a chunked body declares no length)."""
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise ApiError(413, f"the request body is over the limit of {limit:,} bytes")
        parts.append(part)
    return b"".join(parts)
