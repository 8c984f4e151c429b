"""One request's generation, whoever drives it: its history and attention state, the forward it
needs next (the cached state's next rows, or under no-cache the whole history on a fresh state),
sampling, stop ids and timing; what it lets out is its `Output`'s (the detokenizer, stop strings,
log-probabilities), and speculation its `Verifier`'s. `stream.generate_step` runs one alone; the
scheduler runs many in one forward pass per step. Neither knows which engine it runs.

A sequence asks for the rows to run next (`block`), takes the logits they produced (`feed`), and
lets out tokens; `held()` is the state it leaves, with the tokens that state stands for.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any, Callable

import torch

from larqlpy.config import GenerationConfig
from larqlpy.decode.constraint import Constraint, Vocabulary, compile_grammar
from larqlpy.decode.forcing import ThinkingBudget
from larqlpy.decode.logits import Logprob, Shaper, logprob
from larqlpy.decode.output import Metrics, Output, Token
from larqlpy.decode.sampling import refuse_non_finite, sample, verify
from larqlpy.decode.speculate import Proposer, Verifier
from larqlpy.decode.stops import Piece
from larqlpy.engines import EngineSpec, build_provider
from larqlpy.engines.stores.state import EngineState
from larqlpy.errors import LarqlError, failure
from larqlpy.kernels import compiles
from larqlpy.state.sources import Held, Reuse, StateSource
from larqlpy.text.reasoning import Reasoning


class Sequence:
    def __init__(self, model, prompt_ids: list[int], spec: EngineSpec = EngineSpec(),
                 gen: GenerationConfig = GenerationConfig(), *, stop_ids=(), tokenizer=None,
                 source: StateSource | None = None, key: Any = None, request: Any = None, notes=(),
                 proposer: Proposer | None = None, before_start: Callable[[], str | None] | None = None,
                 reasoning: Reasoning | None = None):
        """`before_start`: what the model must do before this sequence's first state (its engine's
        key calibration), run by `start` -- on the thread that runs the model -- with its note kept.
        `reasoning`: the reasoning block its model writes, held to `gen.thinking_budget` tokens."""
        if not prompt_ids:
            raise LarqlError("empty prompt: nothing to condition on")
        if (gen.stop or gen.grammar is not None) and tokenizer is None:
            raise LarqlError("`stop` strings and grammars need the model's tokenizer to read the text")
        self.model, self.spec, self.gen, self.source = model, spec, gen, source
        self.provider = build_provider(spec)  # its engine, built once: peak accounting and fresh states
        self.key, self.request, self.notes = key, request, list(notes)
        self.before_start = before_start
        self.prompt_ids, self.history = list(prompt_ids), list(prompt_ids)
        self.stop_ids = frozenset(stop_ids) if gen.stop_at_eos else frozenset()
        self.tokenizer = tokenizer
        self.out = Output(tokenizer, gen.stop)
        budget = ThinkingBudget(tokenizer, reasoning, gen.thinking_budget) \
            if reasoning is not None and gen.thinking_budget is not None and tokenizer is not None else None
        vocab = model.cfg.vocab_size if gen.shapes_logits or budget is not None else 0
        constraint = Constraint(Vocabulary.of(tokenizer, vocab), compile_grammar(gen.grammar)) \
            if gen.grammar is not None else None
        self.shaper = Shaper(gen, vocab, constraint, budget)
        seed = gen.sampling.seed
        self.rng = torch.Generator().manual_seed(seed) if seed is not None else None
        self.state: EngineState | None = None
        self.logits: torch.Tensor | None = None  # the model's output at the state's newest position
        self.ready = False  # a token is to be sampled from `logits`
        self.generated: list[int] = []  # every id sampled
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.info: dict = {}  # what the source said of the state it gave
        self.t0 = self.t_decode = self.t_end = None  # started, first token, finished
        self.c0 = self.c_decode = self.c_end = 0.0  # compiles.seconds() at those moments
        self.prefill_seconds = self.prefill_compile = 0.0
        # no-cache keeps no state to roll back
        self.verifier = Verifier(proposer, not gen.draft_fixed) if proposer is not None and not spec.replay else None

    # -- what it let out (its Output's) -----------------------------------------------------------
    @property
    def output(self) -> list[int]:
        return self.out.ids

    @property
    def text(self) -> str:
        return self.out.text

    @property
    def logprobs(self) -> list[Logprob | None]:
        return self.out.logprobs

    # -- what a driver asks --------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def pending(self) -> int:
        """History tokens the state does not hold yet."""
        return len(self.history) - self.state.position

    @property
    def decoding(self) -> bool:
        """Its next block is one decode row (after its first token)."""
        return bool(self.generated) and not self.finished and not self.ready and self.pending == 1

    def rows(self) -> int:
        """Rows its next block runs: a prefill chunk (alone and batched the same, for exact numbers)
        or the one new token; 0 while it waits to sample or has finished."""
        if self.finished or self.ready:
            return 0
        if self.verifier is not None and self.decoding:
            return 1 + self.verifier.tokens  # at most: the proposals are made with the block
        c = self.gen.prefill_chunk
        return min(c, self.state.max_chunk or c, self.pending)

    @property
    def peak_positions(self) -> int:
        return len(self.prompt_ids) + self.gen.max_tokens

    @property
    def rollback(self) -> int:
        """Positions a verification may take past its history and trim back (0: no proposer)."""
        return self.verifier.tokens if self.verifier is not None else 0

    @cached_property
    def peak_bytes(self) -> int:
        """The KV it may grow to: its engine's accounting at prompt + max_tokens positions, with the
        rows a verification may take past them and a draft model's state."""
        own = self.provider.state_bytes(self.model.geometries(), self.peak_positions, self.rollback)
        return own + (self.verifier.state_bytes(self.peak_positions) if self.verifier is not None else 0)

    def start(self) -> None:
        """Its first state: from its source (a prefix it already holds), or a fresh one."""
        if self.state is not None:
            return
        note = self.before_start() if self.before_start is not None else None
        if note:
            self.notes.append(note)
        compiles.watch()  # kernels compiled inside a phase are not its time
        self.t0, self.c0 = time.perf_counter(), compiles.seconds()  # a measurement before it is not its prefill
        reuse = self.source.take(self.prompt_ids, self.spec) if self.source is not None else Reuse()
        held, self.info = reuse.held, dict(reuse.info)
        self.state = held.state if held is not None else self._fresh()
        # prompt tokens a state already held (a branch's prompt was prefilled for it: state/branches.py)
        self.held_from = 0 if "branch" in self.info else self.state.position
        if self.rollback:
            self.state.keep_rollback(self.rollback)
        if self.pending == 0:
            if held.logits is None:
                raise LarqlError("the state already holds the whole prompt and no logits came with it")
            self.logits, self.ready = held.logits, True

    def reserve(self) -> None:
        """Allocate now what its state will hold at its last position (a batch reserves on admission)."""
        if self.spec.replay:  # a replayed state is thrown away every step
            return
        self.state.reserve(self.peak_positions + self.rollback)
        if self.verifier is not None:
            self.verifier.reserve(self.peak_positions)

    def block(self) -> tuple[torch.Tensor, EngineState, str]:
        """Its next rows for the model: (ids, state, which logits to return). A decode step with a
        proposer: its newest id and the proposals after it, every row's logits, attended as steps."""
        if self.verifier is not None and self.decoding:
            return self.verifier.block(self)
        n, lo = self.rows(), self.state.position
        self.logits = None  # the state moves past its newest position
        return torch.tensor(self.history[lo:lo + n], dtype=torch.long), self.state, \
            "last" if n == self.pending else "none"

    def feed(self, logits: torch.Tensor | None) -> list[Token]:
        """What its block produced (None: a prefill chunk before the last); the tokens let out."""
        if logits is None:
            return []
        if self.verifier is not None and self.verifier.verifying:
            return self.verifier.verify(self, logits)
        self.logits, self.ready = logits[-1], True
        return self.sample()

    def sample(self, guess: tuple[int, Any] | None = None) -> list[Token]:
        """The next id from the waiting logits, into the history; the tokens let out. `guess`: a
        speculative proposal (id, its draft distribution or None) this choice verifies."""
        logits, self.ready = self.logits, False
        if self.t_decode is None:
            if self.verifier is not None and self.gen.max_tokens > 1:
                self.verifier.prime(self.history)  # the prompt is prefill's work, the draft's too
            self.t_decode, self.c_decode = time.perf_counter(), compiles.seconds()
            self.prefill_compile = self.c_decode - self.c0
            self.prefill_seconds = self.t_decode - self.t0 - self.prefill_compile
        if len(self.generated) >= self.gen.max_tokens:  # max_tokens 0: the prompt only
            return self._release([], "length")
        tok, lp = self._choose(logits, guess)
        self.generated.append(tok)
        self.history.append(tok)
        done = self.shaper.done or len(self.generated) == self.gen.max_tokens
        pieces, finish = self.out.take(tok, logits, lp, tok in self.stop_ids,
                                       ("stop" if self.shaper.done else "length") if done else None)
        tokens = self._release(pieces, finish)
        if self.out.cut:  # a stop string: the text ends before it, and the state where the text ends
            self._end_at_text(self.out.cut_logits(pieces))
        if self.spec.replay and not self.finished:  # no-cache: the whole history again, on a fresh state
            self.state = self._fresh()
        return tokens

    def _choose(self, logits: torch.Tensor, guess: tuple[int, Any] | None = None) -> tuple[int, Logprob | None]:
        """The next id from the model's logits, shaped by the request's settings, and its
        log-probability where asked."""
        shaped = self.shaper.active
        if shaped:
            refuse_non_finite(logits)
            logits = self.shaper(logits, self.history)
        tok = sample(logits, self.gen.sampling, self.rng, shaped) if guess is None else \
            verify(logits, self.gen.sampling, self.rng, guess[0], guess[1], shaped)
        lp = logprob(logits, self.gen.sampling.temperature, tok, self.gen.logprobs) \
            if self.gen.logprobs is not None else None
        self.shaper.accept(tok)
        return tok, lp

    def fail(self, e: Exception) -> None:
        self.error = failure(e)
        self._ended()

    def metrics(self) -> Metrics:
        s = self.state
        by_kind = s.resident_by_kind()  # one pass over the stores: the total is its sum
        decode = compiled = 0.0
        if self.t_decode is not None:
            ended = self.t_end is not None
            compiled = (self.c_end if ended else compiles.seconds()) - self.c_decode
            decode = (self.t_end if ended else time.perf_counter()) - self.t_decode - compiled
        v = self.verifier
        return Metrics(len(self.prompt_ids), len(self.prompt_ids) - self.held_from, self.prefill_seconds,
                       len(self.generated), decode, sum(by_kind.values()), by_kind, s.position,
                       *((v.proposed, v.accepted, v.steps, v.length.why() if v.length else {})
                         if v is not None else ()),
                       compile_seconds=self.prefill_compile + compiled)

    def held(self) -> Held | None:
        """The state it leaves and the tokens that state stands for (None: no-cache keeps no state,
        a branch of `n` choices reads rows that are not its own, and a failed step, or one cut off
        inside the model -- Ctrl-C -- leaves it unknown)."""
        if self.spec.replay or self.error is not None or self.state is None:
            return None
        if any(s.borrows() for s in self.state.layers):  # a branch: part of its rows are its prompt's, shared
            return None
        if len({s.end for s in self.state.layers}) > 1:  # some layers took the block, some did not
            return None
        return Held(self.history, self.state, self.logits)

    def report(self) -> dict:
        """Its engine's own figures (cells/v1: cell states and transitions)."""
        return {} if self.spec.replay or self.state is None else self.state.report()

    # -- inside ----------------------------------------------------------------------------------
    def _fresh(self) -> EngineState:
        return self.provider.new_state(self.model.geometries(), self.model.device)

    def _ended(self) -> None:
        self.t_end, self.c_end = time.perf_counter(), compiles.seconds()

    def _release(self, pieces: list[Piece], finish: str | None) -> list[Token]:
        if finish is not None:
            self.finish_reason = finish
            self._ended()
        return self.out.release(pieces, finish, self.metrics()) if pieces else []

    def _end_at_text(self, logits: torch.Tensor) -> None:
        """After a stop string: the history and the state end where the text ends (the token the
        cut falls in kept), where the engine can go back there; else they keep the stop string's
        tokens too (a ring that has wrapped past them)."""
        n = len(self.output)
        if n == len(self.generated) or self.spec.replay:
            return
        keep = len(self.prompt_ids) + n
        target = len(self.prompt_ids) + max(n - 1, 0)  # all but the newest kept id, as after any token
        if not self.state.can_trim(target):
            return
        self.state.trim(target)
        self.history = self.history[:keep]
        self.logits = logits
