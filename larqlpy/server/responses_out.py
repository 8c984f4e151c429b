"""The Responses API's answers: the response object (its output items -- a thinking model's
reasoning item, an assistant message with one output_text part, function_call items -- status,
usage with the cached tokens a kept state held), the streamed events (`Events`), and the assistant
message the response adds to its chain's conversation (`assistant`)."""

from __future__ import annotations

import json
import secrets
import time

from larqlpy.decode.sequence import Sequence
from larqlpy.server.openai import cached, extra
from larqlpy.text.reasoning import split
from larqlpy.text.reply_stream import CONTENT, REASONING, ReplyStream
from larqlpy.text.tools import read_reply


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": "msg_" + secrets.token_hex(16), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def call_item(call: dict, status: str = "completed") -> dict:
    """An OpenAI tool call (text/tools.py reads them so) as a function_call item."""
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + secrets.token_hex(16), "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": "rs_" + secrets.token_hex(16), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def called(items: list[dict]) -> bool:
    return any(i["type"] == "function_call" for i in items)


def output(seq: Sequence) -> list[dict]:
    thought, content = split(seq.text, seq.request.reasoning)
    reply = read_reply(content, seq.request.tools)
    items = [reasoning_item(thought)] if thought is not None else []
    items += [message_item(reply.content)] if reply.content or not reply.calls else []
    return items + [call_item(c) for c in reply.calls]


def reasoning_tokens(seq: Sequence) -> int:
    """The output's tokens up to the one that completes the reasoning block's closing marker (all of
    them when the block never closed); 0 for a model that does not think."""
    if seq.request.reasoning is None or split(seq.text, seq.request.reasoning).reasoning is None:
        return 0
    close, text, detok = seq.request.reasoning.markers.close, "", seq.tokenizer.stream()
    for i, tok in enumerate(seq.output):
        text += detok.step(tok)
        if close in text:
            return i
    return len(seq.output)


def assistant(items: list[dict]) -> dict:
    """The output items as the assistant's message in the chain's conversation."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def usage(seq: Sequence) -> dict:
    """OpenAI counts the cached tokens inside `input_tokens`: here, those a kept state held."""
    prompt, out = len(seq.prompt_ids), len(seq.output)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached(seq)}, "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(seq)}, "total_tokens": prompt + out}


def response(rid: str, model: str, echo: dict, created: float, items: list[dict], seq: Sequence | None) -> dict:
    """The response object; `seq` None: still in progress."""
    done = seq is not None
    incomplete = done and seq.finish_reason != "stop" and not called(items)
    return {"id": rid, "object": "response", "created_at": int(created), "model": model,
            "status": ("incomplete" if incomplete else "completed") if done else "in_progress",
            "completed_at": int(time.time()) if done and not incomplete else None, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "output": items, "usage": usage(seq) if done else None, **echo,
            **({"larqlpy": extra(seq)} if done else {})}


class Events:
    """A response's stream as the Responses API's events, each a dict with its `type` and
    `sequence_number`: response.created and .in_progress; then, as the text comes, a thinking
    model's reasoning item (output_item.added, reasoning_text.delta ..., reasoning_text.done,
    output_item.done), a message item
    (output_item.added, content_part.added, output_text.delta ..., output_text.done,
    content_part.done, output_item.done) or, where tools are offered, each call once it is whole
    (output_item.added, function_call_arguments.delta and .done, output_item.done); then
    response.completed (or .incomplete, cut at `max_output_tokens`). Blank text is held until
    something follows it: before a call it is not content."""

    def __init__(self, rid: str, model: str, echo: dict, seq: Sequence):
        self.reply = ReplyStream(seq.request.tools, seq.request.reasoning)
        self.thought, self.thinking = None, ""  # an open reasoning item
        self.rid, self.model, self.echo, self.created = rid, model, echo, time.time()
        self.n, self.items, self.text, self.open = 0, [], "", None

    def start(self) -> list[dict]:
        head = response(self.rid, self.model, self.echo, self.created, [], None)
        return [self._e("response.created", response=head), self._e("response.in_progress", response=head)]

    def feed(self, text: str) -> list[dict]:
        return self._pieces(self.reply.feed(text))

    def finish(self, seq: Sequence) -> tuple[list[dict], dict]:
        """The last events and the whole response object (an empty message where nothing else came)."""
        out = self._pieces(self.reply.close()) + self._thought_done()
        out += self._text("") if not self.items and self.open is None else []
        out += self._close()
        whole = response(self.rid, self.model, self.echo, self.created, self.items, seq)
        return out + [self._e(f"response.{whole['status']}", response=whole)], whole

    def cut(self) -> list[dict]:
        """Ended before its answer was whole (the server shut down): the open item closed."""
        return self._close()

    def error(self, message: str) -> dict:
        return self._e("error", code="server_error", message=message, param=None)

    def _e(self, kind: str, **fields) -> dict:
        self.n += 1
        return {"type": kind, "sequence_number": self.n - 1, **fields}

    def _pieces(self, pieces: list) -> list[dict]:
        out = []
        for kind, value in pieces:
            if kind == REASONING:
                out += self._thought(value)
            elif kind == CONTENT:
                out += self._thought_done() + self._text(value)
            else:
                out += self._thought_done() + self._close() + self._call(call_item(value))
        return out

    def _thought(self, text: str) -> list[dict]:
        out, at = [], len(self.items)
        if self.thought is None:
            self.thought = reasoning_item("", "in_progress")
            out.append(self._e("response.output_item.added", output_index=at, item=self.thought))
        self.thinking += text
        return out + [self._e("response.reasoning_text.delta", item_id=self.thought["id"], output_index=at,
                              content_index=0, delta=text)]

    def _thought_done(self) -> list[dict]:
        if self.thought is None:
            return []
        at, text, self.thinking = len(self.items), self.thinking, ""
        item = {**reasoning_item(text), "id": self.thought["id"]}
        self.items.append(item)
        self.thought = None
        return [self._e("response.reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                        text=text), self._e("response.output_item.done", output_index=at, item=item)]

    def _call(self, item: dict) -> list[dict]:
        at = len(self.items)
        self.items.append(item)
        started = {**item, "arguments": "", "status": "in_progress"}
        ids = {"item_id": item["id"], "output_index": at}
        return [self._e("response.output_item.added", output_index=at, item=started),
                self._e("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                self._e("response.function_call_arguments.done", **ids, name=item["name"],
                        arguments=item["arguments"]),
                self._e("response.output_item.done", output_index=at, item=item)]

    def _text(self, text: str) -> list[dict]:
        out = []
        if self.open is None:
            self.open, self.text = message_item("", "in_progress"), ""
            at = len(self.items)
            out += [self._e("response.output_item.added", output_index=at, item=self.open),
                    self._e("response.content_part.added", item_id=self.open["id"], output_index=at, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})]
        if text:
            self.text += text
            out.append(self._e("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items),
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        at, item = len(self.items), {**message_item(self.text), "id": self.open["id"]}
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        self.items.append(item)
        self.open = None
        return [self._e("response.output_text.done", **ids, text=self.text, logprobs=[]),
                self._e("response.content_part.done", **ids, part=item["content"][0]),
                self._e("response.output_item.done", output_index=at, item=item)]


def sse(event: dict) -> dict:
    return {"event": event["type"], "data": json.dumps(event)}
