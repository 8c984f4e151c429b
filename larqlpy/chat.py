"""A conversation with a model, turn by turn, on one engine state that lives across the turns.

Each turn renders the whole conversation with the model's chat template, and prefills only what the
state does not hold yet: the new user message and the template's framing around it. Where the
template renders earlier turns differently from the tokens the state holds (the reply's text
re-tokenized, a reply cut short), the state is cut back to the prefix they share, as `resume` does.
A conversation saves to a state file, messages included, and continues from it in another process.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from larqlpy.config import GenerationConfig
from larqlpy.engines import EngineSpec, build_provider
from larqlpy.engines.stores.base import EngineState
from larqlpy.errors import LarqlError
from larqlpy.generate import Token, stream_generate
from larqlpy.model.chat_template import ChatTemplate
from larqlpy.model.messages import check_messages
from larqlpy.model.loader import LoadedModel
from larqlpy.runner import fit_context
from larqlpy.session import align, resume, save


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int  # the whole rendered conversation
    prefilled_tokens: int  # what this turn ran through prefill (the rest the state held)
    generated_tokens: int
    finish_reason: str | None
    seconds: float


class ChatSession:
    def __init__(self, loaded: LoadedModel, spec: EngineSpec | None = None,
                 gen: GenerationConfig = GenerationConfig(), template: ChatTemplate | None = None,
                 system: str | None = None):
        """`spec`: the engine (default canonical/v1; given, a loaded conversation must match it)."""
        if spec is not None and spec.replay:
            raise LarqlError("`engine` no-cache keeps no state between turns: a chat needs one")
        self.loaded, self.spec, self.chosen, self.gen = loaded, spec or EngineSpec(), spec is not None, gen
        self.template = template or ChatTemplate.for_tokenizer(loaded.tokenizer)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.state: EngineState | None = None
        self.tokens: list[int] = []  # the conversation's ids; the state holds tokens[:state.position]
        self.turns: list[Turn] = []

    def new_state(self) -> EngineState:
        return build_provider(self.spec).new_state(self.loaded.model.geometries(), self.loaded.device)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The conversation rendered for the assistant's next turn, as ids (the template brings BOS)."""
        return self.loaded.tokenizer.encode(self.template.render(messages, add_generation_prompt=True), add_bos=False)

    def send(self, text: str) -> Iterator[Token]:
        """The assistant's reply to `text`, token by token. Stopping early (Ctrl-C, closing the
        iterator) keeps the reply so far as the assistant's turn."""
        messages = [*self.messages, {"role": "user", "content": text}]
        check_messages(messages)
        ids = self.prompt_ids(messages)
        gen, _ = fit_context(self.gen, len(ids), self.loaded.config.max_position_embeddings)
        if self.state is None or align(self.state, self.tokens, ids, None) is None:
            self.state = self.new_state()  # nothing held, or the engine cannot go back to the shared prefix
        held, reply, last, t0 = self.state.position, [], None, time.perf_counter()
        tok = self.loaded.tokenizer
        try:
            for last in stream_generate(self.loaded.model, ids, self.spec, gen, tok.stop_ids, tok, self.state):
                reply.append(last.id)
                yield last
        finally:
            content = tok.decode([i for i in reply if i not in tok.stop_ids])
            self.messages = [*messages, {"role": "assistant", "content": content}]
            self.tokens = ids + reply
            self.turns.append(Turn(len(ids), len(ids) - held, len(reply), last.finish_reason if last else None,
                                   time.perf_counter() - t0))

    def reply(self, text: str) -> str:
        return "".join(t.text for t in self.send(text))

    def stats(self) -> dict:
        state = self.state
        return {"turns": [dataclasses.asdict(t) for t in self.turns], "messages": len(self.messages),
                "position": state.position if state else 0, "tokens": len(self.tokens),
                "resident_kv_bytes": state.resident_bytes() if state else 0, "engine": self.spec.describe()}

    def save(self, path: str | Path) -> int:
        if self.state is None:
            raise LarqlError("nothing to save yet: the conversation has no turns")
        return save(self.loaded, path, self.state, self.tokens, extra={"chat": {"messages": self.messages}})

    def load(self, path: str | Path) -> None:
        """Continue the conversation saved in `path` (its engine, messages and state)."""
        plan, ids = resume(self.loaded, path, None, self.spec if self.chosen else None)
        messages = plan.extra.get("chat", {}).get("messages")
        if messages is None:
            raise LarqlError(f"{path}: holds no conversation (saved by a run, not a chat)")
        check_messages(messages)
        self.spec, self.state, self.tokens, self.messages = plan.spec, plan.state, ids, list(messages)
        self.turns = []
