"""One request's generation, whoever drives it: its history and attention state, the forward it
needs next (the cached state's next rows, or under no-cache the whole history on a fresh state),
sampling, stop ids and stop strings, the detokenizer and its timing. `stream.generate_step` runs
one alone; the scheduler runs many in one forward pass per step. Neither knows which engine it runs.

A sequence asks for the rows to run next (`block`), takes the logits they produced (`feed`), and
lets out tokens; `held()` is the state it leaves, with the tokens that state stands for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch

from larqlpy.config import GenerationConfig
from larqlpy.decode.constraint import Constraint, Vocabulary, compile_grammar
from larqlpy.decode.logits import Logprob, Shaper, logprob
from larqlpy.decode.sampling import refuse_non_finite, sample, verify
from larqlpy.decode.stops import Piece, StopStrings
from larqlpy.engines import EngineSpec, build_provider
from larqlpy.engines.stores.base import EngineState
from larqlpy.errors import LarqlError, failure


@dataclass(frozen=True)
class Metrics:
    """A snapshot: every Token carries its own."""

    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # fewer than prompt_tokens when a resumed state already held a prefix
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    resident_kv_bytes: int = 0
    resident_kv_by_kind: dict[str, int] = field(default_factory=dict)
    position: int = 0
    proposed_tokens: int = 0  # speculative decoding: ids proposed, those the target kept, target passes
    accepted_tokens: int = 0
    target_steps: int = 0

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill's logits; decode time covers the rest
        steps = max(self.decode_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance(self) -> float:
        """The share of proposed ids the target kept."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Ids decoded per forward pass of the target (1 without speculation)."""
        return max(self.decode_tokens - 1, 0) / self.target_steps if self.target_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {"prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled_tokens,
               "prefill_seconds": round(self.prefill_seconds, 6), "prefill_tokens_per_s": round(self.prefill_tps, 3),
               "decode_tokens": self.decode_tokens, "decode_seconds": round(self.decode_seconds, 6),
               "decode_tokens_per_s": round(self.decode_tps, 3), "resident_kv_bytes": self.resident_kv_bytes,
               "resident_kv_by_kind": dict(self.resident_kv_by_kind), "position": self.position}
        if self.target_steps:
            out.update(proposed_tokens=self.proposed_tokens, accepted_tokens=self.accepted_tokens,
                       acceptance_rate=round(self.acceptance, 4), target_steps=self.target_steps,
                       tokens_per_target_step=round(self.tokens_per_step, 4))
        return out


@dataclass(frozen=True)
class Token:
    id: int
    text: str  # the new text this token completes (may be "" while a UTF-8 sequence is open)
    index: int  # 0-based among the tokens let out
    logits: torch.Tensor  # (V,) float32 logits this token was chosen from
    metrics: Metrics
    finish_reason: str | None = None  # "stop" (a stop id or string, a complete grammar) or "length", on the last
    logprob: Logprob | None = None  # when the request asks for log-probabilities


@dataclass
class Held:
    """An attention state and the tokens it stands for: it holds tokens[:state.position]. `logits`
    are the model's output at its newest position, when known (a request that continues from
    exactly the held tokens samples from them)."""

    tokens: list[int]
    state: EngineState
    logits: torch.Tensor | None = None

    @property
    def spec(self) -> EngineSpec:
        return EngineSpec(self.state.identity, tuple(sorted(self.state.options.items())))


@dataclass(frozen=True)
class Reuse:
    """What a state source gives a sequence when it starts: a state holding a prefix of its ids
    (None: it starts afresh), and what to report of it (resumed_from, reused_tokens, trimmed_from,
    refused: why a matching state could not serve)."""

    held: Held | None = None
    info: dict = field(default_factory=dict)


class StateSource(Protocol):
    """Where a sequence's first state may come from: a state file, a server's kept states, a chat's
    previous turn. `take` hands over a state that holds a prefix of `ids`, cut back to it where
    needed; the source keeps it no longer."""

    def take(self, ids: list[int], spec: EngineSpec) -> Reuse: ...


class Given:
    """The source of one state a caller already has: it holds a prefix of the prompt (and, when it
    holds all of it, the logits at its newest position)."""

    def __init__(self, held: Held):
        self.held = held

    def take(self, ids: list[int], spec: EngineSpec) -> Reuse:
        held, self.held = self.held, None
        return Reuse(held)


