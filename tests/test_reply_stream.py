"""The reply stream every API's stream is shaped from (text/reply_stream.py): reasoning, content and
whole calls, fed in pieces of any size; blank content held before a call; one call where calls are not
parallel."""

from __future__ import annotations

import dataclasses
import random

import pytest

from larqlpy.text.reasoning import Markers, Reasoning
from larqlpy.text.reply_stream import CALL, CONTENT, REASONING, ReplyStream
from larqlpy.text.tools import tool_use
from test_tools import TOOLS

CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
THINK = Reasoning(Markers("<think>", "</think>"))


def pieces(text: str, stream: ReplyStream, seed: int) -> list[tuple[str, str]]:
    """`text` fed in random pieces; the pieces out, neighbouring texts of a kind joined, calls by name."""
    rng, out, at = random.Random(seed), [], 0
    while at < len(text):
        step = rng.randint(1, 6)
        out += stream.feed(text[at:at + step])
        at += step
    joined: list = []
    for kind, value in out + stream.close():
        value = value["function"]["name"] if kind == CALL else value
        if joined and kind != CALL and joined[-1][0] == kind:
            joined[-1] = (kind, joined[-1][1] + value)
        else:
            joined.append((kind, value))
    return joined


@pytest.mark.parametrize("text, parallel, reasoning, want", [
    ("\n\n" + CALL_W, True, None, [(CALL, "get_weather")]),  # blank before a call: not content
    ("  \n", True, None, [(CONTENT, "  \n")]),  # blank that no call follows: the answer's text
    ("\nIt is sunny.", True, None, [(CONTENT, "\nIt is sunny.")]),
    (CALL_W + "\n" + CALL_T, True, None, [(CALL, "get_weather"), (CALL, "get_time")]),
    (CALL_W + "\n" + CALL_T, False, None, [(CALL, "get_weather")]),  # one call where not parallel
    ("<think>hm, Paris</think>\n\n" + CALL_W, True, THINK, [(REASONING, "hm, Paris"), (CALL, "get_weather")]),
    ("<think>hm</think>It is 4.", True, THINK, [(REASONING, "hm"), (CONTENT, "It is 4.")]),
])
def test_pieces_whatever_the_feed(text, parallel, reasoning, want):
    use = dataclasses.replace(tool_use(TOOLS, "auto"), parallel=parallel)
    for seed in range(4):
        assert pieces(text, ReplyStream(use, reasoning), seed) == want


def test_without_tools_or_holding_text_passes_as_it_comes():
    stream = ReplyStream(None, None, hold_blank=False)
    assert stream.feed("\n") == [(CONTENT, "\n")] and stream.feed(CALL_W) == [(CONTENT, CALL_W)]
    assert stream.close() == []
    none = ReplyStream(dataclasses.replace(tool_use(TOOLS, "auto"), choice="none"), None)
    assert pieces(CALL_W, none, 0) == [(CONTENT, CALL_W)]  # tools offered, none to be called: all content
