"""The OpenAI API's shapes as larqlpy serves them: the body read into JSON, the fields that shape the
answer (model, stream), the error body, and the response and chunk objects. What a body asks to
generate is read by `Request.from_openai`; its refusals become 400s here (`invalid`)."""

from __future__ import annotations

import json
import time

from larqlpy.decode.logits import Logprob, described
from larqlpy.decode.sequence import Sequence
from larqlpy.errors import NAMED, LarqlError
from larqlpy.files import check_fields
from larqlpy.text.tools import CallStream, ToolUse, read_reply


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(e: LarqlError) -> ApiError:
    """A refusal as a 400, its parameters spelled as the JSON fields are ('max_tokens'), the first
    one named as the error's param."""
    first = NAMED.search(e.message)
    return ApiError(400, e.render(lambda name: f"'{name}'"), param=first.group(1) if first else None)


def parse_body(raw: bytes, limit: int) -> dict:
    if len(raw) > limit:
        raise ApiError(413, f"the request body is {len(raw):,} bytes; the limit is {limit:,}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, "the request body is not valid JSON "
                            f"({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        check_fields(body)
    except LarqlError as e:
        raise invalid(e) from None
    return body


def check_model(body: dict, name: str) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "'model' is required and must be a string", param="model")
    if model != name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{name}'",
                       param="model", code="model_not_found")


def streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(400, "'stream_options' must be an object, and only with 'stream': true", param="stream_options")
    return stream, bool((options or {}).get("include_usage", False))


# -- responses --------------------------------------------------------------------------------------

def usage(seqs: list[Sequence]) -> dict:
    """A request's tokens: its prompt once, however many choices read it."""
    prompt, completion = len(seqs[0].prompt_ids), sum(len(s.output) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached(seqs[0])}}


def cached(seq: Sequence) -> int:
    """Prompt tokens a kept state already held."""
    return seq.held_from if seq.state is not None else 0


def extra(seq: Sequence) -> dict:
    """larqlpy's own fields beside OpenAI's."""
    out = {"engine": seq.spec.describe(), "cached_tokens": cached(seq),
           "continuation_refused": seq.info.get("refused"), "tokens": list(seq.output), "notes": seq.notes}
    if seq.target_steps:  # speculative decoding
        m = seq.metrics()
        out["speculative"] = {"proposed_tokens": m.proposed_tokens, "accepted_tokens": m.accepted_tokens,
                              "acceptance_rate": round(m.acceptance, 4), "target_steps": m.target_steps,
                              "tokens_per_target_step": round(m.tokens_per_step, 4)}
    return out


def logprobs(seq: Sequence, chat: bool, tokens: list[tuple[int, Logprob]], offset: int = 0) -> dict | None:
    """`tokens`' log-probabilities in the choice's shape: chat's `content` list, or completions'
    parallel lists (`offset`: where the first token's text begins in the completion); None when the
    request asked for none."""
    if seq.gen.logprobs is None:
        return None
    entries = [described(seq.tokenizer, t, lp) for t, lp in tokens]
    if chat:
        return {"content": entries}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def response(rid: str, chat: bool, model: str, seqs: list[Sequence]) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice(chat, seq, i) for i, seq in enumerate(seqs)], "usage": usage(seqs),
            "larqlpy": extra(seqs[0])}


def choice(chat: bool, seq: Sequence, index: int) -> dict:
    finish = seq.finish_reason or "length"
    lps = logprobs(seq, chat, list(zip(seq.output, seq.logprobs)))
    if not chat:
        return {"index": index, "text": seq.text, "finish_reason": finish, "logprobs": lps}
    reply = read_reply(seq.text, seq.request.tools)
    message = {"role": "assistant", "content": reply.content}
    if reply.calls:
        message["tool_calls"], finish = list(reply.calls), "tool_calls"
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": lps}


def chunk(rid: str, chat: bool, model: str, text: str | dict | None, finish: str | None, first: bool = False,
          lps: dict | None = None, index: int = 0) -> dict:
    """A streamed chunk: `text` new text, or (chat) a whole delta -- ChatDeltas' tool calls."""
    if chat:
        delta: dict = {"role": "assistant", "content": ""} if first else \
            ({} if text is None else text if isinstance(text, dict) else {"content": text})
        one = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lps}
    else:
        one = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": lps}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [one]}


class ChatDeltas:
    """A chat stream's deltas for its text as it comes: content, or, where tools are offered, each
    call once it is whole -- its id and name first, then its arguments, in OpenAI's shape."""

    def __init__(self, use: ToolUse | None):
        self.use = use
        self.calls = CallStream(use) if use is not None and use.choice != "none" else None
        self.n = 0  # calls sent

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.calls.feed(text) if self.calls is not None else [text])

    def close(self) -> list[dict]:
        return self._deltas(self.calls.close()) if self.calls is not None else []

    def _deltas(self, parts: list) -> list[dict]:
        out = []
        for p in parts:
            if isinstance(p, str):
                out += [{"content": p}] if p else []
            elif self.use.parallel or not self.n:
                fn = p["function"]
                out += [{"tool_calls": [{"index": self.n, "id": p["id"], "type": "function",
                                         "function": {"name": fn["name"], "arguments": ""}}]},
                        {"tool_calls": [{"index": self.n, "function": {"arguments": fn["arguments"]}}]}]
                self.n += 1
        return out
