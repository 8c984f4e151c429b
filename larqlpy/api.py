"""The Python API: `larqlpy.load(path).generate(prompt, continuation=..., options=...)`."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

from larqlpy.chat import ChatSession
from larqlpy.config import GenerationConfig
from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.generate import Token, stream_generate
from larqlpy.model.chat_template import ChatTemplate
from larqlpy.model.loader import LoadedModel
from larqlpy.model.loader import load as load_dir


def engine_spec(engine: str | None = None, continuation: str | None = None,
                options: Mapping[str, object] | None = None) -> EngineSpec:
    """The same parser and refusals as every other interface's engine choice."""
    return parse_engine_spec(engine, continuation, [f"{k}={v}" for k, v in (options or {}).items()])


class Model:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer

    def generate(self, prompt: str | list[int], *, engine: str | None = None, continuation: str | None = None,
                 options: Mapping[str, object] | None = None, **gen: object) -> Iterator[Token]:
        """Yield tokens; `gen` takes GenerationConfig / SamplingConfig fields (max_tokens, temperature, ...)."""
        spec = engine_spec(engine, continuation, options)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return stream_generate(self.loaded.model, ids, spec, GenerationConfig.from_dict(dict(gen)),
                               stop_ids=self.tokenizer.stop_ids, tokenizer=self.tokenizer)

    def chat(self, messages: list[dict], *, chat_template: str | None = None, engine: str | None = None,
             continuation: str | None = None, options: Mapping[str, object] | None = None, **gen: object) -> Iterator[Token]:
        """The assistant's reply to a conversation ([{"role": ..., "content": ...}, ...]) rendered with
        the model's chat template (or the file `chat_template`); it stops at the end of its turn."""
        text = ChatTemplate.for_tokenizer(self.tokenizer, chat_template).render(messages)
        return self.generate(self.tokenizer.encode(text, add_bos=False), engine=engine, continuation=continuation,
                             options=options, **gen)

    def session(self, system: str | None = None, **kw) -> ChatSession:
        """A conversation that keeps its attention state across turns (larqlpy.chat.ChatSession)."""
        spec = engine_spec(kw.pop("engine", None), kw.pop("continuation", None), kw.pop("options", None)) \
            if {"engine", "continuation", "options"} & kw.keys() else None
        return ChatSession(self.loaded, spec, GenerationConfig.from_dict(kw), system=system)

    def complete(self, prompt: str | list[int], **kw) -> str:
        return "".join(t.text for t in self.generate(prompt, **kw))


def load(path: str | Path, device: str = "auto", dtype: str = "float32", weights: str = "f32") -> Model:
    """weights: f32 | bf16 | int8 | int4 (weight-only quantization at load; see docs/weights.md)."""
    return Model(load_dir(path, device=device, dtype=dtype, weights=weights))
