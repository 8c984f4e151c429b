"""What every route's JSON body shares: read into JSON within its limit, checked for hostile
fields, the `model` it names, the "larqlpy" object (the engine, and settings no API has a field
for); and the error a refusal becomes (`ApiError`; a LarqlError as a 400 through `invalid`). Each
API's own fields and answers live in its module (server/openai.py, server/anthropic.py)."""

from __future__ import annotations

import json
from typing import Any

from larqlpy.errors import NAMED, LarqlError
from larqlpy.files import check_fields
from larqlpy.pipeline.request import Request, integer, options_of

# the body's "larqlpy" object: the engine, and the settings the APIs have no field for
EXTENSION_SHAPING = ("regex", "grammar", "repetition_penalty", "repeat_last_n", "draft_tokens", "lookup",
                     "draft_p_min", "draft_fixed", "thinking_budget", "logit_bias")
EXTENSION = ("continuation", "options", "engine", "prefill_chunk", *EXTENSION_SHAPING)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(e: LarqlError) -> ApiError:
    """A refusal as a 400, its parameters spelled as the JSON fields are ('max_tokens'), the first
    one named as the error's param."""
    first = NAMED.search(e.message)
    return ApiError(400, e.render(lambda name: f"'{name}'"), param=first.group(1) if first else None)


def parse_body(raw: bytes, limit: int) -> dict:
    if len(raw) > limit:
        raise ApiError(413, f"the request body is {len(raw):,} bytes; the limit is {limit:,}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, "the request body is not valid JSON "
                            f"({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        check_fields(body)
    except LarqlError as e:
        raise invalid(e) from None
    return body


def boolean(body: dict, key: str) -> bool:
    """An optional boolean field (`stream`): absent or null is false; anything else but a boolean a 400."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{key}' must be a boolean", param=key)
    return bool(value)


def check_model(body: dict, name: str) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required and must be a string", param="model")
    if model != name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{name}'",
                       param="model", code="model_not_found")


def extension(ext: Any, default: Request) -> tuple[dict[str, Any], dict[str, Any]]:
    """The body's `"larqlpy": {"continuation": ..., "options": {...}, "engine": ..., "prefill_chunk": ...}`
    as (Request fields: the default's engine where it names none, generation fields in the flat spelling)."""
    if ext is None:
        ext = {}
    if not isinstance(ext, dict):
        raise LarqlError("`larqlpy` must be an object")
    unknown = set(ext) - set(EXTENSION)
    if unknown:
        raise LarqlError(f"`larqlpy` has unknown fields: {', '.join(sorted(unknown))}")
    for key in ("continuation", "engine"):
        if ext.get(key) is not None and not isinstance(ext[key], str):
            raise LarqlError(f"`larqlpy`.{key} must be a string")
    chunk = integer(ext, "prefill_chunk")
    shaping = {k: ext[k] for k in EXTENSION_SHAPING if ext.get(k) is not None}  # checked with the flat spelling's
    options = options_of(ext.get("options", {}))
    if ext.get("engine") or ext.get("continuation") or options:
        engine = {"engine": ext.get("engine"), "continuation": ext.get("continuation"), "options": options}
    else:
        engine = {"engine": default.engine, "continuation": default.continuation, "options": default.options}
    return engine, {"prefill_chunk": chunk, **shaping}
