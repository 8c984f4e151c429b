"""Chat messages as chat templates take them, checked at the boundary (requests, the server, chat)
without importing jinja2: a refusal costs no template machinery."""

from __future__ import annotations

from typing import Any

from larqlpy.errors import LarqlError


ROLES = ("system", "user", "assistant")  # what every supported chat template renders


def check_messages(messages: Any) -> None:
    """Messages as chat templates take them: a non-empty list of {"role": str, "content": str},
    each role one the templates know (another would be passed into the template as it is)."""
    if not isinstance(messages, list) or not messages:
        raise LarqlError("`messages` must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise LarqlError(f"`messages`[{i}] must be an object with string \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise LarqlError(f"`messages`[{i}] has the role {m['role']!r}; a message's role is one of "
                             f"{', '.join(ROLES)}")
