"""Continuous batching: many sequences, one forward pass per step (`batch --parallel`, the server).

The scheduler plans and never samples (vLLM's split): `admit` picks the waiting sequences that join
now, `plan` the rows each live one runs this step -- one row per decoding sequence, then prefill
chunks of sequences still reading their prompts (chunked prefill beside decode), up to
`step_tokens` rows (always at least one chunk). The model multiplies every matrix once for the whole
block; each sequence's rows attend over its own state (`Decoder.forward_many`); each sequence then
takes its logits (`Sequence.feed`). Between steps finished sequences leave and waiting ones join.

Exactness: a sequence's prompt is cut into the same chunks as alone, its rows attend exactly as
alone, and the packed integer kernels give every row the same numbers whatever the block; so with
those weights a sequence's logits in a batch are its logits alone, bit for bit. Float weights
multiply a block with a GEMM, one row with a GEMV: rounding apart.

A failed step is the failure of the sequences in it: each ends with its error, the others go on.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

from larqlpy.budget import KVBudget
from larqlpy.config import BatchConfig, default_parallel
from larqlpy.decode.output import Token
from larqlpy.decode.sequence import Sequence
from larqlpy.kernels.threads import LoadFollower


class Event(NamedTuple):
    """What a step produced: a token of `seq`, or (token None) its end -- `seq.finish_reason`, or
    `seq.error` when it failed or can never fit the budget."""

    seq: Sequence
    token: Token | None = None


def admit(waiting: Iterable[Sequence], room: int, budget: KVBudget) -> tuple[list[Sequence], list[Sequence]]:
    """The waiting sequences that join now, in order, while slots (`room`) and the budget allow; and
    those that can never fit it. The first that does not fit yet holds the rest back."""
    joined, refused, held = [], [], 0
    for seq in waiting:
        if len(joined) >= room:
            break
        peak = seq.peak_bytes
        if budget.refusal(peak, seq.peak_positions) is not None:
            refused.append(seq)
            continue
        if not budget.fits(held + peak):
            break
        joined.append(seq)
        held += peak
    return joined, refused


def plan(live: Iterable[Sequence], step_tokens: int) -> list[Sequence]:
    """The sequences whose next block runs this step, in block order: every decoding one (one row
    each), then prefill chunks while they fit `step_tokens` rows -- the first always, or prefill
    could starve behind many decode rows; a later, shorter chunk may fit where one did not."""
    live = list(live)
    chosen = [s for s in live if s.decoding]
    rows, took = len(chosen), False
    for s in live:
        n = s.rows()
        if not n or s.decoding or (took and rows + n > step_tokens):
            continue
        chosen.append(s)
        rows, took = rows + n, True
    return chosen


class Scheduler:
    """Admits sequences up to `parallel` live ones (and the budget) and steps them together."""

    def __init__(self, model, parallel: int | None = None, budget: KVBudget | None = None,
                 step_tokens: int = BatchConfig.step_tokens):
        cfg = BatchConfig(parallel, None, step_tokens)  # the same checks as every interface
        self.model, self.step_tokens = model, cfg.step_tokens
        self.parallel = cfg.parallel or default_parallel(torch.get_num_threads(), 1, model.device.type)
        self.budget = budget if budget is not None else KVBudget()
        self.waiting: deque[Sequence] = deque()
        self.live: list[Sequence] = []
        self.generated = 0  # tokens let out so far
        # the kernels' thread count follows the load; called by the thread that steps (numba's count is per thread)
        self.threads = LoadFollower(on=model.device.type == "cpu")

    def submit(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def idle(self) -> bool:
        return not self.waiting and not self.live

    def has_room(self) -> bool:
        """Whether a sequence submitted now could join at the next step (count only; the budget may still hold it)."""
        return len(self.live) + len(self.waiting) < self.parallel

    def reserved(self) -> int:
        return self.budget.reserved()

    def resident_bytes(self) -> int:
        return sum(s.state.resident_bytes() for s in self.live)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit what fits, sample where a sequence has logits, run one block; the events."""
        self.threads()
        events = self._admit()
        for seq in [s for s in self.live if s.ready]:  # resumed states that hold their whole prompt
            events += self._take(seq, seq.sample)
        chosen = plan(self.live, self.step_tokens)
        if not chosen:
            return events
        blocks = [s.block() for s in chosen]
        try:
            outs = self.model.forward_many(blocks)
        except Exception as e:  # every sequence of the step shares the failure; the others go on
            for seq in chosen:
                seq.fail(e)
                events.append(self._end(seq))
            return events
        for seq, logits in zip(chosen, outs):
            events += self._take(seq, lambda: seq.feed(logits))
        return events

    def _admit(self) -> list[Event]:
        joined, refused = admit(self.waiting, self.parallel - len(self.live), self.budget)
        events = []
        for seq in refused:
            self.waiting.remove(seq)
            seq.error = self.budget.refusal(seq.peak_bytes, seq.peak_positions)
            events.append(Event(seq))
        for seq in joined:
            self.waiting.remove(seq)
            self.live.append(seq)
            try:
                seq.start()
                seq.reserve()
            except Exception as e:  # its state could not be had (a state file that does not fit)
                seq.fail(e)
                events.append(self._end(seq))
                continue
            self.budget.reserve(seq, max(seq.peak_bytes, seq.state.resident_bytes()))
        return events

    def _take(self, seq: Sequence, produce: Callable[[], list[Token]]) -> list[Event]:
        try:
            tokens = produce()
        except Exception as e:  # e.g. its logits are not finite
            seq.fail(e)
            tokens = []
        self.generated += len(tokens)
        events = [Event(seq, t) for t in tokens]
        if seq.finished:
            events.append(self._end(seq))
        return events

    def _end(self, seq: Sequence) -> Event:
        self.live.remove(seq)
        self.budget.release(seq)
        return Event(seq)

    def cancel(self, seq: Sequence) -> bool:
        """Drop a sequence, waiting or live (its client went away); whether it was here. Its
        `held()` holds the positions it processed."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return True
        if seq in self.live:
            self.live.remove(seq)
            self.budget.release(seq)
            return True
        return False

    # -- driving ----------------------------------------------------------------------------------
    def fill(self, source: Iterator[Sequence]) -> bool:
        """Submit sequences from `source` while a slot is free; False once `source` is exhausted."""
        while self.has_room():
            seq = next(source, None)
            if seq is None:
                return False
            self.submit(seq)
        return True

    def run(self, sequences: Iterable[Sequence] = (), on_step: Callable[["Scheduler"], None] | None = None
            ) -> Iterator[Event]:
        """Submit `sequences` as room frees and step until all are done; events as they happen
        (`on_step` sees the scheduler after every step: progress)."""
        source, more = iter(sequences), True
        while True:
            more = more and self.fill(source)
            if self.idle() and not more:
                return
            yield from self.step()
            if on_step is not None:
                on_step(self)
