"""One generation request, as `larqlpy run` and each line of `larqlpy batch` describe it.

`Request.from_dict` reads the flat JSON / CLI spelling (unknown keys ignored); `execute` runs it on a
loaded model and returns the result record both commands print. Every problem is a LarqlError.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from larqlpy.engines import EngineSpec, build_provider, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.generate import GenerationConfig, Token, generate


@dataclass(frozen=True)
class Request:
    prompt: str
    id: Any = None
    engine: str | None = None
    continuation: str | None = None
    options: tuple[str, ...] = ()  # "key=value" strings, as --continuation-option
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
                raise LarqlError("--kv-budget applies to cells/v1: drop --engine, or use --continuation cells/v1")
            continuation = "cells/v1"
            options.append(f"budget={self.kv_budget}")
        chosen = self.engine is not None or continuation is not None or options
        spec = parse_engine_spec(self.engine, continuation, options) if chosen or self.resume is None else None
        if spec is not None and spec.replay and (self.save_state or self.resume):
            raise LarqlError("--engine no-cache keeps no attention state: it cannot be saved or resumed")
        if self.reprefill and self.resume is None:
            raise LarqlError("--reprefill only makes sense with --resume")
        return spec


def execute(loaded, req: Request, on_token: Callable[[Token], None] | None = None) -> dict:
    """Run `req` and return its result record (text, token ids, engine, stats, session)."""
    from larqlpy.session import resume, save

    spec = req.spec()
    session: dict = {}
    if req.resume is not None:
        prompt_ids = None if req.prompt == "" else loaded.tokenizer.encode(req.prompt)
        plan, ids = resume(loaded, req.resume, prompt_ids, spec, req.reprefill)
        spec, state, logits = plan.spec, plan.state, plan.logits
        session = {"resumed_from": req.resume, "reused_tokens": plan.reused, "trimmed_from": plan.trimmed_from}
    else:
        ids = loaded.tokenizer.encode(req.prompt)
        state = None if spec.replay else build_provider(spec).new_state(loaded.model.geometries(), loaded.device)
        logits = None
    texts, token_ids, last = [], [], None
    for tok in generate(loaded.model, ids, spec, req.gen, loaded.tokenizer.stop_ids, loaded.tokenizer, state, logits):
        texts.append(tok.text)
        token_ids.append(tok.id)
        last = tok
        if on_token is not None:
            on_token(tok)
    if req.save_state is not None:
        session["saved_to"] = req.save_state
        session["saved_bytes"] = save(loaded, Path(req.save_state), state, ids + token_ids)
    result = {"id": req.id, "text": "".join(texts), "tokens": token_ids, "prompt_tokens": len(ids),
              "engine": spec.describe(), "finish_reason": last.finish_reason if last else "length",
              "device": str(loaded.device), "dtype": str(loaded.model.dtype).replace("torch.", ""), "weights": loaded.weights,
              "stats": last.metrics.as_dict() if last else {"prompt_tokens": len(ids)}, "error": None}
    if state is not None:
        result.update(state.report())
    if session:
        result["session"] = session
    return result
