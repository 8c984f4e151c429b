"""Run requests (request.py) on a loaded model, one alone or many batched: the record a run and each
batch line print. Both go through `prepare` and the one decode loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from larqlpy.budget import KVBudget
from larqlpy.config import BatchConfig
from larqlpy.decode.logits import described
from larqlpy.decode.scheduler import Scheduler
from larqlpy.decode.sequence import Sequence, Token
from larqlpy.decode.stream import generate_step
from larqlpy.errors import LarqlError, failure
from larqlpy.prepare import prepare
from larqlpy.request import Request
from larqlpy.session import save
from larqlpy.text.tools import read_reply


def execute(loaded, req: Request, on_token: Callable[[Token], None] | None = None) -> dict:
    """Run `req` alone and return its result record (text, token ids, engine, stats, session)."""
    seq = prepare(loaded, req)
    for tok in generate_step(loaded.model, seq):
        if on_token is not None:
            on_token(tok)
    return record(loaded, seq)


def execute_many(loaded, requests: Iterable[tuple[Any, Request | str]], parallel: int | None = None,
                 kv_budget: int | None = None, step_tokens: int = BatchConfig.step_tokens,
                 on_step: Callable[[Scheduler], None] | None = None) -> Iterator[tuple[Any, dict]]:
    """Run requests together, continuously batched: (key, result record) as each finishes. A request
    given as a string is a refusal already made (its error record passes through); one refused
    while it is prepared or run becomes an error record; the others go on. `on_step` sees the
    scheduler after every step (progress)."""
    sched = Scheduler(loaded.model, parallel, KVBudget(kv_budget), step_tokens)
    refused: list[tuple[Any, dict]] = []

    def sequences() -> Iterator[Sequence]:
        for key, req in requests:
            try:
                if isinstance(req, str):
                    raise LarqlError(req)
                yield prepare(loaded, req, key=key)
            except Exception as e:  # one bad request must not take the others down
                refused.append((key, error_record(req, failure(e))))

    for event in sched.run(sequences(), on_step):
        yield from _drain(refused)
        if event.token is None:
            yield event.seq.key, finished_record(loaded, event.seq)
    yield from _drain(refused)


def _drain(items: list) -> Iterator:
    while items:
        yield items.pop(0)


def finished_record(loaded, seq: Sequence) -> dict:
    """A batched sequence's record: its error, or its result (saving its state where it asks)."""
    if seq.error is not None:
        return error_record(seq.request, seq.error)
    try:
        return record(loaded, seq)
    except Exception as err:  # saving its state failed
        return error_record(seq.request, failure(err))


def record(loaded, seq: Sequence) -> dict:
    """The result record of a finished sequence (saving its state first when its request asks)."""
    req, session = seq.request, dict(seq.info)
    if req.save_state is not None:
        session["saved_to"] = req.save_state
        session["saved_bytes"] = save(loaded, Path(req.save_state), seq.held())
    result = {"id": req.id, "text": seq.text, "tokens": list(seq.output), "prompt_tokens": len(seq.prompt_ids),
              "engine": seq.spec.describe(), "finish_reason": seq.finish_reason or "length",
              "device": str(loaded.device), "dtype": str(loaded.model.dtype).replace("torch.", ""),
              "weights": loaded.weights, "kv_dtype": loaded.kv_dtype,
              "stats": seq.metrics().as_dict() if seq.output else {"prompt_tokens": len(seq.prompt_ids)}, "error": None}
    if req.tools is not None:
        reply = read_reply(seq.text, req.tools)
        result["content"], result["tool_calls"] = reply.content, list(reply.calls)
        result["finish_reason"] = "tool_calls" if reply.calls else result["finish_reason"]
    if seq.gen.logprobs is not None:
        result["logprobs"] = [described(loaded.tokenizer, t, lp) for t, lp in zip(seq.output, seq.logprobs)]
    if seq.notes:
        result["notes"] = seq.notes
    result.update(seq.report())
    if session:
        result["session"] = session
    return result


def error_record(req: Request | str | None, message: str) -> dict:
    rid = req.id if isinstance(req, Request) else None
    return {"id": rid, "text": None, "tokens": None, "stats": None, "error": message}
