"""Run one request (request.py) on a loaded model: the record a run and each batch line print."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from larqlpy.engines import build_provider
from larqlpy.generate import Token, stream_generate
from larqlpy.request import Request
from larqlpy.session import resume, save


def execute(loaded, req: Request, on_token: Callable[[Token], None] | None = None) -> dict:
    """Run `req` and return its result record (text, token ids, engine, stats, session)."""
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
    for tok in stream_generate(loaded.model, ids, spec, req.gen, loaded.tokenizer.stop_ids, loaded.tokenizer, state, logits):
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
