"""One generation request, as a run and each line of a batch describe it (plain Python, no torch).

`Request.from_dict` reads the flat JSON / CLI spelling (unknown keys ignored); `spec()` makes every
refusal before any weights load. runner.py runs it. Every problem is a LarqlError.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from larqlpy.config import GenerationConfig
from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.errors import LarqlError


@dataclass(frozen=True)
class Request:
    prompt: str
    id: Any = None
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
            raise LarqlError("expected a JSON object")
        prompt = raw.get("prompt")
        if not isinstance(prompt, str):
            raise LarqlError("'prompt' must be a string")
        opts = raw.get("options", raw.get("continuation_options", ()))
        if isinstance(opts, dict):
            opts = tuple(f"{k}={v}" for k, v in opts.items())
        elif isinstance(opts, (list, tuple)) and all(isinstance(o, str) for o in opts):
            opts = tuple(opts)
        else:
            raise LarqlError("'options' must be an object or a list of 'key=value' strings")
        for key in ("engine", "continuation", "kv_budget", "resume", "save_state"):
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
            continuation = "cells/v1"
            options.append(f"budget={self.kv_budget}")
        chosen = self.engine is not None or continuation is not None or options
        spec = parse_engine_spec(self.engine, continuation, options) if chosen or self.resume is None else None
        if spec is not None and spec.replay and (self.save_state or self.resume):
            raise LarqlError("`engine` no-cache keeps no attention state: it cannot be saved or resumed")
        if self.reprefill and self.resume is None:
            raise LarqlError("`reprefill` only makes sense with `resume`")
        return spec
