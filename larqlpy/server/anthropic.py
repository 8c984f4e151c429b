"""Anthropic's Messages API as larqlpy serves it (/v1/messages, /v1/messages/count_tokens): a body
read into the pipeline's `Request` (`read_request`: the conversation as the OpenAI-shaped messages
the chat template and the tool-call machinery take -- tool_use blocks as an assistant's calls,
tool_result blocks as `tool` messages -- tools and tool_choice as OpenAI's, stop sequences and
sampling in the flat spelling, `thinking` as a thinking budget or thinking off), and its errors'
shape; the answer's shapes are server/anthropic_events.py's."""

from __future__ import annotations

import json
from typing import Any

from sse_starlette.sse import ServerSentEvent

from larqlpy.errors import LarqlError
from larqlpy.pipeline.request import Request, chat_settings, generation, integer, messages_of, number, stops, tools_of
from larqlpy.server.protocol import ApiError, extension
from larqlpy.text.tools import NAME

PATH = "/v1/messages"
# fields that would have this server do what it cannot (run MCP servers, a code container): refused,
# not ignored; the rest that shape nothing here (metadata, service_tier, cache_control,
# output_config.effort) are ignored
REFUSED = ("mcp_servers", "container")
UNREADABLE = ("image", "document", "search_result")  # input a text model cannot take
# an earlier answer's reasoning: a thinking block's text goes to the template as the message's
# reasoning_content (Qwen3's renders it after the last user turn; most drop it), a redacted one nowhere
THOUGHT, SKIPPED = "thinking", ("redacted_thinking",)
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
    thinking = _thinking(body.get("thinking"), more.pop("thinking_budget", None))
    gen = generation({"max_tokens": 0 if counting else _max_tokens(body, max_tokens_limit),
                      "temperature": number(body, "temperature", 0.0, 1.0, default=1.0),
                      "top_p": number(body, "top_p", 0.0, 1.0, lo_open=True), "top_k": integer(body, "top_k"),
                      "stop": _stop_sequences(body.get("stop_sequences")), **_output_format(body), **more,
                      **thinking})
    messages = conversation(body)
    choice, parallel = _tool_choice(body.get("tool_choice"))
    raw = {"messages": messages, "tools": _tools(body.get("tools")), "tool_choice": choice,
           "parallel_tool_calls": parallel}
    req = Request(messages=messages_of(messages), gen=gen, tools=tools_of(raw, gen), **chat_settings(thinking),
                  **engine)
    req.spec()
    return req


def _max_tokens(body: dict, limit: int | None) -> int:
    n = integer(body, "max_tokens")
    if n is None:
        raise LarqlError("`max_tokens` is required")
    if n < 1:
        raise LarqlError(f"`max_tokens` must be >= 1, got {n}")
    if limit is not None and n > limit:
        raise LarqlError(f"`max_tokens` is {n:,}; this server allows at most {limit:,}")
    return n


def _thinking(value: Any, budget: int | None) -> dict[str, Any]:
    """`thinking`: {"type": "enabled", "budget_tokens": N} (a thinking budget), {"type": "adaptive"}
    (thinking, no budget) or {"type": "disabled"}; absent, as the model's template has it. The
    `larqlpy` object's thinking_budget is the same setting."""
    if value is None:
        return {"thinking_budget": budget}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise LarqlError("`thinking` is {\"type\": \"enabled\", \"budget_tokens\": N}, {\"type\": \"adaptive\"} or "
                         "{\"type\": \"disabled\"}")
    given = integer(value, "budget_tokens") if kind == "enabled" else None
    if kind == "enabled" and (given is None or given < 0):
        raise LarqlError("`thinking`.budget_tokens must be an integer >= 0")
    if given is not None and budget is not None:
        raise LarqlError("`thinking`.budget_tokens and `larqlpy`.thinking_budget are one setting; give one")
    return {"thinking": kind != "disabled", "thinking_budget": given if given is not None else budget}


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
    text, calls, thought = [], [], []
    for j, b in enumerate(blocks):
        where = f"`messages`[{i}].content[{j}]"
        if b["type"] in SKIPPED or (b["type"] == THOUGHT and not isinstance(b.get(THOUGHT), str)):
            continue
        if b["type"] == THOUGHT:
            thought.append(b[THOUGHT])
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
    message.update({"reasoning_content": "\n\n".join(thought)} if thought else {})
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

def ping() -> ServerSentEvent:
    return ServerSentEvent(event="ping", data=json.dumps({"type": "ping"}))


def error_event(message: str, status: int = 500) -> tuple[str, dict]:
    return "error", error_body(ApiError(status, message))