class Proposer(Protocol):
    """Speculative decoding's source of proposals (decode/speculate.py)."""

    tokens: int  # the most ids it proposes at once

    def state_bytes(self, positions: int) -> int: ...

    def reserve(self, positions: int) -> None: ...

    def propose(self, history: list[int], k: int, sampling, constraint) -> tuple[list[int], list | None]: ...

    def settle(self, history: list[int]) -> None: ...

    def prime(self, history: list[int]) -> None: ...


class Sequence:
    def __init__(self, model, prompt_ids: list[int], spec: EngineSpec = EngineSpec(),
                 gen: GenerationConfig = GenerationConfig(), *, stop_ids=(), tokenizer=None,
                 source: StateSource | None = None, key: Any = None, request: Any = None, notes=(),
                 proposer: Proposer | None = None):
        if not prompt_ids:
            raise LarqlError("empty prompt: nothing to condition on")
        if (gen.stop or gen.grammar is not None) and tokenizer is None:
            raise LarqlError("`stop` strings and grammars need the model's tokenizer to read the text")
        self.model, self.spec, self.gen, self.source = model, spec, gen, source
        self.provider = build_provider(spec)  # its engine, built once: peak accounting and fresh states
        self.key, self.request, self.notes = key, request, list(notes)
        self.prompt_ids, self.history = list(prompt_ids), list(prompt_ids)
        self.stop_ids = frozenset(stop_ids) if gen.stop_at_eos else frozenset()
        self.tokenizer = tokenizer
        self.detokenizer = tokenizer.stream() if tokenizer is not None else None
        self.stops = StopStrings(gen.stop)
        vocab = model.cfg.vocab_size if gen.shapes_logits else 0
        constraint = Constraint(Vocabulary.of(tokenizer, vocab), compile_grammar(gen.grammar)) \
            if gen.grammar is not None else None
        self.shaper = Shaper(gen, vocab, constraint)
        self.logprobs: list[Logprob | None] = []  # of the ids let out
        seed = gen.sampling.seed
        self.rng = torch.Generator().manual_seed(seed) if seed is not None else None
        self.state: EngineState | None = None
        self.logits: torch.Tensor | None = None  # the model's output at the state's newest position
        self.ready = False  # a token is to be sampled from `logits`
        self.generated: list[int] = []  # every id sampled
        self.output: list[int] = []  # the ids let out (a stop string drops what follows its cut)
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.info: dict = {}  # what the source said of the state it gave
        self.t0 = self.t_decode = self.t_end = None  # started, first token, finished
        self.prefill_seconds = 0.0
        self.proposer = proposer if not spec.replay else None  # no-cache keeps no state to roll back
        self.proposal: tuple[list[int], list | None] | None = None  # what the running block verifies
        self.proposed = self.accepted = self.target_steps = 0

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
        if self.proposer is not None and self.decoding:
            return 1 + self.proposer.tokens  # at most: the proposals are made with the block
        c = self.gen.prefill_chunk
        return min(c, self.state.max_chunk or c, self.pending)

    @property
    def peak_positions(self) -> int:
        return len(self.prompt_ids) + self.gen.max_tokens

    @property
    def rollback(self) -> int:
        """Positions a verification may take past its history and trim back (0: no proposer)."""
        return self.proposer.tokens if self.proposer is not None else 0

    @cached_property
    def peak_bytes(self) -> int:
        """The KV it may grow to: its engine's accounting at prompt + max_tokens positions, with the
        rows a verification may take past them and a draft model's state."""
        own = self.provider.state_bytes(self.model.geometries(), self.peak_positions, self.rollback)
        return own + (self.proposer.state_bytes(self.peak_positions) if self.proposer is not None else 0)

    def start(self) -> None:
        """Its first state: from its source (a prefix it already holds), or a fresh one."""
        if self.state is not None:
            return
        self.t0 = time.perf_counter()
        reuse = self.source.take(self.prompt_ids, self.spec) if self.source is not None else Reuse()
        held, self.info = reuse.held, dict(reuse.info)
        self.state = held.state if held is not None else self._fresh()
        # prompt tokens a state already held (a branch's prompt was prefilled for it: decode/fork.py)
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
        if self.proposer is not None:
            self.proposer.reserve(self.peak_positions)

    def block(self) -> tuple[torch.Tensor, EngineState, str]:
        """Its next rows for the model: (ids, state, which logits to return). A decode step with a
        proposer: its newest id and the proposals after it, every row's logits, attended as steps."""
        if self.proposer is not None and self.decoding:
            return self._speculate()
        n, lo = self.rows(), self.state.position
        self.logits = None  # the state moves past its newest position
        return torch.tensor(self.history[lo:lo + n], dtype=torch.long), self.state, \
            "last" if n == self.pending else "none"

    def feed(self, logits: torch.Tensor | None) -> list[Token]:
        """What its block produced (None: a prefill chunk before the last); the tokens let out."""
        if logits is None:
            return []
        if self.proposal is not None:
            return self._verify(logits)
        self.logits, self.ready = logits[-1], True
        return self.sample()

    def _speculate(self) -> tuple[torch.Tensor, EngineState, str]:
        # proposals never run past max_tokens: the last one's logits give the token after it
        room = self.gen.max_tokens - len(self.generated) - 1
        ids, qs = self.proposer.propose(self.history, min(self.proposer.tokens, max(room, 0)),
                                        self.gen.sampling, self.shaper.constraint) if room > 0 else ([], None)
        self.proposal = (ids, qs)
        self.logits = None
        return torch.tensor(self.history[-1:] + ids, dtype=torch.long), self.state, "steps" if ids else "last"

    def _verify(self, logits: torch.Tensor) -> list[Token]:
        """Each row's logits in turn, as plain decode would take them, while the target's choice is
        the proposal; then every state is cut back to the history kept."""
        (ids, qs), self.proposal = self.proposal, None
        self.target_steps += 1
        self.proposed += len(ids)
        out: list[Token] = []
        for j in range(len(ids) + 1):
            self.logits, self.ready = logits[j], True
            guess = (ids[j], qs[j] if qs is not None else None) if j < len(ids) else None
            out += self.sample(guess)
            if self.finished or guess is None or self.generated[-1] != guess[0]:
                break
            self.accepted += 1
        keep = len(self.history) - 1  # the state holds all but the newest id, as after any step
        if self.state.position > keep:
            self.state.trim(keep)
        self.proposer.settle(self.history)
        return out

    def sample(self, guess: tuple[int, Any] | None = None) -> list[Token]:
        """The next id from the waiting logits, into the history; the tokens let out. `guess`: a
        speculative proposal (id, its draft distribution or None) this choice verifies."""
        logits, self.ready = self.logits, False
        if self.t_decode is None:
            if self.proposer is not None and self.gen.max_tokens > 1:
                self.proposer.prime(self.history)  # the prompt is prefill's work, the draft's too
            self.t_decode = time.perf_counter()
            self.prefill_seconds = self.t_decode - self.t0
        if len(self.generated) >= self.gen.max_tokens:  # max_tokens 0: the prompt only
            return self._release([], "length")
        tok, lp = self._choose(logits, guess)
        self.generated.append(tok)
        self.history.append(tok)
        if tok in self.stop_ids:  # its text is none, and what waited goes out before it
            out, reason = self.stops.flush(), "stop"
            if not self.stops.cut:
                out.append(Piece(tok, "", (logits, lp)))
        else:
            text = self.detokenizer.step(tok) if self.detokenizer is not None else ""
            out, reason = self.stops.push(Piece(tok, text, (logits, lp))), None
            if not self.stops.cut and (self.shaper.done or len(self.generated) == self.gen.max_tokens):
                out, reason = out + self.stops.flush(), "stop" if self.shaper.done else "length"
        if self.stops.cut:  # a stop string: the text ends before it, and the state where the text ends
            tokens = self._release(out, "stop")
            self._end_at_text((out[-1] if out else self.stops.dropped[0]).extra[0])
        else:
            tokens = self._release(out, reason)
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
        self.t_end = time.perf_counter()

    def metrics(self) -> Metrics:
        s = self.state
        by_kind = s.resident_by_kind()  # one pass over the stores: the total is its sum
        decode = (self.t_end or time.perf_counter()) - self.t_decode if self.t_decode is not None else 0.0
        return Metrics(len(self.prompt_ids), len(self.prompt_ids) - self.held_from, self.prefill_seconds,
                       len(self.generated), decode, sum(by_kind.values()), by_kind, s.position,
                       self.proposed, self.accepted, self.target_steps)

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

    def _release(self, pieces: list[Piece], finish: str | None) -> list[Token]:
        if finish is not None:
            self.finish_reason, self.t_end = finish, time.perf_counter()
        if not pieces:
            return []
        m = self.metrics()
        out = []
        for i, p in enumerate(pieces):
            logits, lp = p.extra
            out.append(Token(p.id, p.text, len(self.output), logits, m, finish if i == len(pieces) - 1 else None, lp))
            self.output.append(p.id)
            self.logprobs.append(lp)
            self.text += p.text
        return out

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
