"""Run one request (request.py) on a loaded model: the record a run and each batch line print."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from larqlpy.config import GenerationConfig
from larqlpy.engines import build_provider
from larqlpy.errors import LarqlError
from larqlpy.generate import Token, stream_generate
from larqlpy.model.chat_template import ChatTemplate
from larqlpy.request import Request
from larqlpy.session import resume, save


def execute(loaded, req: Request, on_token: Callable[[Token], None] | None = None) -> dict:
    """Run `req` and return its result record (text, token ids, engine, stats, session)."""
    spec = req.spec()
    session: dict = {}
    prompt_ids = request_ids(loaded, req)
    if req.resume is not None:
        plan, ids = resume(loaded, req.resume, prompt_ids, spec, req.reprefill)
        spec, state, logits = plan.spec, plan.state, plan.logits
        session = {"resumed_from": req.resume, "reused_tokens": plan.reused, "trimmed_from": plan.trimmed_from}
    else:
        ids = prompt_ids
        state = None if spec.replay else build_provider(spec).new_state(loaded.model.geometries(), loaded.device)
        logits = None
    gen, notes = fit_context(req.gen, len(ids), loaded.config.max_position_embeddings)
    texts, token_ids, last = [], [], None
    for tok in stream_generate(loaded.model, ids, spec, gen, loaded.tokenizer.stop_ids, loaded.tokenizer, state, logits):
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
    if notes:
        result["notes"] = notes
    if state is not None:
        result.update(state.report())
    if session:
        result["session"] = session
    return result


def request_ids(loaded, req: Request) -> list[int] | None:
    """The request's prompt as ids: its conversation rendered with the chat template (which writes
    BOS itself), or its prompt; None for an empty prompt that continues a resumed state."""
    if req.messages is not None:
        text = ChatTemplate.for_tokenizer(loaded.tokenizer, req.chat_template).render(list(req.messages))
        return loaded.tokenizer.encode(text, add_bos=False)
    if req.prompt == "" and req.resume is not None:
        return None
    return loaded.tokenizer.encode(req.prompt)


def fit_context(gen: GenerationConfig, prompt_tokens: int, context: int) -> tuple[GenerationConfig, list[str]]:
    """The prompt and its output must fit the model's context: a prompt that fills it is refused; a
    `max_tokens` past it is capped to what is left, and the note says so."""
    if gen.max_tokens and prompt_tokens >= context:
        raise LarqlError(f"the prompt is {prompt_tokens:,} tokens; the model's context is {context:,} positions, "
                         "so nothing can be generated after it")
    room = context - prompt_tokens
    if gen.max_tokens <= room:
        return gen, []
    note = (f"`max_tokens` {gen.max_tokens:,} capped to {room:,}: the prompt's {prompt_tokens:,} tokens and the "
            f"output must fit the model's context of {context:,} positions")
    return dataclasses.replace(gen, max_tokens=room), [note]
