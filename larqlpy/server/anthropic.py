"""Anthropic's Messages API as larqlpy serves it (/v1/messages, /v1/messages/count_tokens): a body
read into the pipeline's `Request` (`read_request`: the conversation as the OpenAI-shaped messages
the chat template and the tool-call machinery take -- tool_use blocks as an assistant's calls,
tool_result blocks as `tool` messages -- tools and tool_choice as OpenAI's, stop sequences and
sampling in the flat spelling), and the answer's shapes: the message, its stream's events
(`Events`), usage and errors."""

from __future__ import annotations

import json
from typing import Any

from sse_starlette.sse import ServerSentEvent

from larqlpy.decode.sequence import Sequence
from larqlpy.errors import LarqlError
from larqlpy.pipeline.request import Request, generation, integer, messages_of, number, stops, tools_of
from larqlpy.server.openai import cached, extra
from larqlpy.server.protocol import ApiError, extension
from larqlpy.text.tools import NAME, CallStream, read_reply

PATH = "/v1/messages"
# fields that would have this server do what it cannot (run MCP servers, a code container): refused,
# not ignored; the rest that shape nothing here (metadata, service_tier, thinking, cache_control,
# output_config.effort) are ignored
REFUSED = ("mcp_servers", "container")
UNREADABLE = ("image", "document", "search_result")  # input a text model cannot take
SKIPPED = ("thinking", "redacted_thinking")  # an earlier answer's reasoning: the models here write none
CHOICES = {"auto": "auto", "any": "required", "none": "none"}
KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def owns(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_body(e: ApiError) -> dict:
    kind = KINDS.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def read_request(body: dict, max_tokens_limit: int | None = None, default: Request | None = None,
                 counting: bool = False) -> Request:
    """A /v1/messages body as a chat request (`counting`: count_tokens', which gives no max_tokens).
    `default` gives the engine when the body's "larqlpy" object names none."""
    for key in REFUSED:
        if body.get(key) is not None:
            raise LarqlError(f"`{key}` is not supported by this server")
    engine, more = extension(body.get("larqlpy"), default or Request())
    gen = generation({"max_tokens": 0 if counting else _max_tokens(body, max_tokens_limit),
                      "temperature": number(body, "temperature", 0.0, 1.0, default=1.0),
                      "top_p": number(body, "top_p", 0.0, 1.0, lo_open=True), "top_k": integer(body, "top_k"),
                      "stop": _stop_sequences(body.get("stop_sequences")), **_output_format(body), **more})
    messages = conversation(body)
    choice, parallel = _tool_choice(body.get("tool_choice"))
    raw = {"messages": messages, "tools": _tools(body.get("tools")), "tool_choice": choice,
           "parallel_tool_calls": parallel}
    req = Request(messages=messages_of(messages), gen=gen, tools=tools_of(raw, gen), **engine)
    req.spec()
    return req


def streaming(body: dict) -> bool:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    return bool(stream)


def _max_tokens(body: dict, limit: int | None) -> int:
    n = integer(body, "max_tokens")
    if n is None:
        raise LarqlError("`max_tokens` is required")
    if n < 1:
        raise LarqlError(f"`max_tokens` must be >= 1, got {n}")
    if limit is not None and n > limit:
        raise LarqlError(f"`max_tokens` is {n:,}; this server allows at most {limit:,}")
    return n


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is not None and (not isinstance(value, list) or not all(isinstance(s, str) and s for s in value)):
        raise LarqlError("`stop_sequences` must be a list of non-empty strings")
    return stops(value)


def _output_format(body: dict) -> dict[str, Any]:
    """`output_config.format` (structured outputs) as the flat spelling's `json_schema` (`effort` shapes nothing)."""
    cfg = body.get("output_config") or {}
    fmt = cfg.get("format") if isinstance(cfg, dict) else None
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "json_schema"
                            or not isinstance(fmt.get("schema"), dict)):
        raise LarqlError("`output_config`.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
    return {"json_schema": fmt["schema"]} if fmt is not None else {}


# -- the conversation, as the pipeline takes it ------------------------------------------------------

def conversation(body: dict) -> list[dict]:
    """`system` and `messages` as OpenAI-shaped messages, each block checked where it stands."""
    out = _system(body.get("system"))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise LarqlError("`messages` must be a non-empty list of {\"role\": \"user\" | \"assistant\", "
                         "\"content\": ...} objects")
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "system":
            raise LarqlError(f"`messages`[{i}] has the role 'system': give the system prompt as the top-level `system`")
        if role not in ("user", "assistant"):
            raise LarqlError(f"`messages`[{i}] has the role {role!r}; a message's role is user or assistant")
        blocks = _blocks(m.get("content"), f"`messages`[{i}].content")
        out += _user(blocks, i) if role == "user" else [_assistant(blocks, i)]
    if msgs[-1]["role"] == "assistant":  # the pipeline renders a prompt that opens a new turn
        raise LarqlError(f"`messages`[{len(msgs) - 1}] is the assistant's: continuing a prefilled answer is not "
                         "supported; end with a user message")
    return out


def _system(value: Any) -> list[dict]:
    if value is None:
        return []
    blocks = _blocks(value, "`system`")
    text = "\n\n".join(_text(b, f"`system`[{j}]") for j, b in enumerate(blocks))
    return [{"role": "system", "content": text}] if text else []


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) and isinstance(b.get("type"), str)
                                                for b in content):
        raise LarqlError(f"{where} must be a string or a list of content blocks, each with a string \"type\"")
    return content


