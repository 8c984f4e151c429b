"""The Responses API's routes: POST /v1/responses (whole or streamed), GET and DELETE
/v1/responses/{id}. A response goes through the same pipeline as a chat completion of its whole
conversation; a stored one is written before its answer goes out, so the next response of its chain
can name it at once."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from functools import partial

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from larqlpy.errors import LarqlError
from larqlpy.server import protocol, responses, responses_out
from larqlpy.server.engine import Handle
from larqlpy.server.flow import CUT, Served, body_of, events, prepared, served, submit, whole
from larqlpy.server.protocol import ApiError, boolean
from larqlpy.server.response_store import Stored, new_id
from larqlpy.server.responses import Chain


async def create(request: HttpRequest):
    s = served(request)
    body = await body_of(request, chat=True)
    stream = boolean(body, "stream")
    chain = await _read(s, body)
    handles = submit(s, await prepared(s, lambda: chain.req))
    rid = new_id()
    if stream:
        return EventSourceResponse(streamed(request, handles[0], rid, chain), ping=15, sep="\n")
    made = {}

    def shape(seqs):
        made["r"] = responses_out.response(rid, s.name, chain.echo, time.time(), responses_out.output(seqs[0]),
                                           seqs[0])
        return made["r"]

    answer = await whole(request, handles, shape)
    if "r" in made:
        await _keep(s, rid, chain, made["r"])
    return answer


async def _read(s: Served, body: dict) -> Chain:
    """The body read on the preparing pool (a previous response may be read from its file)."""
    read = partial(responses.read_request, body, s.responses, s.cfg.max_tokens_limit, s.default)
    try:
        return await asyncio.get_running_loop().run_in_executor(s.preparing, read)
    except responses.PreviousNotFound as e:
        raise ApiError(404, str(e), param="previous_response_id", code="previous_response_not_found") from None
    except LarqlError as e:
        raise protocol.invalid(e) from None


async def _keep(s: Served, rid: str, chain: Chain, answer: dict) -> None:
    if chain.store:
        stored = Stored(answer, (*chain.messages, responses_out.assistant(answer["output"])))
        await asyncio.get_running_loop().run_in_executor(s.preparing, s.responses.put, rid, stored)


async def streamed(request: HttpRequest, handle: Handle, rid: str, chain: Chain):
    s, seq = served(request), handle.seq
    shaped = responses_out.Events(rid, s.name, chain.echo, seq)
    for e in shaped.start():
        yield responses_out.sse(e)
    async with aclosing(events(request, [handle])) as source:
        async for _, kind, value in source:
            if kind == "token":
                out = shaped.feed(value.text) if value.text else []
            elif kind == "done":
                out, answer = shaped.finish(seq)
                await _keep(s, rid, chain, answer)
                s.metrics.served([seq])
            else:  # a failed step, or the server shut down before the answer was whole
                out = (shaped.cut() if kind == "cut" else []) + [shaped.error(CUT if kind == "cut" else value)]
            for e in out:
                yield responses_out.sse(e)


async def get(request: HttpRequest):
    stored = await _stored(request)
    return JSONResponse(stored.response)


async def delete(request: HttpRequest):
    s, rid = served(request), request.path_params["rid"]
    await _stored(request)
    await asyncio.get_running_loop().run_in_executor(s.preparing, s.responses.delete, rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


async def _stored(request: HttpRequest) -> Stored:
    s, rid = served(request), request.path_params["rid"]
    try:
        found = await asyncio.get_running_loop().run_in_executor(s.preparing, s.responses.get, rid)
    except LarqlError as e:
        raise ApiError(500, str(e), kind="server_error") from None
    if found is None:
        raise ApiError(404, f"the response '{rid}' is not stored here", param="response_id", code="not_found")
    return found


ROUTES = [Route("/v1/responses", create, methods=["POST"]), Route("/v1/responses/{rid}", get, methods=["GET"]),
          Route("/v1/responses/{rid}", delete, methods=["DELETE"])]
