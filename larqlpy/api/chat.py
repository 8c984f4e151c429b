"""A conversation with a model, turn by turn, on one engine state that lives across the turns.

Each turn is a request of the whole conversation, rendered with the model's chat template; the
session hands that request its state so far (`Given`), so a turn prefills only what the state does not hold yet:
the new user message and the template's framing around it. Where the template renders earlier
turns differently from the tokens the state holds (the reply's text re-tokenized, a reply cut
short), the state is cut back to the prefix they share, as a resumed state is. A conversation saves
to a state file, messages included, and continues from it in another process.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from larqlpy.config import GenerationConfig
from larqlpy.decode.output import Token
from larqlpy.decode.stream import generate_step
from larqlpy.engines import EngineSpec
from larqlpy.errors import LarqlError
from larqlpy.pipeline.prepare import prepare
from larqlpy.pipeline.request import Request
from larqlpy.state.format import load_state
from larqlpy.state.saved import restore, save, saved_spec
from larqlpy.state.sources import Given, Held
from larqlpy.text.messages import check_messages
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
                 system: str | None = None):
        """`spec`: the engine (default canonical/v1; given, a loaded conversation must match it);
        `chat_template`: a template file instead of the model's."""
        self.spec = (spec or EngineSpec()).stateful("hold a conversation")
        self.loaded, self.chosen, self.gen, self.chat_template = loaded, spec is not None, gen, chat_template
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.held: Held | None = None  # the conversation's state, and the ids it stands for
        self.turns: list[Turn] = []

    @property
    def state(self):
        return self.held.state if self.held is not None else None

    @property
    def tokens(self) -> list[int]:
        return self.held.tokens if self.held is not None else []

    def send(self, text: str) -> Iterator[Token]:
        """The assistant's reply to `text`, token by token. Stopping early (Ctrl-C, closing the
        iterator) keeps the reply so far as the assistant's turn."""
        messages = [*self.messages, {"role": "user", "content": text}]
        check_messages(messages)
        req = Request(messages=tuple(messages), chat_template=self.chat_template, gen=self.gen)
        seq = prepare(self.loaded, req, source=Given(self.held), spec=self.spec)  # the state so far
        t0 = time.perf_counter()
        try:
            yield from generate_step(self.loaded.model, seq)
        finally:
            tok = self.loaded.tokenizer
            content = seq.text if seq.finish_reason is not None else tok.decode(
                [i for i in seq.generated if i not in tok.stop_ids])
            self.messages = [*messages, {"role": "assistant", "content": content}]
            self.held = seq.held()
            held_from = seq.held_from if seq.state is not None else 0
            self.turns.append(Turn(len(seq.prompt_ids), len(seq.prompt_ids) - held_from, len(seq.output),
                                   seq.finish_reason, time.perf_counter() - t0))

    def reply(self, text: str) -> str:
        return "".join(t.text for t in self.send(text))

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
        self.held, self.turns = None, []
