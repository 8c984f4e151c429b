"""Run requests (request.py) on a loaded model, one alone or many batched: the record a run and each
batch line print."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from larqlpy.config import BatchConfig, GenerationConfig
from larqlpy.engines import build_provider
from larqlpy.errors import LarqlError
from larqlpy.generate import Token, stream_generate
from larqlpy.model.chat_template import ChatTemplate
from larqlpy.request import Request
from larqlpy.scheduler import Job, Scheduler
from larqlpy.session import resume, save


@dataclass
class Prepared:
    """A request made ready to run: its engine, ids, state (None: a fresh one) and settings."""

    req: Request
    spec: object  # EngineSpec
    ids: list[int]
    state: object  # EngineState | None
    logits: object  # torch.Tensor | None: a resumed state's, when it holds the whole prompt
    gen: GenerationConfig
    notes: list[str]
    session: dict


def prepare(loaded, req: Request) -> Prepared:
    """Everything before the first forward pass: the engine, the prompt's ids, a resumed or fresh
    state, the context check. Refusals raise LarqlError."""
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
    return Prepared(req, spec, ids, state, logits, gen, notes, session)


def record(loaded, p: Prepared, tokens: list[Token], state) -> dict:
    """The result record of a finished request (saving its state first when it asks)."""
    token_ids = [t.id for t in tokens]
    last = tokens[-1] if tokens else None
    session = dict(p.session)
    if p.req.save_state is not None:
        session["saved_to"] = p.req.save_state
        session["saved_bytes"] = save(loaded, Path(p.req.save_state), state, p.ids + token_ids)
    result = {"id": p.req.id, "text": "".join(t.text for t in tokens), "tokens": token_ids, "prompt_tokens": len(p.ids),
              "engine": p.spec.describe(), "finish_reason": last.finish_reason if last else "length",
              "device": str(loaded.device), "dtype": str(loaded.model.dtype).replace("torch.", ""), "weights": loaded.weights,
              "stats": last.metrics.as_dict() if last else {"prompt_tokens": len(p.ids)}, "error": None}
    if p.notes:
        result["notes"] = p.notes
    if state is not None and not p.spec.replay:
        result.update(state.report())
    if session:
        result["session"] = session
    return result


def execute(loaded, req: Request, on_token: Callable[[Token], None] | None = None) -> dict:
    """Run `req` alone and return its result record (text, token ids, engine, stats, session)."""
    p = prepare(loaded, req)
    tokens = []
    for tok in stream_generate(loaded.model, p.ids, p.spec, p.gen, loaded.tokenizer.stop_ids, loaded.tokenizer,
                               p.state, p.logits):
        tokens.append(tok)
        if on_token is not None:
            on_token(tok)
    return record(loaded, p, tokens, p.state)


def execute_many(loaded, requests: Iterable[tuple[Any, Request | str]], parallel: int | None = None,
                 kv_budget: int | None = None, step_tokens: int = BatchConfig.step_tokens,
                 on_step: Callable[[Scheduler], None] | None = None) -> Iterator[tuple[Any, dict]]:
    """Run requests together, continuously batched: (key, result record) as each finishes. A request
    given as a string is a refusal already made (its error record passes through); one refused
    while it is prepared or run becomes an error record; the others go on. `on_step` sees the
    scheduler after every step (progress)."""
    sched = Scheduler(loaded.model, parallel, kv_budget, step_tokens, loaded.tokenizer)
    live: dict[Any, tuple[Prepared, list[Token]]] = {}
    refused: list[tuple[Any, dict]] = []

    def jobs() -> Iterator[Job]:
        for key, req in requests:
            try:
                if isinstance(req, str):
                    raise LarqlError(req)
                p = prepare(loaded, req)
            except Exception as e:  # one bad request must not take the others down
                refused.append((key, error_record(req, failure(e))))
                continue
            live[key] = (p, [])
            yield Job(p.ids, p.spec, p.gen, frozenset(loaded.tokenizer.stop_ids), p.state, p.logits, key)

    source, more = jobs(), True
    while True:
        more = more and sched.fill(source)
        yield from refused
        refused.clear()
        if sched.idle() and not more:
            return
        try:
            events = sched.step()
        except Exception as e:  # e.g. non-finite logits: every sequence in that step shares the failure
            for key in [s.job.key for s in sched.live]:
                yield key, error_record(live.pop(key)[0].req, failure(e))
            sched.live.clear()
            continue
        for e in events:
            if e.token is not None:
                live[e.key][1].append(e.token)
            if e.done:
                p, tokens = live.pop(e.key)
                if e.error is not None:
                    yield e.key, error_record(p.req, e.error)
                    continue
                try:
                    rec = record(loaded, p, tokens, e.state)
                except Exception as err:  # saving its state failed
                    rec = error_record(p.req, failure(err))
                yield e.key, rec
        if on_step is not None:
            on_step(sched)


def failure(e: Exception) -> str:
    return str(e) if isinstance(e, LarqlError) else f"{type(e).__name__}: {e}"


def error_record(req: Request | str, message: str) -> dict:
    rid = req.id if isinstance(req, Request) else None
    return {"id": rid, "text": None, "tokens": None, "stats": None, "error": message}


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
