"""Continuous batching: many sequences, one forward pass per step (`batch --parallel`, the server).

A step is one block of rows: one row per decoding sequence, then prefill chunks of sequences still
reading their prompts (chunked prefill beside decode), up to `step_tokens` rows (always at least one
chunk). The model multiplies every matrix once for the whole block; each sequence's rows attend over
its own engine state (`Decoder.forward_many`). Between steps finished sequences leave and waiting
ones join at once.

Exactness: a sequence's prompt is cut into the same chunks as alone (`prefill_chunk`, the state's
`max_chunk`), its rows attend exactly as alone, and the packed integer kernels give every row the
same numbers whatever the block; so with those weights a sequence's logits in a batch are its logits
alone, bit for bit. Float weights multiply a block with a GEMM, one row with a GEMV: rounding apart.

Budget: with `kv_budget`, a sequence joins only when the KV it may grow to (its engine's accounting
at prompt + max_tokens positions) fits beside what the live ones reserved; its state preallocates
that much at once (`EngineState.reserve`), so resident KV never runs past what was reserved.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from larqlpy.config import BatchConfig, GenerationConfig, default_parallel
from larqlpy.engines import EngineSpec, build_provider
from larqlpy.engines.stores.base import EngineState
from larqlpy.errors import LarqlError
from larqlpy.generate import Metrics, Token, finish_reason, sample


@dataclass
class Job:
    """One sequence to generate: its prompt ids, engine and settings; `state` may arrive holding a
    prefix of the prompt (a resumed session), with `logits` when it holds all of it."""

    prompt_ids: list[int]
    spec: EngineSpec = field(default_factory=EngineSpec)
    gen: GenerationConfig = field(default_factory=GenerationConfig)
    stop_ids: frozenset[int] = frozenset()
    state: EngineState | None = None
    logits: torch.Tensor | None = None
    key: Any = None


@dataclass(frozen=True)
class Event:
    """What a step produced for one job: a token, or its end (`done`, with the final state), or its
    refusal (`error`: it can never fit the budget)."""

    key: Any
    token: Token | None = None
    done: bool = False
    state: EngineState | None = None
    error: str | None = None


class _Live:
    """A sequence in the batch: its state and where it stands."""

    def __init__(self, job: Job, state: EngineState, reserved: int, new_state, detokenizer):
        self.job, self.state, self.reserved, self.new_state = job, state, reserved, new_state
        self.history = list(job.prompt_ids)
        self.start = state.position  # prompt tokens the state held on arrival
        self.logits = job.logits if self.start >= len(self.history) else None
        if self.start >= len(self.history) and self.logits is None:
            raise LarqlError("the state already holds the whole prompt and no logits came with it")
        self.index = 0  # tokens generated
        s = job.gen.sampling
        self.gen = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
        self.stops = set(job.stop_ids) if job.gen.stop_at_eos else set()
        self.detokenizer = detokenizer
        self.t0, self.prefill_seconds, self.t_decode = time.perf_counter(), 0.0, None

    @property
    def pending(self) -> int:
        """History tokens the state does not hold yet."""
        return len(self.history) - self.state.position

    def chunk(self) -> int:
        c = self.job.gen.prefill_chunk
        return min(c, self.state.max_chunk or c, self.pending)

    def metrics(self) -> Metrics:
        s = self.state
        decode = time.perf_counter() - self.t_decode if self.t_decode is not None else 0.0
        by_kind = s.resident_by_kind()  # one pass over the stores: the total is its sum
        return Metrics(len(self.job.prompt_ids), len(self.job.prompt_ids) - self.start, self.prefill_seconds,
                       self.index, decode, sum(by_kind.values()), by_kind, s.position)


class Scheduler:
    """Admits jobs up to `parallel` live sequences (and the KV budget) and steps them together."""

    def __init__(self, model, parallel: int | None = None, kv_budget: int | None = None,
                 step_tokens: int = BatchConfig.step_tokens, tokenizer=None):
        cfg = BatchConfig(parallel, kv_budget, step_tokens)  # the same checks as every interface
        self.model, self.kv_budget, self.step_tokens = model, cfg.kv_budget, cfg.step_tokens
        self.parallel = cfg.parallel or default_parallel(torch.get_num_threads(), 1, model.device.type)
        self.tokenizer = tokenizer
        self.queue: deque[Job] = deque()
        self.live: list[_Live] = []
        self.steps = 0
        self.rows = 0  # rows run through the model so far
        self.generated = 0  # tokens sampled so far

    # -- admission ------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        if not job.prompt_ids:
            raise LarqlError("empty prompt: nothing to condition on")
        self.queue.append(job)

    def idle(self) -> bool:
        return not self.queue and not self.live

    def has_room(self) -> bool:
        """Whether a job submitted now could join at the next step (count only; the budget may still hold it)."""
        return len(self.live) + len(self.queue) < self.parallel

    def peak_bytes(self, job: Job, provider=None) -> int:
        """The KV `job` may grow to: its engine's accounting at prompt + max_tokens positions."""
        positions = len(job.prompt_ids) + job.gen.max_tokens
        provider = provider or build_provider(job.spec)
        return sum(provider.layer_bytes(g, positions) for g in self.model.geometries())

    def reserved(self) -> int:
        return sum(s.reserved for s in self.live)

    def resident_bytes(self) -> int:
        return sum(s.state.resident_bytes() for s in self.live)

    def _admit(self) -> list[Event]:
        refused = []
        while self.queue and len(self.live) < self.parallel:
            job = self.queue[0]
            provider = build_provider(job.spec)
            peak = self.peak_bytes(job, provider)
            if self.kv_budget is not None and peak > self.kv_budget:
                self.queue.popleft()
                refused.append(Event(job.key, done=True, error=(
                    f"needs {peak:,} bytes of KV at {len(job.prompt_ids) + job.gen.max_tokens:,} positions, "
                    f"more than the whole budget of {self.kv_budget:,} bytes")))
                continue
            if self.kv_budget is not None and self.reserved() + peak > self.kv_budget:
                break  # waits for live sequences to finish; order is kept
            self.queue.popleft()
            geoms = self.model.geometries()

            def fresh(provider=provider, geoms=geoms) -> EngineState:
                return provider.new_state(geoms, self.model.device)

            state = job.state if job.state is not None else fresh()
            positions = len(job.prompt_ids) + job.gen.max_tokens
            if not job.spec.replay:
                state.reserve(positions)
            detok = self.tokenizer.stream() if self.tokenizer is not None else None
            self.live.append(_Live(job, state, max(peak, state.resident_bytes()), fresh, detok))
        return refused

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit what fits, run one block, sample where a sequence has logits; the events."""
        events = self._admit()
        events += self._sample_ready()  # resumed states that already hold their whole prompt
        blocks, owners = self._block()
        if blocks:
            outs = self.model.forward_many(blocks)
            self.steps += 1
            self.rows += sum(b[0].shape[0] for b in blocks)
            for seq, logits in zip(owners, outs):
                if logits is not None:
                    seq.logits = logits[-1]
                    seq.state.last_logits = seq.logits
            events += self._sample_ready()
        return events

    def _block(self) -> tuple[list, list[_Live]]:
        decode = [s for s in self.live if s.logits is None and s.pending == 1 and s.index > 0 and not s.job.spec.replay]
        prefill = [s for s in self.live if s.logits is None and s not in decode]
        blocks, owners, rows = [], [], 0
        for s in decode:
            blocks.append((torch.tensor(s.history[-1:], dtype=torch.long), s.state, "last"))
            owners.append(s)
            rows += 1
        budget, took = self.step_tokens, False
        for s in prefill:
            n = s.chunk()
            if took and rows + n > budget:
                continue  # a later, shorter chunk may still fit this step
            took = True  # one chunk always runs, or prefill could starve behind many decode rows
            lo = s.state.position
            blocks.append((torch.tensor(s.history[lo:lo + n], dtype=torch.long), s.state,
                           "last" if n == s.pending else "none"))
            owners.append(s)
            rows += n
        return blocks, owners

    def _sample_ready(self) -> list[Event]:
        events = []
        for seq in [s for s in self.live if s.logits is not None]:
            events += self._advance(seq)
        return events

    def _advance(self, seq: _Live) -> list[Event]:
        """Sample the next id from `seq.logits` and feed it (or finish)."""
        logits, seq.logits = seq.logits, None
        if seq.t_decode is None:
            seq.prefill_seconds = time.perf_counter() - seq.t0
            seq.t_decode = time.perf_counter()
        gen = seq.job.gen
        if gen.max_tokens == 0:
            return [self._finish(seq)]
        tok = sample(logits, gen.sampling, seq.gen)
        finish = finish_reason(tok, seq.index, gen.max_tokens, seq.stops)
        text = "" if tok in seq.stops or seq.detokenizer is None else seq.detokenizer.step(tok)
        seq.index += 1
        self.generated += 1
        token = Token(tok, text, seq.index - 1, logits, seq.metrics(), finish)
        seq.history.append(tok)
        events = [Event(seq.job.key, token)]
        if finish:
            events.append(self._finish(seq))
        elif seq.job.spec.replay:  # no-cache: the whole history again, on a fresh state
            seq.state = seq.new_state()
        return events

    def cancel(self, key: Any) -> EngineState | None:
        """Drop a job, waiting or live (its client went away); returns a live one's state (None if
        it had none yet), which holds the positions it processed."""
        for job in list(self.queue):
            if job.key == key:
                self.queue.remove(job)
                return None
        for seq in self.live:
            if seq.job.key == key:
                self.live.remove(seq)
                return None if seq.job.spec.replay else seq.state
        return None

    def _finish(self, seq: _Live) -> Event:
        self.live.remove(seq)
        return Event(seq.job.key, done=True, state=seq.state)

    # -- driving ----------------------------------------------------------------------------------
    def fill(self, source: Iterator[Job]) -> bool:
        """Submit jobs from `source` while a slot is free; False once `source` is exhausted."""
        while self.has_room():
            job = next(source, None)
            if job is None:
                return False
            self.submit(job)
        return True

    def run(self, jobs=()) -> Iterator[Event]:
        """Submit `jobs` as room frees and step until all are done; events as they happen."""
        source, more = iter(jobs), True
        while True:
            more = more and self.fill(source)
            if self.idle() and not more:
                return
            yield from self.step()
