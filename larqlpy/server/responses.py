"""OpenAI's Responses API as larqlpy reads it (POST /v1/responses): a body read into the chat
pipeline's `Request`, with the conversation it continues.

`input` (a string, or items: messages with text parts, `function_call` and `function_call_output`
items; earlier `reasoning` items are skipped as templates drop earlier reasoning) becomes the
OpenAI-shaped messages chat templates take; `instructions` a system message first (not carried to
the next response of a chain, as OpenAI says); `previous_response_id` puts the stored conversation
of that response before the new input. The whole conversation is rendered and tokenized as a chat
completion of it would be, so its ids are the same: the state the previous response left in the
server's kept states holds all but their newest part, and only that is prefilled (the answer is
the chat completion's, token for token). Function tools, `tool_choice`, `text.format`,
`max_output_tokens`, `temperature`, `top_p` and `reasoning.effort` go to the chat pipeline in its own spelling, after
their own checks here name the Responses API's fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.pipeline.request import Request, integer
from larqlpy.server import openai
from larqlpy.server.response_store import ResponseStore

# fields that would have this server do what it cannot: refused, not ignored
REFUSED = ("background", "conversation", "prompt", "max_tool_calls")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
UNREADABLE = ("input_image", "input_file", "input_audio")
ECHOED = ("instructions", "tool_choice", "temperature", "top_p", "max_output_tokens", "parallel_tool_calls",
          "previous_response_id", "metadata", "text", "truncation", "user", "store", "reasoning")


@dataclass(frozen=True)
class Chain:
    """A read body: its request, the conversation without instructions (what a stored response
    keeps for the next of its chain), and the fields the response object repeats."""

    req: Request
    messages: tuple[dict, ...]
    echo: dict
    store: bool


class PreviousNotFound(LarqlError):
    pass


def read_request(body: dict, store: ResponseStore, max_tokens_limit: int | None = None,
                 default: Request | None = None) -> Chain:
    for key in REFUSED:
        if body.get(key) not in (None, False):
            raise LarqlError(f"`{key}` is not supported by this server")
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise LarqlError("`store` must be a boolean")
    _check_include(body)
    earlier = _previous(body.get("previous_response_id"), store)
    messages = (*earlier, *items(body.get("input"), known_calls(earlier)))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise LarqlError("`instructions` must be a string")
    system = [{"role": "system", "content": instructions}] if instructions else []
    tools = _tools(body.get("tools"))
    chat = {"messages": [*system, *messages], "max_tokens": _max_output_tokens(body, max_tokens_limit),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": tools,
            "tool_choice": _tool_choice(body.get("tool_choice")) if tools else None,
            "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": _format(body.get("text")),
            "reasoning_effort": _effort(body.get("reasoning")), "larqlpy": body.get("larqlpy")}
    req = openai.read_request({k: v for k, v in chat.items() if v is not None}, True, max_tokens_limit, default)
    echo = {k: body.get(k) for k in ECHOED}
    echo.update(store=keep, tools=body.get("tools") or [], tool_choice=body.get("tool_choice", "auto"),
                parallel_tool_calls=body.get("parallel_tool_calls", True), text=body.get("text") or {
                    "format": {"type": "text"}}, truncation=body.get("truncation") or "disabled")
    return Chain(req, messages, echo, keep)


def _effort(reasoning: Any) -> str | None:
    """`reasoning.effort` as chat's `reasoning_effort` (a thinking budget; none and minimal: thinking off)."""
    if reasoning is not None and not isinstance(reasoning, dict):
        raise LarqlError("`reasoning` must be an object")
    return (reasoning or {}).get("effort")


def _check_include(body: dict) -> None:
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) for i in include)):
        raise LarqlError("`include` must be a list of strings")
    if "message.output_text.logprobs" in (include or []) or body.get("top_logprobs"):
        raise LarqlError("log-probabilities are not served on /v1/responses: use /v1/chat/completions")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise LarqlError("`truncation` must be 'auto' or 'disabled'")


