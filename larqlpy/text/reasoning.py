"""A thinking model's reasoning told apart from its answer (no torch, no jinja2).

Models that think (Qwen3, QwQ, DeepSeek-R1 and its distills, ...) write a block of reasoning before
the answer: `<think>reasoning</think>answer`. The markers a model uses are told from its chat
template's source, as text/tools.py's `convention` tells its tool calls:

    <think> </think>              Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3, Phi-4-reasoning, GLM
    <seed:think> </seed:think>    Seed-OSS
    [THINK] [/THINK]              Magistral
    ◁think▷ ◁/think▷              Kimi

A template may open the block itself: DeepSeek-R1's distills end the generation prompt with
`<think>\\n`, so their output starts inside it (`Reasoning.opened`, told from the rendered prompt).
Qwen3's template takes `enable_thinking` (`switchable`): false renders an empty, closed block, and
the model answers at once.

The API (the servers' chat completions, Messages and Responses use it):

    reasoning_of(template_source, prompt) -> Reasoning | None
        one request's: the markers and whether `prompt` (the rendered text) opened the block; None
        for a template whose model does not think.
    split(text, reasoning) -> Split(reasoning, content)
        a whole output: `reasoning` is None when there is none (no block, or an empty one).
    Splitter(reasoning).feed(text) -> [Part, ...]; .close() -> [Part, ...]
        the same as text streams in: each Part is (kind "reasoning" | "content", text); text that may
        be the start of a marker, or blank text beside one, is held until it is known.

How a text splits: a block (the output's first non-blank text is the opening marker, or the prompt
opened it) runs to the closing marker (or the end); its reasoning is what lies between, without the
blank text next to either marker; the content is what follows the closing marker, its leading blank
text dropped. So the text is exactly open + blank + reasoning + blank + close + blank + content. An
output that does not begin with a block is all content, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

REASONING, CONTENT = "reasoning", "content"


@dataclass(frozen=True)
class Markers:
    open: str
    close: str

    @property
    def forced_close(self) -> str:
        """What closes the block when a thinking budget runs out, as the model writes it: Qwen3's
        own layout (the reasoning, a newline, the marker, a blank line, the answer)."""
        return f"\n{self.close}\n\n"


FAMILIES = (Markers("<seed:think>", "</seed:think>"), Markers("[THINK]", "[/THINK]"), Markers("◁think▷", "◁/think▷"),
            Markers("<think>", "</think>"))
SWITCH = "enable_thinking"  # the template variable that turns thinking on and off (Qwen3, SmolLM3, GLM)


@dataclass(frozen=True)
class Reasoning:
    """One request's reasoning block: its markers, and whether the prompt opened it already."""

    markers: Markers
    opened: bool = False


class Part(NamedTuple):
    kind: str  # REASONING or CONTENT
    text: str


class Split(NamedTuple):
    reasoning: str | None
    content: str


def markers(template_source: str) -> Markers | None:
    """The markers a template's model thinks in (the first family whose markers its source names:
    most strip an earlier answer's reasoning at the closing one, R1's distills open the block), or
    None: a model that does not think."""
    return next((m for m in FAMILIES if m.close in template_source or m.open in template_source), None)


def switchable(template_source: str) -> bool:
    """The template turns thinking off when told `enable_thinking=False`."""
    return SWITCH in template_source


def reasoning_of(template_source: str, prompt: str) -> Reasoning | None:
    """The reasoning block of a request whose rendered prompt is `prompt`."""
    found = markers(template_source)
    return Reasoning(found, prompt.rstrip().endswith(found.open)) if found is not None else None


def split(text: str, reasoning: Reasoning | None) -> Split:
    """A whole output as (reasoning, content): what `Splitter` gives, joined."""
    if reasoning is None:
        return Split(None, text)
    s = Splitter(reasoning)
    parts = s.feed(text) + s.close()
    thought = "".join(p.text for p in parts if p.kind == REASONING)
    return Split(thought or None, "".join(p.text for p in parts if p.kind == CONTENT))


class Splitter:
    """An output as it streams, into reasoning and content parts (module docstring)."""

    def __init__(self, reasoning: Reasoning | None):
        self.m = reasoning.markers if reasoning is not None else None
        # head: not known yet whether a block begins; inside: the block; after: blank text after it
        self.state = "content" if self.m is None else "inside" if reasoning.opened else "head"
        self.buffer, self.begun = "", False  # begun: reasoning text has gone out

    def feed(self, text: str) -> list[Part]:
        if self.state == "content":
            return [Part(CONTENT, text)] if text else []
        self.buffer += text
        out: list[Part] = []
        if self.state == "head":
            head = self.buffer.lstrip()
            if not head or (self.m.open.startswith(head) and head != self.m.open):
                return out  # it may yet be the opening marker
            if not head.startswith(self.m.open):
                return self._content()
            self.buffer, self.state = head[len(self.m.open):], "inside"
        if self.state == "inside":
            at = self.buffer.find(self.m.close)
            if at < 0:
                keep = _held(self.buffer, self.m.close)
                out += self._think(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            out += self._think(self.buffer[:at].rstrip())
            self.buffer, self.state = self.buffer[at + len(self.m.close):], "after"
        self.buffer = self.buffer.lstrip()
        return out + (self._content() if self.buffer else [])

    def close(self) -> list[Part]:
        """What is held when the output ends: text that was not a marker after all."""
        if self.state == "head":
            return self._content()
        if self.state == "inside":  # a block the output never closed: all of it reasoning
            text, self.buffer = self.buffer.rstrip(), ""
            return self._think(text)
        return []

    def _think(self, text: str) -> list[Part]:
        if not self.begun:
            text = text.lstrip()
        self.begun = self.begun or bool(text)
        return [Part(REASONING, text)] if text else []

    def _content(self) -> list[Part]:
        text, self.buffer, self.state = self.buffer, "", "content"
        return [Part(CONTENT, text)] if text else []


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` must wait: the start of `marker`, and the blank text
    before it (blank text just before the closing marker is not reasoning)."""
    keep = next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)
    rest = text[:len(text) - keep]
    return keep + len(rest) - len(rest.rstrip())
