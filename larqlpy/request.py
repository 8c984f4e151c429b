"""One generation request, as a run and each line of a batch describe it (plain Python, no torch).

`Request.from_dict` reads the flat JSON / CLI spelling (unknown keys ignored); `spec()` makes every
refusal before any weights load. runner.py runs it. Every problem is a LarqlError.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from larqlpy.config import GenerationConfig
from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.engines.options import parse_size
from larqlpy.errors import LarqlError
from larqlpy.files import check_output, utf8
from larqlpy.model.messages import check_messages


@dataclass(frozen=True)
class Request:
    prompt: str  # "" with `messages`
    id: Any = None
    messages: tuple[dict, ...] | None = None  # a conversation, rendered with the model's chat template
    chat_template: str | None = None  # a template file instead of the model's
    engine: str | None = None
    continuation: str | None = None
    options: tuple[str, ...] = ()  # "key=value" strings
    kv_budget: str | None = None
    resume: str | None = None
    save_state: str | None = None
    reprefill: bool = False
    gen: GenerationConfig = field(default_factory=GenerationConfig)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Request":
        if not isinstance(raw, dict):
            raise LarqlError(f"expected a JSON object, got {_json_type(raw)}")
        messages = raw.get("messages")
        if messages is not None:
            if raw.get("prompt") not in (None, ""):
                raise LarqlError("give 'prompt' or 'messages', not both")
            check_messages(messages)
            for m in messages:
                utf8(m["content"], "'messages'")
            raw = {**raw, "prompt": "", "messages": tuple(dict(m) for m in messages)}
        prompt = raw.get("prompt")
        if not isinstance(prompt, str):
            raise LarqlError("'prompt' must be a string")
        utf8(prompt, "'prompt'")  # a JSON \\ud800 escape is a str no tokenizer can take
        opts = raw.get("options", raw.get("continuation_options", ()))
        if isinstance(opts, dict):
            opts = tuple(f"{k}={v}" for k, v in opts.items())
        elif isinstance(opts, (list, tuple)) and all(isinstance(o, str) for o in opts):
            opts = tuple(opts)
        else:
            raise LarqlError("'options' must be an object or a list of 'key=value' strings")
        for key in ("engine", "continuation", "kv_budget", "resume", "save_state", "chat_template"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise LarqlError(f"'{key}' must be a string")
        for key in ("max_tokens", "top_k", "seed", "prefill_chunk"):
            if raw.get(key) is not None and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
                raise LarqlError(f"'{key}' must be an integer")
        for key in ("temperature", "top_p"):
            if raw.get(key) is not None and (not isinstance(raw[key], (int, float)) or isinstance(raw[key], bool)):
                raise LarqlError(f"'{key}' must be a number")
        own = {f.name for f in fields(cls)} - {"gen", "options", "prompt"}
        return cls(prompt=prompt, options=opts, gen=GenerationConfig.from_dict(raw),
                   **{k: raw[k] for k in own if raw.get(k) is not None})

    def spec(self) -> EngineSpec | None:
        """The engine spec, or None to take a resumed state's own. Refusals happen here."""
        continuation, options = self.continuation, list(self.options)
        if self.kv_budget is not None:
            if self.engine is not None or continuation not in (None, "cells/v1"):
                raise LarqlError("`kv_budget` applies to cells/v1: drop `engine`, or use `continuation` cells/v1")
            if any(o.partition("=")[0].strip() == "budget" for o in options):
                raise LarqlError("`kv_budget` and the cells/v1 option budget are one setting; give one")
            try:
                parse_size(self.kv_budget)
            except ValueError as e:
                raise LarqlError(f"`kv_budget`: {e}") from None
            continuation = "cells/v1"
            options.append(f"budget={self.kv_budget}")
        chosen = self.engine is not None or continuation is not None or options
        spec = parse_engine_spec(self.engine, continuation, options) if chosen or self.resume is None else None
        if spec is not None and spec.replay and (self.save_state or self.resume):
            raise LarqlError("`engine` no-cache keeps no attention state: it cannot be saved or resumed")
        if self.reprefill and self.resume is None:
            raise LarqlError("`reprefill` only makes sense with `resume`")
        if self.save_state is not None:
            check_output(self.save_state, "`save_state`")
        return spec


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)
