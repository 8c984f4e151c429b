"""`larqlpy serve`'s HTTP side: starlette routes, SSE through sse-starlette, errors in the shape of
the API a route belongs to (server/guard.py).

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (OpenAI's),
POST /v1/messages, POST /v1/messages/count_tokens (Anthropic's), POST /v1/responses, GET and DELETE
/v1/responses/{id} (OpenAI's Responses API: server/responses_http.py), GET /metrics. A generation
request is read into a `Request`, prepared into a sequence (every refusal a 400 before it queues)
on a small pool of threads, never on the event loop (the chat template renders there, for up to its
time bound, while /health and other requests are answered), and handed to the engine thread; one
event source (`events`) serves both the whole answer and the stream, and a client that
goes away cancels its sequence either way. POST /v1/embeddings (OpenAI's, server/embeddings.py):
each input a sequence that prefills and pools, through the same queue.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from contextlib import aclosing, asynccontextmanager
from functools import partial

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from larqlpy.pipeline.prepare import prompt_of
from larqlpy.server import anthropic, anthropic_events, embeddings, openai, responses_http
from larqlpy.server.engine import Handle
from larqlpy.server.flow import CUT, Served, body_of, events, prepared, served, submit, whole
from larqlpy.server.guard import Guard, error_response
from larqlpy.server.protocol import ApiError, boolean


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
    body = await body_of(request, chat)
    stream, include_usage = openai.streaming(body)
    handles = submit(s, await prepared(s, lambda: openai.read_request(body, chat, s.cfg.max_tokens_limit, s.default)))
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    if stream:
        return EventSourceResponse(streamed(request, handles, rid, chat, include_usage), ping=15, sep="\n")
    return await whole(request, handles, partial(openai.response, rid, chat, s.name))


async def messages(request: HttpRequest):
    """Anthropic's Messages API, through the same pipeline as chat completions."""
    s = served(request)
    body = await body_of(request, chat=True)
    stream = boolean(body, "stream")
    handles = submit(s, await prepared(s, lambda: anthropic.read_request(body, s.cfg.max_tokens_limit, s.default)))
    mid = "msg_" + secrets.token_hex(12)
    if stream:
        return EventSourceResponse(anthropic_streamed(request, handles[0], mid), ping=15, sep="\n",
                                   ping_message_factory=anthropic.ping)
    return await whole(request, handles, lambda seqs: anthropic_events.message(mid, s.name, seqs[0]))


async def count_tokens(request: HttpRequest):
    """The prompt a /v1/messages body makes, as the chat template renders it, counted."""
    s = served(request)
    body = await body_of(request, chat=True)
    ids = await prepared(s, lambda: anthropic.read_request(body, default=s.default, counting=True), prompt_of)
    return JSONResponse({"input_tokens": len(ids)})


async def embed(request: HttpRequest):
    """OpenAI's embeddings: each input a sequence the engine thread prefills beside generation and pools."""
    s = served(request)
    body = await body_of(request, chat=False)
    read = partial(embeddings.read_request, body, s.cfg, s.loaded.config.hidden_size)
    handles = submit(s, await prepared(s, read, embeddings.sequences))
    return await whole(request, handles, partial(embeddings.response, s.name))


async def streamed(request: HttpRequest, handles: list[Handle], rid: str, chat: bool, include_usage: bool):
    s, seqs = served(request), [h.seq for h in handles]
    deltas = [openai.ChatDeltas(seq.request.tools, seq.request.reasoning) for seq in seqs]
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


async def anthropic_streamed(request: HttpRequest, handle: Handle, mid: str):
    """A message's events (anthropic_events.Events) as server-sent events; a failed step an `error` event."""
    s, seq = served(request), handle.seq
    shaped = anthropic_events.Events(mid, s.name, seq)
    for name, data in shaped.start():
        yield {"event": name, "data": json.dumps(data)}
    async with aclosing(events(request, [handle])) as source:
        async for _, kind, value in source:
            if kind == "token":
                out = shaped.feed(value.text) if value.text else []
            elif kind == "done":
                out = shaped.finish(seq)
                s.metrics.served([seq])
            elif kind == "cut":  # the server shut down before the answer was whole
                out = shaped.cut() + [anthropic.error_event(CUT, 503)]
            else:
                out = [anthropic.error_event(value)]
            for name, data in out:
                yield {"event": name, "data": json.dumps(data)}


async def on_api_error(request: HttpRequest, e: ApiError):
    served(request).metrics.failed(e.status)
    return error_response(request.url.path, e)


async def on_http_error(request: HttpRequest, e: HTTPException):
    served(request).metrics.failed(e.status_code)
    return error_response(request.url.path, ApiError(e.status_code, str(e.detail)))


async def on_error(request: HttpRequest, e: Exception):
    served(request).metrics.failed(500)
    return error_response(request.url.path, ApiError(500, f"{type(e).__name__}: {e}", kind="server_error"))


ROUTES = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
          Route("/v1/completions", completions, methods=["POST"]),
          Route("/v1/chat/completions", chat_completions, methods=["POST"]),
          Route("/v1/embeddings", embed, methods=["POST"]),
          Route("/v1/messages", messages, methods=["POST"]),
          Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]), *responses_http.ROUTES]


def build_app(s: Served) -> Starlette:
    @asynccontextmanager
    async def lifespan(app):
        yield
        s.preparing.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, s.engine.stop, s.cfg.shutdown_grace_s)

    app = Starlette(routes=ROUTES, lifespan=lifespan, exception_handlers={
        ApiError: on_api_error, HTTPException: on_http_error, Exception: on_error})
    app.state.served = s
    app.add_middleware(Guard, cfg=s.cfg, metrics=s.metrics)
    return app
