"""The OpenAI API as larqlpy serves it (/v1/completions, /v1/chat/completions): a body read into a
`Request` (`read_request`: every refusal a LarqlError, before anything queues), and the answer's
shapes -- the response, the streamed chunks, usage, log-probabilities and tool-call deltas. The
checks every spelling shares are pipeline/request.py's."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from larqlpy.config import MAX_LOGPROBS, GenerationConfig
from larqlpy.decode.logits import Logprob, described
from larqlpy.decode.sequence import Sequence
from larqlpy.errors import LarqlError
from larqlpy.files import utf8
from larqlpy.pipeline.request import (SHAPING, Request, chat_settings, choices, generation, integer, messages_of,
                                      number, stops, token_ids, tools_of)
from larqlpy.server.protocol import ApiError, boolean, extension
from larqlpy.text.reasoning import Reasoning, split
from larqlpy.text.reply_stream import CONTENT, REASONING, ReplyStream
from larqlpy.text.tools import ToolUse, read_reply

# OpenAI fields that would change what is generated and that larqlpy does not implement: refused,
# not ignored. Anything else unknown (user, metadata, ...) is ignored, as OpenAI ignores it.
UNSUPPORTED = ("best_of", "echo", "suffix", "functions", "function_call", "audio", "modalities", "prediction")
MAX_STOPS = 4  # OpenAI's limit on `stop`

def read_request(body: dict, chat: bool, max_tokens_limit: int | None = None,
             default: Request | None = None) -> Request:
    """An OpenAI /v1/completions or /v1/chat/completions body (the fields that shape the answer's
    form -- model, stream -- are the server's); `default` gives the engine when the body's
    "larqlpy" object names none."""
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False):
            raise LarqlError(f"`{key}` is not supported by this server")
    engine, extra = extension(body.get("larqlpy"), default or Request())
    if body.get("logit_bias") is not None and extra.get("logit_bias") is not None:
        raise LarqlError("give `logit_bias` once: the `larqlpy` object's is for APIs without one")
    thinking = {"reasoning_effort": body.get("reasoning_effort"), "thinking_budget": extra.pop("thinking_budget", None),
                "chat_template_kwargs": body.get("chat_template_kwargs")} if chat else {}
    gen = generation({"max_tokens": _max_tokens(body, chat, max_tokens_limit),
                       "temperature": number(body, "temperature", 0.0, 2.0, default=1.0),
                       "top_p": number(body, "top_p", 0.0, 1.0, default=1.0, lo_open=True),
                       "seed": integer(body, "seed"), "stop": stops(body.get("stop"), MAX_STOPS),
                       **_openai_shaping(body, chat), **extra, **thinking})
    n = choices(body)
    if chat:
        req = Request(messages=messages_of(body.get("messages")), gen=gen, tools=tools_of(body, gen), n=n,
                      **chat_settings(thinking), **engine)
    elif body.get("tools") is not None:
        raise LarqlError("`tools` need /v1/chat/completions")
    else:
        req = _completion_prompt(Request(gen=gen, n=n, **engine), body.get("prompt"))
    req.spec()
    return req


def _openai_shaping(body: dict, chat: bool) -> dict[str, Any]:
    """OpenAI's log-probability, penalty, bias and response-format fields as the flat spelling's.
    Chat asks with `logprobs: true` and `top_logprobs`; completions with `logprobs: N`."""
    out: dict[str, Any] = {k: number(body, k, -2.0, 2.0) for k in SHAPING[:2]}
    out["logit_bias"], out["response_format"] = body.get("logit_bias"), body.get("response_format")
    if chat:
        wants = body.get("logprobs")
        if wants is not None and not isinstance(wants, bool):
            raise LarqlError("`logprobs` must be a boolean")
        top = integer(body, "top_logprobs")
        if top is not None and not wants:
            raise LarqlError("`top_logprobs` needs `logprobs`: true")
        out["logprobs"] = (top or 0) if wants else None
    else:
        out["logprobs"] = integer(body, "logprobs")
    if out["logprobs"] is not None and not 0 <= out["logprobs"] <= MAX_LOGPROBS:
        raise LarqlError(f"`{'top_logprobs' if chat else 'logprobs'}` must be in 0..{MAX_LOGPROBS}")
    return out


def _max_tokens(body: dict, chat: bool, limit: int | None) -> int:
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    n = integer(body, key)
    if n is None:
        n = 256 if chat else GenerationConfig.max_tokens
        return n if limit is None else min(n, limit)
    if n < 0:
        raise LarqlError(f"`{key}` must be >= 0, got {n}")
    if limit is not None and n > limit:
        raise LarqlError(f"`{key}` is {n:,}; this server allows at most {limit:,}")
    return n


def _completion_prompt(req: Request, prompt: Any) -> Request:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        utf8(prompt, "`prompt`")
        return dataclasses.replace(req, prompt=prompt)
    return req.with_ids(token_ids(prompt if isinstance(prompt, list) else None))


def streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(400, "'stream_options' must be an object, and only with 'stream': true", param="stream_options")
    return stream, bool((options or {}).get("include_usage", False))


# -- the answer ------------------------------------------------------------------------------------

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
           "continuation_refused": seq.info.get("refused"), "tokens": list(seq.output), "notes": seq.notes,
           "compile_seconds": round(seq.metrics().compile_seconds, 6) if seq.state is not None else 0.0}
    if seq.verifier is not None and seq.verifier.steps:  # speculative decoding
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
    thought, content = split(seq.text, seq.request.reasoning)
    reply = read_reply(content, seq.request.tools)
    message = {"role": "assistant", "content": reply.content}
    if thought is not None:
        message["reasoning_content"] = thought  # as vLLM and DeepSeek spell it
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
    """A chat stream's deltas for its text as it comes: a thinking model's reasoning
    (`reasoning_content`), then content, or, where tools are offered, each call once it is whole --
    its id and name first, then its arguments, in OpenAI's shape."""

    def __init__(self, use: ToolUse | None, reasoning: Reasoning | None = None):
        self.reply, self.n = ReplyStream(use, reasoning, hold_blank=False), 0  # n: calls sent

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self.reply.feed(text))

    def close(self) -> list[dict]:
        return self._deltas(self.reply.close())

    def _deltas(self, pieces: list) -> list[dict]:
        out = []
        for kind, value in pieces:
            if kind == REASONING:
                out.append({"reasoning_content": value})
            elif kind == CONTENT:
                out.append({"content": value})
            else:
                fn = value["function"]
                out += [{"tool_calls": [{"index": self.n, "id": value["id"], "type": "function",
                                         "function": {"name": fn["name"], "arguments": ""}}]},
                        {"tool_calls": [{"index": self.n, "function": {"arguments": fn["arguments"]}}]}]
                self.n += 1
        return out
