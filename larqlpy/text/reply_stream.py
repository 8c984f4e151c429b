"""A reply as it streams, in the pieces every API's stream is shaped from: reasoning text, content
text, and each tool call once it is whole. What the three shapers (server/openai.ChatDeltas,
anthropic_events.Events, responses_out.Events) share lives here once: the reasoning split
(reasoning.Splitter), the call parser (tools.CallStream), one call only where calls are not
parallel, and blank content held until something follows it (before a call it is not content).

    ReplyStream(use, reasoning).feed(text) -> [Piece, ...]; .close() -> [Piece, ...]
        Piece.kind: REASONING or CONTENT (value: text) or CALL (value: an OpenAI tool call dict)."""

from __future__ import annotations

from typing import Any, NamedTuple

from larqlpy.text.reasoning import CONTENT, REASONING, Reasoning, Splitter
from larqlpy.text.tools import CallStream, ToolUse

CALL = "call"
__all__ = ["CALL", "CONTENT", "REASONING", "Piece", "ReplyStream"]


class Piece(NamedTuple):
    kind: str  # REASONING, CONTENT or CALL
    value: Any  # text, or a call


class ReplyStream:
    """hold_blank: blank content is held until non-blank content follows it, or dropped if a call
    does (and given out at the close if no call came); after each call it is held again."""

    def __init__(self, use: ToolUse | None, reasoning: Reasoning | None, hold_blank: bool = True):
        self.split, self.hold_blank = Splitter(reasoning), hold_blank
        self.calls = CallStream(use) if use is not None and use.choice != "none" else None
        self.parallel = use is None or use.parallel
        self.held, self.flowing, self.called = "", False, 0  # flowing: content has gone out since the last call

    def feed(self, text: str) -> list[Piece]:
        return self._parts(self.split.feed(text))

    def close(self) -> list[Piece]:
        out = self._parts(self.split.close())
        out += self._content(self.calls.close()) if self.calls is not None else []
        if self.held and not self.called:  # blank text that no call followed: the answer's text
            out.append(Piece(CONTENT, self.held))
            self.held = ""
        return out

    def _parts(self, parts: list) -> list[Piece]:
        out = []
        for kind, text in parts:
            if kind == REASONING:
                out.append(Piece(REASONING, text))
            else:
                out += self._content(self.calls.feed(text) if self.calls is not None else [text])
        return out

    def _content(self, parts: list) -> list[Piece]:
        out = []
        for p in parts:
            if isinstance(p, str):
                out += self._text(p)
            elif self.parallel or not self.called:
                self.called, self.flowing, self.held = self.called + 1, False, ""
                out.append(Piece(CALL, p))
        return out

    def _text(self, text: str) -> list[Piece]:
        if not self.hold_blank or self.flowing:
            return [Piece(CONTENT, text)] if text else []
        self.held += text
        if not self.held.strip():
            return []
        text, self.held, self.flowing = self.held, "", True
        return [Piece(CONTENT, text)]
