"""Anthropic's Messages API's answer (server/anthropic.py reads the request): the message whole --
a thinking model's reasoning as a thinking block, then text and tool_use blocks -- and as its
stream's events (`Events`), with stop reasons and usage."""

from __future__ import annotations

import hashlib
import json

from larqlpy.decode.sequence import Sequence
from larqlpy.server.openai import cached, extra
from larqlpy.text.reasoning import split
from larqlpy.text.reply_stream import CONTENT, REASONING, ReplyStream
from larqlpy.text.tools import read_reply


def message(mid: str, model: str, seq: Sequence) -> dict:
    thought, content = split(seq.text, seq.request.reasoning)
    reply = read_reply(content, seq.request.tools)
    blocks = [{"type": "thinking", "thinking": thought, "signature": signature(thought)}] if thought else []
    blocks += [{"type": "text", "text": reply.content}] if reply.content else []
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



def signature(thinking: str | None = None, digest=None) -> str:
    """A thinking block's signature: Anthropic's proves the block came from its model; this
    server's is an opaque string of its own -- a digest of the block's text (`digest`: one already
    fed) -- that it neither needs back nor checks (earlier reasoning comes back as text)."""
    digest = digest or hashlib.sha256((thinking or "").encode())
    return "larqlpy-" + digest.hexdigest()


class Events:
    """A message's stream as Anthropic's events, (event, data) pairs: message_start and a ping, then
    content blocks as the text comes -- a thinking model's reasoning as a thinking block
    (thinking_delta, then its signature_delta), text deltas, or, where tools are offered, each call as a
    tool_use block once it is whole (its input in one input_json_delta) -- then message_delta
    (stop_reason, usage) and message_stop. Blank text is held until something follows it: before
    a call it is not content."""

    def __init__(self, mid: str, model: str, seq: Sequence):
        self.reply = ReplyStream(seq.request.tools, seq.request.reasoning)
        self.thinking = None  # the open thinking block's digest
        self.index, self.open, self.called = 0, False, False
        self.head = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
                     "stop_reason": None, "stop_sequence": None,
                     # what a kept state holds is known once the sequence starts: message_delta says it
                     "usage": {"input_tokens": len(seq.prompt_ids), "output_tokens": 0,
                               "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}

    def start(self) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start", "message": self.head}), ("ping", {"type": "ping"})]

    def feed(self, text: str) -> list[tuple[str, dict]]:
        return self._events(self.reply.feed(text))

    def finish(self, seq: Sequence) -> list[tuple[str, dict]]:
        out = self._events(self.reply.close()) + self._thought() + self._close()
        reason = stop_reason(seq, self.called)
        delta = {"stop_reason": reason, "stop_sequence": seq.out.stop_string if reason == "stop_sequence" else None}
        return out + [("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(seq)}),
                      ("message_stop", {"type": "message_stop"})]

    def cut(self) -> list[tuple[str, dict]]:
        """Ended before its answer was whole (the server shut down): the open block closed."""
        return self._thought() + self._close()

    def _events(self, pieces: list) -> list[tuple[str, dict]]:
        out = []
        for kind, value in pieces:
            if kind == REASONING:
                out += self._thinking(value)
            elif kind == CONTENT:
                out += self._thought() + self._text(value)
            else:
                block = tool_use(value)
                out += self._thought() + self._close() + [
                    ("content_block_start", {"type": "content_block_start", "index": self.index,
                                             "content_block": {**block, "input": {}}}),
                    ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": value["function"]["arguments"]}}),
                    ("content_block_stop", {"type": "content_block_stop", "index": self.index})]
                self.index, self.called = self.index + 1, True
        return out

    def _thinking(self, text: str) -> list[tuple[str, dict]]:
        out = []
        if self.thinking is None:
            self.thinking = hashlib.sha256()
            block = {"type": "thinking", "thinking": "", "signature": ""}
            out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                                "content_block": block}))
        self.thinking.update(text.encode())
        return out + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "thinking_delta", "thinking": text}})]

    def _thought(self) -> list[tuple[str, dict]]:
        """The thinking block closed, with its signature."""
        if self.thinking is None:
            return []
        sig, self.thinking, self.index = signature(digest=self.thinking), None, self.index + 1
        return [("content_block_delta", {"type": "content_block_delta", "index": self.index - 1,
                                         "delta": {"type": "signature_delta", "signature": sig}}),
                ("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]

    def _text(self, text: str) -> list[tuple[str, dict]]:
        out = []
        if not self.open:
            self.open = True
            out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                                "content_block": {"type": "text", "text": ""}}))
        return out + [("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                               "delta": {"type": "text_delta", "text": text}})]

    def _close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open, self.index = False, self.index + 1
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})]
