"""The OpenAI API as larqlpy serves it: request bodies checked into parameters, and the response
shapes. Every refusal is an `ApiError` with its HTTP status, rendered as OpenAI's error body."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from larqlpy.config import GenerationConfig
from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.model.messages import check_messages

# Fields that would change what is generated and that larqlpy does not implement: refused, not
# ignored. Anything else unknown (user, metadata, ...) is ignored, as OpenAI ignores it.
UNSUPPORTED = ("logprobs", "top_logprobs", "best_of", "echo", "suffix", "logit_bias", "tools", "tool_choice",
               "functions", "function_call", "response_format", "audio", "modalities", "prediction")
PENALTIES = ("frequency_penalty", "presence_penalty")
MAX_STOPS = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Generation:
    """A checked request: what to generate, how, and how to answer."""

    chat: bool
    prompt: str | list[int] | None  # completions
    messages: list[dict] | None  # chat
    spec: EngineSpec
    gen: GenerationConfig
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


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
        raise ApiError(400, f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _number(body: dict, key: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"'{key}' must be a number", param=key)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ApiError(400, f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=key)
    return float(v)


def _integer(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise ApiError(400, f"'{key}' must be an integer", param=key)
    return v


def _boolean(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be a boolean", param=key)
    return v


def check(body: dict, chat: bool, model_name: str, max_tokens_limit: int, default_spec: EngineSpec) -> Generation:
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required and must be a string", param="model")
    if model != model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{model_name}'",
                       param="model", code="model_not_found")
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False):
            raise ApiError(400, f"'{key}' is not supported by this server", param=key)
    for key in PENALTIES:
        if _number(body, key, -2.0, 2.0, 0.0) != 0.0:
            raise ApiError(400, f"'{key}' is not supported by this server (only 0)", param=key)
    n = _integer(body, "n")
    if n not in (None, 1):
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {n}", param="n")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key)
    if max_tokens is None:
        max_tokens = min(GenerationConfig.max_tokens if not chat else 256, max_tokens_limit)
    if max_tokens < 0:
        raise ApiError(400, f"'{key}' must be >= 0, got {max_tokens}", param=key)
    if max_tokens > max_tokens_limit:
        raise ApiError(400, f"'{key}' is {max_tokens:,}; this server allows at most {max_tokens_limit:,}", param=key)
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True)
    seed = _integer(body, "seed")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = tuple(stop)
    else:
        raise ApiError(400, f"'stop' must be a string or a list of at most {MAX_STOPS} strings", param="stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "'stop' strings must not be empty", param="stop")
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(400, "'stream_options' must be an object, and only with 'stream': true", param="stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    spec, chunk = _extension(body.get("larqlpy"), default_spec)
    try:
        gen = GenerationConfig.from_dict({"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                                          "seed": seed, "prefill_chunk": chunk})
    except LarqlError as e:
        raise ApiError(400, str(e)) from None
    prompt = messages = None
    if chat:
        messages = body.get("messages")
        try:
            check_messages(messages)
        except LarqlError as e:
            raise ApiError(400, str(e).replace("`messages`", "'messages'"), param="messages") from None
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise ApiError(400, "'prompt' must be a non-empty string, or a list of token ids", param="prompt")
    return Generation(chat, prompt, messages, spec, gen, stops, stream, include_usage)


def _extension(ext: Any, default: EngineSpec) -> tuple[EngineSpec, int | None]:
    """`"larqlpy": {"continuation": ..., "options": {...}, "engine": ..., "prefill_chunk": ...}`,
    checked exactly as the CLI checks its flags."""
    if ext is None:
        return default, None
    if not isinstance(ext, dict):
        raise ApiError(400, "'larqlpy' must be an object", param="larqlpy")
    unknown = set(ext) - {"continuation", "options", "engine", "prefill_chunk"}
    if unknown:
        raise ApiError(400, f"'larqlpy' has unknown fields: {', '.join(sorted(unknown))}", param="larqlpy")
    opts = ext.get("options", {})
    if isinstance(opts, dict):
        opts = [f"{k}={v}" for k, v in opts.items()]
    elif not (isinstance(opts, list) and all(isinstance(o, str) for o in opts)):
        raise ApiError(400, "'larqlpy.options' must be an object or a list of 'key=value' strings", param="larqlpy")
    for key in ("continuation", "engine"):
        if ext.get(key) is not None and not isinstance(ext[key], str):
            raise ApiError(400, f"'larqlpy.{key}' must be a string", param="larqlpy")
    chunk = ext.get("prefill_chunk")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)):
        raise ApiError(400, "'larqlpy.prefill_chunk' must be an integer", param="larqlpy")
    try:
        spec = parse_engine_spec(ext.get("engine"), ext.get("continuation"), opts) \
            if ext.get("engine") or ext.get("continuation") or opts else default
    except LarqlError as e:
        raise ApiError(400, str(e), param="larqlpy") from None
    if spec.replay:
        raise ApiError(400, "'larqlpy.engine' no-cache keeps no state to serve from; name a continuation",
                       param="larqlpy")
    return spec, chunk


# -- responses --------------------------------------------------------------------------------------

def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def response(rid: str, g: Generation, model: str, text: str, finish: str, use: dict, extra: dict) -> dict:
    if g.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if g.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": use, "larqlpy": extra}


def chunk(rid: str, g: Generation, model: str, text: str | None, finish: str | None, first: bool = False) -> dict:
    if g.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk" if g.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
