"""Chat messages as chat templates take them, checked at the boundary (requests, the server, chat)
without importing jinja2: a refusal costs no template machinery."""

from __future__ import annotations

import json
from typing import Any

from larqlpy.errors import LarqlError

ROLES = ("system", "user", "assistant", "tool")  # what every supported chat template renders (tool: text/tools.py)


def check_messages(messages: Any) -> None:
    """Messages as chat templates take them: a non-empty list of {"role": str, "content": str},
    each role one the templates know (another would be passed into the template as it is); an
    assistant's message may carry OpenAI `tool_calls` instead of content, and a tool's answers one."""
    if not isinstance(messages, list) or not messages:
        raise LarqlError("`messages` must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise LarqlError(f"`messages`[{i}] must be an object with string \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise LarqlError(f"`messages`[{i}] has the role {m['role']!r}; a message's role is one of "
                             f"{', '.join(ROLES)}")
        calls = m.get("tool_calls")
        if calls is not None:
            _check_calls(calls, i, m["role"])
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise LarqlError(f"`messages`[{i}] must be an object with string \"role\" and \"content\"")


def _check_calls(calls: Any, i: int, role: str) -> None:
    if role != "assistant" or not isinstance(calls, list) or not calls:
        raise LarqlError(f"`messages`[{i}].tool_calls must be a non-empty list, on an assistant's message")
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise LarqlError(f"`messages`[{i}].tool_calls[{j}] must be {{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": ...}}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(args, dict):
            raise LarqlError(f"`messages`[{i}].tool_calls[{j}].function.arguments must be a JSON object "
                             "(as a string)")