def _previous(rid: Any, store: ResponseStore) -> tuple[dict, ...]:
    if rid is None:
        return ()
    if not isinstance(rid, str):
        raise LarqlError("`previous_response_id` must be a string")
    found = store.get(rid)
    if found is None:
        raise PreviousNotFound(f"the previous response '{rid}' is not stored here (never stored, deleted, "
                               "or made with `store`: false)")
    return found.messages


def _max_output_tokens(body: dict, limit: int | None) -> int | None:
    """At most the server's limit; when not given, up to it (an agent's answer is not cut at a small default)."""
    n = integer(body, "max_output_tokens")
    if n is None:
        return limit
    if n < 1:
        raise LarqlError(f"`max_output_tokens` must be >= 1, got {n}")
    if limit is not None and n > limit:
        raise LarqlError(f"`max_output_tokens` is {n:,}; this server allows at most {limit:,}")
    return n


def _tools(tools: Any) -> list[dict] | None:
    """Responses' flat function tools as chat's."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise LarqlError("`tools` must be a list of function tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise LarqlError(f"`tools`[{i}] is a {kind!r} tool; this server runs function tools only")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise LarqlError("`tool_choice` must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}")


def _format(text: Any) -> dict | None:
    """`text.format` as chat's `response_format`."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text") and (fmt is None or isinstance(fmt, dict)):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "answer", "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise LarqlError("`text`.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                     "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}")


# -- input items, as the messages chat templates take --------------------------------------------

def known_calls(messages: tuple[dict, ...] | list[dict]) -> dict[str, str]:
    """call id -> function name, for the calls a conversation holds (a tool message names its function)."""
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}


def items(value: Any, calls: dict[str, str]) -> list[dict]:
    if isinstance(value, str):
        if not value:
            raise LarqlError("`input` must not be empty")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise LarqlError("`input` must be a non-empty string or a non-empty list of items")
    out: list[dict] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise LarqlError(f"`input`[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            _call(out, item, i, calls)
        elif kind == "function_call_output":
            out.append(_output(item, i, calls))
        elif kind != "reasoning":  # an earlier answer's reasoning: templates drop it
            raise LarqlError(f"`input`[{i}] is a {kind!r} item; this server takes message, function_call, "
                             "function_call_output and reasoning items")
    if not out:
        raise LarqlError("`input` holds no message or function call output")
    return out


def _message(item: dict, i: int) -> dict:
    role = ROLES.get(item.get("role"))
    if role is None:
        raise LarqlError(f"`input`[{i}].role must be user, assistant, system or developer, got {item.get('role')!r}")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise LarqlError(f"`input`[{i}].content must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNREADABLE:
            raise LarqlError(f"`input`[{i}].content[{j}] is {kind!r}: this model reads text only")
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise LarqlError(f"`input`[{i}].content[{j}] must be an input_text or output_text part with its `text`")
    return {"role": role, "content": "".join(texts)}


def _call(out: list[dict], item: dict, i: int, calls: dict[str, str]) -> None:
    """A function call the assistant made, joined to the assistant message it follows."""
    name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments")
    if not (isinstance(name, str) and name and isinstance(call_id, str) and call_id and isinstance(args, str)):
        raise LarqlError(f"`input`[{i}] (function_call) needs `call_id`, `name` and `arguments` as strings")
    try:
        json.loads(args)
    except ValueError:
        raise LarqlError(f"`input`[{i}].arguments is not JSON") from None
    calls[call_id] = name
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _output(item: dict, i: int, calls: dict[str, str]) -> dict:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or call_id not in calls:
        raise LarqlError(f"`input`[{i}] (function_call_output) answers the call {call_id!r}, which no "
                         "function_call before it (here or in the previous response) made")
    if isinstance(output, list):
        output = "".join(p.get("text", "") for p in output if isinstance(p, dict) and p.get("type") == "input_text")
    if not isinstance(output, str):
        raise LarqlError(f"`input`[{i}].output must be a string")
    return {"role": "tool", "tool_call_id": call_id, "name": calls[call_id], "content": output}
