"""Stop strings over a sequence's text, token by token (as vLLM keeps them in its detokenizer).

A generated token waits while its text could still be the start of a stop string, and the newest
token always waits one step, so that the last token let out is the one that ends the text and
carries the finish. Where a stop string appears, the text is cut at its first character: the tokens
before the cut go out (the one the cut falls in with its text shortened), the rest are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Piece:
    """A generated token waiting to go out: its id, its text, and what it carries along."""

    id: int
    text: str
    extra: Any = None  # the logits it was sampled from


class StopStrings:
    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.held: list[Piece] = []
        self.text = ""  # the held pieces' text, joined
        self.cut = False  # a stop string appeared
        self.matched: str | None = None  # which one (Anthropic's answer names it)
        self.dropped: list[Piece] = []  # the pieces the cut dropped

    def push(self, piece: Piece) -> list[Piece]:
        """Take the next token; the pieces that may go out now (after a cut: the last of them)."""
        if not self.stops:
            return [piece]
        self.held.append(piece)
        self.text += piece.text
        at = self._first()
        if at is not None:  # cut, unless a stop string that begins earlier may still complete
            return [] if self._could_begin_before(at) else self._cut(at)
        # the longest end of the text that could still begin a stop string stays, with the piece before it
        k = next((k for k in range(min(len(self.text), self.longest - 1), 0, -1)
                  if any(s.startswith(self.text[-k:]) for s in self.stops)), 0)
        free, out, end = len(self.text) - k, [], 0
        for i, p in enumerate(self.held[:-1]):
            if end + len(p.text) + len(self.held[i + 1].text) > free:
                break
            end += len(p.text)
            out.append(p)
        self.held = self.held[len(out):]
        self.text = self.text[end:]
        return out

    def _first(self) -> int | None:
        """Where the first stop string in the held text begins, if one is there."""
        found = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _could_begin_before(self, at: int) -> bool:
        """Whether the text from some position before `at` to its end is the start of a longer stop
        string: more text could make it appear before the one found at `at`."""
        n = len(self.text)
        return any(len(s) > n - j and s.startswith(self.text[j:])
                   for j in range(max(0, n - self.longest + 1), at) for s in self.stops)

    def _cut(self, at: int) -> list[Piece]:
        self.matched = next(s for s in self.stops if self.text.find(s) == at)
        out, start = [], 0
        for p in self.held:
            if start >= at:
                break
            if start + len(p.text) > at:
                p = Piece(p.id, p.text[:at - start], p.extra)
            out.append(p)
            start += len(p.text)
        self.dropped = self.held[len(out):]
        self.held, self.text, self.cut = [], "", True
        return out

    def flush(self) -> list[Piece]:
        """The sequence ended another way (a stop id, its length): every held piece goes out, cut
        before a stop string that was waiting on an earlier one that may have begun (`cut` says so)."""
        at = self._first()
        if at is not None:
            return self._cut(at)
        out, self.held, self.text = self.held, [], ""
        return out
