"""The Python API: `larqlpy.load(path).generate(prompt, continuation=..., options=..., stop=...)`.
Each call is a request (`Request.from_api`) through the same `prepare` and decode loop as the CLI;
`embed` through the same embedding sequences and scheduler as the server's /v1/embeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

import torch

from larqlpy.api.chat import ChatSession
from larqlpy.decode.scheduler import Scheduler
from larqlpy.decode.output import Token
from larqlpy.decode.stream import generate_step
from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.pipeline.embed import embeddings, inputs_of, one_input
from larqlpy.pipeline.prepare import prepare
from larqlpy.pipeline.request import Request, choices, generation, tools_of
from larqlpy.pipeline.runner import execute
from larqlpy.weights.loader import LoadedModel, load_with_draft


def engine_spec(engine: str | None = None, continuation: str | None = None,
                options: Mapping[str, object] | None = None) -> EngineSpec:
    """The same parser and refusals as every other interface's engine choice."""
    return parse_engine_spec(engine, continuation, [f"{k}={v}" for k, v in (options or {}).items()])


class Model:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer

    def generate(self, prompt: str | list[int], **kw: object) -> Iterator[Token]:
        """Yield tokens. `kw`: engine / continuation / options, and GenerationConfig / SamplingConfig
        fields (max_tokens, temperature, stop, ...)."""
        return self._run(Request.from_api(prompt, **kw))

    def chat(self, messages: list[dict], **kw: object) -> Iterator[Token]:
        """The assistant's reply to a conversation ([{"role": ..., "content": ...}, ...]) rendered with
        the model's chat template (or the file `chat_template`); it stops at the end of its turn.
        `tools` / `tool_choice` (OpenAI's) are offered as the server offers them: the tokens are the
        call's text, which `respond` reads back as `tool_calls`."""
        return self._run(Request.from_api(messages=messages, **kw))

    def respond(self, messages: list[dict], **kw: object) -> dict:
        """The assistant's whole reply to a conversation as OpenAI's message -- {"role", "content",
        "tool_calls" (when `tools` were offered and called)} -- with its "finish_reason"; with `n` > 1
        every answer's in "choices". `json_schema` (or `regex`, `grammar`, `response_format`) holds
        the answer to a grammar."""
        result = execute(self.loaded, Request.from_api(messages=messages, **kw))
        out = _message(result)
        if "choices" in result:  # n > 1: every choice's, the first's also at the top
            out["choices"] = [{"index": c["index"], **_message(c)} for c in result["choices"]]
        return out

    def session(self, system: str | None = None, **kw) -> ChatSession:
        """A conversation that keeps its attention state across turns (larqlpy.api.chat.ChatSession);
        `kw` as `respond`'s (tools, tool_choice, json_schema, n, sampling), for every turn."""
        spec = engine_spec(kw.pop("engine", None), kw.pop("continuation", None), kw.pop("options", None)) \
            if {"engine", "continuation", "options"} & kw.keys() else None
        template = kw.pop("chat_template", None)
        gen = generation(kw)
        return ChatSession(self.loaded, spec, gen, template, system=system, tools=tools_of({**kw, "messages": ()}, gen),
                           n=choices(kw))

    def embed(self, texts: str | list[str] | list[int] | list[list[int]], pooling: str | None = None) -> torch.Tensor:
        """Unit-length embeddings of `texts` (a string, strings, token ids, or lists of ids): the final
        hidden state, after the final norm, pooled over each input's positions -- "last" (default) or
        "mean" -- batched through the scheduler as the server batches them. (N, hidden) float32, or
        (hidden,) for one text or one list of ids; `.tolist()` gives lists."""
        seqs = embeddings(self.loaded, inputs_of(texts), pooling)
        for _ in Scheduler(self.loaded.model).run(seqs):
            pass
        failed = next((s.error for s in seqs if s.error is not None), None)
        if failed is not None:
            raise LarqlError(failed)
        vectors = torch.stack([s.vector for s in seqs])
        return vectors[0] if one_input(texts) else vectors

    def complete(self, prompt: str | list[int], **kw) -> str:
        return "".join(t.text for t in self.generate(prompt, **kw))

    def _run(self, req: Request) -> Iterator[Token]:
        if req.n > 1:
            raise LarqlError("`n` > 1 makes several answers: ask `respond` for them")
        seq = prepare(self.loaded, req)  # refusals now, not at the first token
        return generate_step(self.loaded.model, seq)


def _message(result: dict) -> dict:
    message = {"role": "assistant", "content": result.get("content", result["text"])}
    if result.get("reasoning") is not None:  # a thinking model's, as the server's chat completions say it
        message["reasoning_content"] = result["reasoning"]
    if result.get("tool_calls"):
        message["tool_calls"] = result["tool_calls"]
    return {**message, "finish_reason": result["finish_reason"]}


def load(path: str | Path, device: str = "auto", dtype: str = "float32", weights: str | None = None,
         kv_dtype: str | None = None, draft: str | Path | None = None, draft_weights: str | None = None,
         pre_tokenizer: str | None = None) -> Model:
    """path: a model directory or a .gguf file. weights: f32 | bf16 | int8 | int4 | native (weight-only
    quantization at load; see docs/weights.md); None: what the files hold (native for a .gguf).
    kv_dtype: f32 | f16 | bf16, what exact K/V rows are kept in; None: f16, or f32 beside f32 weights.
    draft: a smaller model of the same vocabulary that proposes `draft_tokens` ids a step
    (speculative decoding, docs/speculative.md); draft_weights: its `weights` (None: what its files hold).
    pre_tokenizer: a GGUF's text split as this llama.cpp pre-tokenizer name does (docs/weights.md), not as
    its tokenizer.ggml.pre says."""
    return Model(load_with_draft(path, draft, draft_weights=draft_weights, device=device, dtype=dtype,
                                 weights=weights, kv_dtype=kv_dtype, pre_tokenizer=pre_tokenizer))