def _text(block: dict, where: str) -> str:
    if block["type"] in UNREADABLE:
        raise LarqlError(f"{where}: {block['type']} blocks are not supported: this server serves a text model "
                         "(send text)")
    if block["type"] != "text" or not isinstance(block.get("text"), str):
        raise LarqlError(f"{where} must be a text block: {{\"type\": \"text\", \"text\": ...}}")
    return block["text"]


def _user(blocks: list[dict], i: int) -> list[dict]:
    """A user's turn: each tool_result a `tool` message, the text between them user messages, in order."""
    out, text = [], []
    for j, b in enumerate(blocks):
        where = f"`messages`[{i}].content[{j}]"
        if b["type"] != "tool_result":
            text.append(_text(b, where))
            continue
        if text:
            out.append({"role": "user", "content": "\n\n".join(text)})
            text = []
        if not isinstance(b.get("tool_use_id"), str):
            raise LarqlError(f"{where}.tool_use_id must be a string")
        result = _blocks(b.get("content") or "", f"{where}.content")
        content = "\n\n".join(_text(r, f"{where}.content[{k}]") for k, r in enumerate(result))
        # the model learnt results as text: a failed call says so in words
        out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                    "content": f"Error: {content}" if b.get("is_error") is True else content})
    if text or not out:
        out.append({"role": "user", "content": "\n\n".join(text)})
    return out


