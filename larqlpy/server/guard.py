"""Before any route: the API key and the body's declared size (`Guard`); the body read within its
limit (`read_limited`); and a refusal in the shape of the API its path belongs to (`error_response`:
Anthropic's under /v1/messages, OpenAI's elsewhere)."""

from __future__ import annotations

import hmac
import logging

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from larqlpy.config import ServeConfig
from larqlpy.server import anthropic
from larqlpy.server.metrics import Metrics
from larqlpy.server.protocol import ApiError

LOG = logging.getLogger("uvicorn.error")  # uvicorn's own log: what the server prints


def error_response(path: str, e: ApiError) -> JSONResponse:
    body = anthropic.error_body(e) if anthropic.owns(path) else e.body()
    return JSONResponse(body, status_code=e.status)


def keys_given(headers: dict[str, str]) -> list[str]:
    """The keys a request carries: OpenAI's `Authorization: Bearer KEY` and Anthropic's `x-api-key: KEY`
    (Claude Code sends the one or the other, by which of its variables is set)."""
    bearer = headers.get("authorization", "")
    return ([bearer[7:]] if bearer.startswith("Bearer ") else []) + \
        ([headers["x-api-key"]] if "x-api-key" in headers else [])


class Guard:
    """Before any route: the API key (when the server has one) and the body size."""

    def __init__(self, app, cfg: ServeConfig, metrics: Metrics):
        self.app, self.cfg, self.metrics = app, cfg, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.cfg.api_key
        if key is not None:
            if not any([hmac.compare_digest(k.encode(), key.encode()) for k in keys_given(headers)]):
                return await self.refuse(scope, receive, send, ApiError(
                    401, "a valid API key is required (Authorization: Bearer ... or x-api-key: ...)",
                    kind="authentication_error", code="invalid_api_key"))
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.cfg.max_body_bytes):
            return await self.refuse(scope, receive, send, ApiError(
                413, f"the request body is over the limit of {self.cfg.max_body_bytes:,} bytes"))
        return await self.app(scope, receive, send)

    async def refuse(self, scope, receive, send, e: ApiError):
        self.metrics.failed(e.status)
        await error_response(scope["path"], e)(scope, receive, send)


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
