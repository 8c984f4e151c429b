"""Run requests (pipeline/request.py) on a loaded model, one alone or many batched: the record a run and each
batch line print. Both go through `prepare` and the one decode loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from larqlpy.budget import KVBudget
from larqlpy.config import BatchConfig
from larqlpy.decode.logits import described
from larqlpy.decode.output import Token
from larqlpy.decode.scheduler import Scheduler
from larqlpy.decode.sequence import Sequence
from larqlpy.decode.stream import generate_step
from larqlpy.errors import LarqlError, failure
from larqlpy.pipeline.prepare import prepare_all
from larqlpy.pipeline.request import Request
from larqlpy.state.saved import save
from larqlpy.text.reasoning import split
from larqlpy.text.tools import read_reply
from larqlpy.weights.loader import LoadedModel


def execute(loaded: LoadedModel, req: Request, on_token: Callable[[Token], None] | None = None) -> dict:
    """Run `req` alone and return its result record (text, token ids, engine, stats, session); its
    `n` choices, when it asks for several, batched together (`on_token` sees the first's tokens)."""
    seqs = prepare_all(loaded, req)
    if len(seqs) == 1:
        for tok in generate_step(loaded.model, seqs[0]):
            if on_token is not None:
                on_token(tok)
        return record(loaded, seqs[0])
    for event in Scheduler(loaded.model, len(seqs)).run(seqs):
        if on_token is not None and event.token is not None and event.seq is seqs[0]:
            on_token(event.token)
    return finished_record(loaded, seqs)


def execute_many(loaded: LoadedModel, requests: Iterable[tuple[Any, Request | str]], parallel: int | None = None,
                 kv_budget: int | None = None, step_tokens: int = BatchConfig.step_tokens,
                 on_step: Callable[[Scheduler], None] | None = None) -> Iterator[tuple[Any, dict]]:
    """Run requests together, continuously batched: (key, result record) as each finishes. A request
    given as a string is a refusal already made (its error record passes through); one refused
    while it is prepared or run becomes an error record; the others go on. `on_step` sees the
    scheduler after every step (progress)."""
    sched = Scheduler(loaded.model, parallel, KVBudget(kv_budget), step_tokens)
    refused: list[tuple[Any, dict]] = []

    groups: dict[int, list[Sequence]] = {}  # a request's choices, until every one has finished

    def sequences() -> Iterator[Sequence]:
        for key, req in requests:
            try:
                if isinstance(req, str):
                    raise LarqlError(req)
                seqs = prepare_all(loaded, req, key=key)
            except Exception as e:  # one bad request must not take the others down
                refused.append((key, error_record(req, failure(e))))
                continue
            groups[id(seqs[0].request)] = seqs
            yield from seqs

    for event in sched.run(sequences(), on_step):
        yield from _drain(refused)
        seqs = groups.get(id(event.seq.request))  # None: its request's record went out at this step
        if event.token is None and seqs is not None and all(s.finished for s in seqs):
            del groups[id(event.seq.request)]
            yield event.seq.key, finished_record(loaded, seqs)
    yield from _drain(refused)


def _drain(items: list) -> Iterator:
    while items:
        yield items.pop(0)


def finished_record(loaded: LoadedModel, seqs: list[Sequence]) -> dict:
    """A request's record once its sequences have finished: an error, or its result (saving its
    state where it asks); with several choices, the first's record with every one's in `choices`."""
    failed = next((s for s in seqs if s.error is not None), None)
    if failed is not None:
        return error_record(failed.request, failed.error)
    try:
        result = record(loaded, seqs[0])
    except Exception as err:  # saving its state failed
        return error_record(seqs[0].request, failure(err))
    if len(seqs) > 1:
        own = ("text", "tokens", "finish_reason", "content", "tool_calls", "reasoning", "logprobs")
        result["choices"] = [{"index": i, **{k: v for k, v in record(loaded, s).items() if k in own}}
                             for i, s in enumerate(seqs)]
        result["stats"]["completion_tokens"] = sum(len(s.output) for s in seqs)
    return result


def record(loaded: LoadedModel, seq: Sequence) -> dict:
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
    if req.tools is not None or req.reasoning is not None:  # a thinking model's reasoning apart, then the calls
        thought, content = split(seq.text, req.reasoning)
        reply = read_reply(content, req.tools)
        result["content"], result["tool_calls"] = reply.content, list(reply.calls)
        result["finish_reason"] = "tool_calls" if reply.calls else result["finish_reason"]
        result.update({"reasoning": thought} if req.reasoning is not None else {})
    if seq.gen.logprobs is not None:
        result["logprobs"] = [described(loaded.tokenizer, t, lp) for t, lp in zip(seq.output, seq.logprobs)]
    if seq.notes:
        result["notes"] = seq.notes
    if loaded.float_fallback:
        result["float_fallback"] = loaded.float_fallback
    result.update(seq.report())
    if session:
        result["session"] = session
    return result


def error_record(req: Request | str | None, message: str) -> dict:
    rid = req.id if isinstance(req, Request) else None
    return {"id": rid, "text": None, "tokens": None, "stats": None, "error": message}