def _assistant(blocks: list[dict], i: int) -> dict:
    text, calls = [], []
    for j, b in enumerate(blocks):
        where = f"`messages`[{i}].content[{j}]"
        if b["type"] in SKIPPED:
            continue
        if b["type"] != "tool_use":
            text.append(_text(b, where))
            continue
        if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or \
                not isinstance(b.get("input"), dict):
            raise LarqlError(f"{where} must be {{\"type\": \"tool_use\", \"id\": ..., \"name\": ..., "
                             "\"input\": {...}}")
        calls.append({"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
    message = {"role": "assistant", "content": "\n\n".join(text) or (None if calls else "")}
    return {**message, "tool_calls": calls} if calls else message


def _tools(tools: Any) -> list[dict] | None:
    """Anthropic's tools (name, description, input_schema) as OpenAI's, which text/tools.py checks further."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise LarqlError("`tools` must be a list of {\"name\", \"description\", \"input_schema\"} objects")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise LarqlError(f"`tools`[{i}] must be an object with \"name\" and \"input_schema\"")
        if t.get("type") not in (None, "custom"):
            raise LarqlError(f"`tools`[{i}] is the server tool {t['type']!r}, which this server does not run: give "
                             "client tools (name, description, input_schema)")
        if not isinstance(t.get("name"), str) or not NAME.match(t["name"]):
            raise LarqlError(f"`tools`[{i}].name must be 1-64 letters, digits, _ . or -")
        if not isinstance(t.get("input_schema"), dict):
            raise LarqlError(f"`tools`[{i}].input_schema must be a JSON Schema object")
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: Any) -> tuple[Any, bool]:
    """Anthropic's tool_choice as OpenAI's, and whether calls may come several at once."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*CHOICES, "tool"):
        raise LarqlError("`tool_choice` is {\"type\": \"auto\" | \"any\" | \"none\"} or "
                         "{\"type\": \"tool\", \"name\": ...}")
    single = choice.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise LarqlError("`tool_choice`.disable_parallel_tool_use must be a boolean")
    if kind != "tool":
        return CHOICES[kind], not single
    if not isinstance(choice.get("name"), str):
        raise LarqlError("`tool_choice` of type tool needs the tool's \"name\"")
    return {"type": "function", "function": {"name": choice["name"]}}, not single


# -- the answer --------------------------------------------------------------------------------------

def message(mid: str, model: str, seq: Sequence) -> dict:
    reply = read_reply(seq.text, seq.request.tools)
    blocks = [{"type": "text", "text": reply.content}] if reply.content else []
    blocks += [tool_use(c) for c in reply.calls]
    reason = stop_reason(seq, bool(reply.calls))
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": seq.out.stop_string if reason == "stop_sequence" else None,
            "usage": usage(seq), "larqlpy": extra(seq)}


def tool_use(call: dict) -> dict:
    """An OpenAI tool call (text/tools.py reads them so) as a tool_use block."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def stop_reason(seq: Sequence, called: bool) -> str:
    if called:
        return "tool_use"
    if seq.out.stop_string is not None:
        return "stop_sequence"
    return "end_turn" if seq.finish_reason == "stop" else "max_tokens"


def usage(seq: Sequence) -> dict:
    """Anthropic counts the prompt tokens read from its cache apart from `input_tokens`: here, those a
    kept state held (the prefix cache). Every request's state is kept without a cost of its own, so
    none is counted as written to the cache."""
    held = cached(seq)
    return {"input_tokens": len(seq.prompt_ids) - held, "output_tokens": len(seq.output),
            "cache_read_input_tokens": held, "cache_creation_input_tokens": 0}


def ping() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data=json.dumps({"type": "ping"}))


def error_event(message: str, status: int = 500) -> tuple[str, dict]:
    return "error", error_body(ApiError(status, message))


class Events:
    """A message's stream as Anthropic's events, (event, data) pairs: message_start and a ping, then
    content blocks as the text comes -- text deltas, or, where tools are offered, each call as a
    tool_use block once it is whole (its input in one input_json_delta) -- then message_delta
    (stop_reason, usage) and message_stop. Blank text is held until something follows it: before
    a call it is not content."""

    def __init__(self, mid: str, model: str, seq: Sequence):
        use = seq.request.tools
        self.calls = CallStream(use) if use is not None and use.choice != "none" else None
        self.parallel = use is None or use.parallel
        self.index, self.open, self.held, self.called = 0, False, "", False
        self.head = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                     "stop_reason": None, "stop_sequence": None,
                     # what a kept state holds is known once the sequence starts: message_delta says it
                     "usage": {"input_tokens": len(seq.prompt_ids), "output_tokens": 0,
                               "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}

    def start(self) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start", "message": self.head}), ("ping", {"type": "ping"})]

    def feed(self, text: str) -> list[tuple[str, dict]]:
        return self._events(self.calls.feed(text) if self.calls is not None else [text])

    def finish(self, seq: Sequence) -> list[tuple[str, dict]]:
        out = self._events(self.calls.close()) if self.calls is not None else []
        if self.held and not self.called:  # blank text that no call followed: the answer's text
            held, self.held = self.held, ""
            out += self._text(held, force=True)
        out += self._close()
        reason = stop_reason(seq, self.called)
        delta = {"stop_reason": reason, "stop_sequence": seq.out.stop_string if reason == "stop_sequence" else None}
        return out + [("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(seq)}),
                      ("message_stop", {"type": "message_stop"})]

    def cut(self) -> list[tuple[str, dict]]:
        """Ended before its answer was whole (the server shut down): the open block closed."""
        return self._close()

    def _events(self, parts: list) -> list[tuple[str, dict]]:
        out = []
        for p in parts:
            if isinstance(p, str):
                out += self._text(p)
            elif self.parallel or not self.called:
                block = tool_use(p)
                out += self._close() + [
                    ("content_block_start", {"type": "content_block_start", "index": self.index,
                                             "content_block": {**block, "input": {}}}),
                    ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": p["function"]["arguments"]}}),
                    ("content_block_stop", {"type": "content_block_stop", "index": self.index})]
                self.index, self.called = self.index + 1, True
        return out

    def _text(self, text: str, force: bool = False) -> list[tuple[str, dict]]:
        out = []
        if not self.open:
            self.held += text
            if not force and not self.held.strip():
                return []
            text, self.held, self.open = self.held, "", True
            out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                                "content_block": {"type": "text", "text": ""}}))
        return out + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "text_delta", "text": text}})] if text else out

    def _close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open, self.index = False, self.index + 1
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]
