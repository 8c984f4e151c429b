"""A conversation with a model, turn by turn, on one engine state that lives across the turns.

Each turn is a request of the whole conversation, rendered with the model's chat template; the
session hands that request its state so far (`Given`), so a turn prefills only what the state does not hold yet:
the new user message and the template's framing around it. Where the template renders earlier
turns differently from the tokens the state holds (the reply's text re-tokenized, a reply cut
short), the state is cut back to the prefix they share, as a resumed state is. A conversation saves
to a state file, messages included, and continues from it in another process.

Tools (`tools`, `tool_choice`) and a grammar (`json_schema`, ...) apply to every turn as they do to
one request; a reply that calls tools is an assistant message with `tool_calls`, whose results go
back as `tool_result`s before the next `send()`. With `n` > 1 a turn makes several answers
(`respond`): the conversation goes on with the first, or with the one `pick` chooses.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from larqlpy.config import GenerationConfig
from larqlpy.decode.output import Token
from larqlpy.decode.scheduler import Scheduler
from larqlpy.decode.sequence import Sequence
from larqlpy.decode.stream import generate_step
from larqlpy.engines import EngineSpec
from larqlpy.errors import LarqlError
from larqlpy.pipeline.prepare import prepare, prepare_all
from larqlpy.pipeline.request import Request, messages_of
from larqlpy.state.format import load_state
from larqlpy.state.saved import restore, save, saved_spec
from larqlpy.state.sources import Given, Held
from larqlpy.text.chat_template import ChatTemplate
from larqlpy.text.messages import check_messages
from larqlpy.text.tools import ToolUse, read_reply, tool_use
from larqlpy.weights.loader import LoadedModel


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int  # the whole rendered conversation
    prefilled_tokens: int  # what this turn ran through prefill (the rest the state held)
    generated_tokens: int
    finish_reason: str | None
    seconds: float


class ChatSession:
    def __init__(self, loaded: LoadedModel, spec: EngineSpec | None = None,
                 gen: GenerationConfig = GenerationConfig(), chat_template: str | None = None,
                 system: str | None = None, tools: ToolUse | None = None, n: int = 1):
        """`spec`: the engine (default canonical/v1; given, a loaded conversation must match it);
        `chat_template`: a template file instead of the model's; `tools`: offered every turn (checked:
        pipeline/request.py's `tools_of`); `n`: answers a turn makes (`respond`)."""
        self.spec = (spec or EngineSpec()).stateful("hold a conversation")
        self.loaded, self.chosen, self.gen, self.chat_template = loaded, spec is not None, gen, chat_template
        if tools is not None:  # its convention known from the start: a caller reads calls as they stream
            tools = dataclasses.replace(tools, convention=ChatTemplate.for_tokenizer(loaded.tokenizer,
                                                                                     chat_template).convention)
        self.tools, self.n = tools, n
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.held: Held | None = None  # the conversation's state, and the ids it stands for
        self.turns: list[Turn] = []
        self.answers: list[tuple[dict, Held | None]] = []  # the last turn's answers, the kept one first

    @property
    def state(self):
        return self.held.state if self.held is not None else None

    @property
    def tokens(self) -> list[int]:
        return self.held.tokens if self.held is not None else []

    def send(self, text: str | None = None, tool_choice=None) -> Iterator[Token]:
        """The assistant's reply to `text`, token by token (None: to the tool results the conversation
        ends with); `tool_choice`: this turn's, instead of the session's. Stopping early (Ctrl-C,
        closing the iterator) keeps the reply so far as the assistant's turn."""
        if self.n > 1:
            raise LarqlError("`n` > 1 makes several answers a turn: ask `respond` for them")
        messages, req = self._request(text, tool_choice)
        seq = prepare(self.loaded, req, source=Given(self.held), spec=self.spec)  # the state so far
        t0 = time.perf_counter()
        try:
            yield from generate_step(self.loaded.model, seq)
        finally:
            self._keep(messages, [seq], t0)

    def respond(self, text: str | None = None, tool_choice=None) -> dict:
        """The assistant's whole reply as OpenAI's message -- {"role", "content", "tool_calls" (when it
        calls), "finish_reason"} -- and with `n` > 1 every answer's in "choices" (the conversation
        goes on with the first: `pick` another). The answers share one prefill of the conversation."""
        if self.n == 1:
            for _ in self.send(text, tool_choice):
                pass
            return self.answers[0][0]
        messages, req = self._request(text, tool_choice)
        seqs = prepare_all(self.loaded, req, spec=self.spec)
        t0 = time.perf_counter()
        try:
            for _ in Scheduler(self.loaded.model, len(seqs)).run(seqs):
                pass
        finally:
            self._keep(messages, seqs, t0)
        return {**self.answers[0][0], "choices": [{"index": i, **m} for i, (m, _) in enumerate(self.answers)]}

    def reply(self, text: str | None = None) -> str:
        return "".join(t.text for t in self.send(text))

    def tool_result(self, call_id: str, content: str) -> None:
        """A tool's result for the call `call_id` of the last reply, answered by the next `send()`."""
        last = next((m for m in reversed(self.messages) if m["role"] == "assistant"), {})
        if call_id not in {c["id"] for c in last.get("tool_calls") or ()}:
            raise LarqlError(f"no tool call {call_id!r} to give a result for")
        messages = [*self.messages, {"role": "tool", "tool_call_id": call_id, "content": content}]
        check_messages(messages)
        self.messages = messages

    def pick(self, index: int) -> dict:
        """Go on with answer `index` of the last turn (n > 1) instead of the first."""
        if not 0 <= index < len(self.answers):
            raise LarqlError(f"the last turn made {len(self.answers)} answers; pick 0..{len(self.answers) - 1}")
        message, self.held = self.answers[index]
        self.answers.insert(0, self.answers.pop(index))
        self.messages[-1] = _stored(message)
        return message

    def _request(self, text: str | None, tool_choice) -> tuple[list[dict], Request]:
        """The turn's conversation (the session's own changes only once the turn has run) and its request."""
        if text is None and (not self.messages or self.messages[-1]["role"] != "tool"):
            raise LarqlError("a turn needs a message, or tool results to answer")
        messages = [*self.messages, {"role": "user", "content": text}] if text is not None else self.messages
        use = self.tools
        if use is not None and tool_choice is not None:
            use = tool_use(list(use.tools), tool_choice, use.parallel)
            if use.forced and self.gen.grammar is not None:
                raise LarqlError("a required tool call is a grammar of its own: this session has a grammar")
        return messages, Request(messages=messages_of(messages), chat_template=self.chat_template, gen=self.gen,
                                 tools=use, n=self.n)

    def _keep(self, messages: list[dict], seqs: list[Sequence], t0: float) -> None:
        """The turn's answers, the first as the conversation's next message and its state as the
        conversation's."""
        self.answers = [(self._answer(s), s.held()) for s in seqs]
        self.held = self.answers[0][1]
        self.messages = [*messages, _stored(self.answers[0][0])]
        seq = seqs[0]
        held_from = seq.held_from if seq.state is not None else 0
        self.turns.append(Turn(len(seq.prompt_ids), len(seq.prompt_ids) - held_from, sum(len(s.output) for s in seqs),
                               seq.finish_reason, time.perf_counter() - t0))

    def _answer(self, seq: Sequence) -> dict:
        tok = self.loaded.tokenizer
        text = seq.text if seq.finish_reason is not None else tok.decode(
            [i for i in seq.generated if i not in tok.stop_ids])
        reply = read_reply(text, seq.request.tools)
        message = {"role": "assistant", "content": reply.content if reply.calls else text}
        if reply.calls:
            message["tool_calls"] = list(reply.calls)
        return {**message, "finish_reason": "tool_calls" if reply.calls else seq.finish_reason or "length"}

    def stats(self) -> dict:
        state = self.state
        return {"turns": [dataclasses.asdict(t) for t in self.turns], "messages": len(self.messages),
                "position": state.position if state else 0, "tokens": len(self.tokens),
                "resident_kv_bytes": state.resident_bytes() if state else 0, "engine": self.spec.describe()}

    def save(self, path: str | Path, what: str = "`path`") -> int:
        """The conversation, its state and messages, to `path` (`what` names it in a refusal)."""
        if self.held is None:
            raise LarqlError("nothing to save yet: the conversation has no turns")
        return save(self.loaded, path, self.held, extra={"chat": {"messages": self.messages}}, what=what)

    def load(self, path: str | Path) -> None:
        """Continue the conversation saved in `path` (its engine, messages and state)."""
        saved = load_state(path)
        messages = saved.header.get("chat", {}).get("messages")
        if messages is None:
            raise LarqlError(f"{path}: holds no conversation (saved by a run, not a chat)")
        check_messages(messages)
        spec = self.spec if self.chosen else saved_spec(saved)
        self.held, self.messages, self.spec, self.turns = restore(self.loaded, saved, spec), list(messages), spec, []

    def reset(self) -> None:
        """A new conversation: the system message stays."""
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.held, self.turns, self.answers = None, [], []


def _stored(message: dict) -> dict:
    """An answer as the conversation keeps it: OpenAI's message, no finish_reason."""
    return {k: v for k, v in message.items() if k != "finish_reason"}
