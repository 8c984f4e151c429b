"""Speculative decoding: proposals of the next few ids, which the sequence verifies in one forward
pass of the target over them (`Verifier`), keeping the longest run the
target agrees with and rolling every state back past the rest.

Two proposers, one protocol (`propose(history, k, sampling, constraint)` -> (ids, q), `settle(history)`):
- `Lookup`: the continuation of the longest recent n-gram of the history seen earlier in it
  (prompt lookup decoding); certain proposals (q None);
- `Draft`: a smaller model of the same vocabulary, decoding k ids ahead on its own state, which is
  trimmed back to what the target kept. Sampled proposals carry the draft's distribution q, so that
  the target's rejection step keeps the output distributed as the target's alone.

A grammar's mask applies to the proposals (ids it would refuse are never proposed) and again to the
verification: the constraint steps through the proposals and is rolled back after.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from larqlpy.config import SamplingConfig
from larqlpy.decode.draft_length import DraftLength
from larqlpy.decode.sampling import draw, probabilities
from larqlpy.engines import EngineSpec, build_provider
from larqlpy.errors import LarqlError
from larqlpy.kernels import compiles
from larqlpy.model.decoder import prefill
from larqlpy.state.format import common_prefix

MAX_NGRAM = 4  # the longest suffix prompt lookup tries to find again


class Proposer(Protocol):
    """A source of proposals: `Lookup`, `Draft`."""

    tokens: int  # the most ids it proposes at once

    def state_bytes(self, positions: int) -> int: ...

    def reserve(self, positions: int) -> None: ...

    def propose(self, history: list[int], k: int, sampling, constraint) -> tuple[list[int], list | None]: ...

    def settle(self, history: list[int]) -> None: ...

    def prime(self, history: list[int]) -> None: ...


class Lookup:
    """Prompt lookup: the ids that followed the most recent earlier occurrence of the history's
    longest suffix of up to MAX_NGRAM ids (none when even its last id never occurred before)."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def propose(self, history: list[int], k: int, sampling: SamplingConfig, constraint=None
                ) -> tuple[list[int], list | None]:
        k = min(k, self.tokens)
        n_hist = len(history)
        for n in range(min(MAX_NGRAM, n_hist - 1), 0, -1):
            tail = history[n_hist - n:]
            for start in range(n_hist - n - 1, -1, -1):  # the most recent earlier occurrence
                if history[start:start + n] == tail:
                    found = history[start + n:start + n + k]
                    return allowed_prefix(found, constraint), None
        return [], None

    def settle(self, history: list[int]) -> None:
        pass

    def prime(self, history: list[int]) -> None:
        pass

    def state_bytes(self, positions: int) -> int:
        return 0  # it reads the history

    def reserve(self, positions: int) -> None:
        pass


def allowed_prefix(ids: list[int], constraint) -> list[int]:
    """The longest prefix of `ids` a grammar allows (all of them when there is none)."""
    if constraint is None:
        return ids
    took = 0
    for tok in ids:
        if constraint.done or not constraint.allowed()[tok]:
            break
        constraint.accept(tok)
        took += 1
    constraint.rollback(took)
    return ids[:took]


class Draft:
    """A draft model's proposals for one sequence, on its own engine state (the target's engine),
    kept in step with the target's history: it holds a prefix of it and is trimmed back to the
    prefix they share after each verification."""

    def __init__(self, model, spec: EngineSpec, tokens: int, chunk: int, seed: int | None, vocab: int,
                 p_min: float = 0.0):
        self.model, self.tokens, self.chunk, self.vocab = model, tokens, chunk, vocab  # vocab: the target's
        self.p_min = p_min  # stop proposing at a choice the draft gives less than this (adaptive K)
        self.provider = build_provider(spec)
        self.state = self.provider.new_state(model.geometries(), model.device)
        self.state.keep_rollback(tokens)
        self.held: list[int] = []  # the ids the draft's state holds
        self.rng = torch.Generator().manual_seed(seed + 0x5eed) if seed is not None else None

    def propose(self, history: list[int], k: int, sampling: SamplingConfig, constraint=None
                ) -> tuple[list[int], list | None]:
        new = history[len(self.held):]
        if 1 < len(new) <= self.tokens + 1:  # after a verification: its ids as decode steps, one kernel call a layer
            logits = self.model.forward_many([(torch.tensor(new), self.state, "steps")])[0][-1]
        else:
            logits = prefill(self.model, self.state, new, self.chunk)[-1]
        self.held = list(history)
        # the proposals it runs (all but the last) are trimmed away where the target refuses them:
        # only as far as its engine decides nothing at their ends, or the trim could not go back
        k = min(k, self.tokens, 1 + self.state.quiet_rows(max(k - 1, 0)))
        ids, qs = [], []
        for i in range(k):
            tok, q, sure = self._choose(logits, sampling, constraint)
            if tok is None:
                break
            ids.append(tok)
            qs.append(q)
            if constraint is not None:
                constraint.accept(tok)
            if not sure:  # the step that found it unsure is paid for: its choice is verified, and the last
                break
            if i + 1 < k:
                logits = self.model.forward(torch.tensor([tok]), self.state)[-1]
                self.held.append(tok)
        if constraint is not None:
            constraint.rollback(len(ids))
        return ids, (qs if sampling.temperature > 0 else None)

    def _choose(self, logits: torch.Tensor, sampling: SamplingConfig, constraint):
        """(id, the distribution it was drawn from (None under greedy), whether the draft's likeliest
        id has at least p_min), or (None, None, False) when the grammar is done. An unsure choice is
        proposed and ends the proposals (adaptive K): a rule on the draft's distribution alone, never
        on the id drawn, so each proposal is still a draw from q."""
        if logits.shape[0] != self.vocab:  # the same tokens, padded to another row count
            logits = torch.cat([logits[:self.vocab].float(),
                                torch.full((max(0, self.vocab - logits.shape[0]),), float("-inf"))])
        logits = logits.float()
        if constraint is not None:
            if constraint.done:
                return None, None, False
            mask = torch.from_numpy(constraint.allowed())
            n = min(mask.shape[0], logits.shape[0])
            logits = logits.clone()
            logits[:n].masked_fill_(~mask[:n], float("-inf"))
            logits[n:] = float("-inf")
        if sampling.temperature == 0.0:
            tok = int(torch.argmax(logits))
            return tok, None, self.p_min <= 0 or float(torch.softmax(logits, dim=-1)[tok]) >= self.p_min
        q = probabilities(logits, sampling).double()
        q = q / q.sum()
        return draw(q, self.rng), q, float(q.max()) >= self.p_min

    def prime(self, history: list[int]) -> None:
        """Take the prompt (`history`) as the target's prefill ends: the draft's own prefill, timed
        with the target's (and a first proposal that needs only the newest id)."""
        if len(history) > len(self.held):
            prefill(self.model, self.state, history[len(self.held):], self.chunk)
            self.held = list(history)

    def state_bytes(self, positions: int) -> int:
        """What its state may grow to, as a budget counts it (it runs `tokens` past the target)."""
        return self.provider.state_bytes(self.model.geometries(), positions, self.tokens)

    def reserve(self, positions: int) -> None:
        self.state.reserve(positions + self.tokens)

    def settle(self, history: list[int]) -> None:
        """The target kept `history`: the draft forgets what it ran past their common prefix."""
        same = common_prefix(self.held, history)
        if same < len(self.held):
            if not self.state.can_trim(same):
                raise LarqlError("the draft's state cannot go back to the target's history")
            self.state.trim(same)
            self.held = self.held[:same]


class Verifier:
    """Speculation for one sequence: its newest id and the proposer's ids after it, run as one block
    whose every row's logits the sequence takes in turn as plain decode would (`Sequence.sample`)
    while the target's choice is the proposal; then every state cut back to the history kept. With
    its counters: ids proposed, those kept, and the target's passes."""

    def __init__(self, proposer: Proposer, adapt: bool = True):
        self.proposer = proposer
        self.proposal: tuple[list[int], list | None] | None = None  # what the running block verifies
        self.proposed = self.accepted = self.steps = 0
        self.length = DraftLength(proposer.tokens) if adapt else None  # None: up to `tokens` every round
        self.began = (0.0, 0.0)  # when the running round began, and compiles.seconds() then

    @property
    def tokens(self) -> int:
        """The most ids it proposes at once: the rows past the first a block may take, and the
        positions a state may have to go back."""
        return self.proposer.tokens

    @property
    def verifying(self) -> bool:
        return self.proposal is not None

    def state_bytes(self, positions: int) -> int:
        return self.proposer.state_bytes(positions)

    def reserve(self, positions: int) -> None:
        self.proposer.reserve(positions)

    def prime(self, history: list[int]) -> None:
        self.proposer.prime(history)

    def block(self, seq) -> tuple[torch.Tensor, object, str]:
        """`seq`'s next block: its newest id and the proposals after it (never past max_tokens: the
        last one's logits give the token after it), every row's logits, attended as decode steps."""
        self.began = (time.perf_counter(), compiles.seconds())
        most = self.length.next() if self.length is not None else self.tokens
        room = min(most, seq.gen.max_tokens - len(seq.generated) - 1)
        # rows past the newest only as far as the engine decides nothing at their ends: trimmed back,
        # the state is then the one plain decode leaves (a decision between them would differ)
        room = min(room, seq.state.quiet_rows(room + 1) - 1)
        ids, qs = self.proposer.propose(seq.history, room, seq.gen.sampling,
                                        seq.shaper.constraint) if room > 0 else ([], None)
        if self.length is not None and most > 0 and room <= 0:  # no room to propose: not a proposing round
            self.length.not_run()
        self.proposal = (ids, qs)
        seq.logits = None
        return torch.tensor(seq.history[-1:] + ids, dtype=torch.long), seq.state, "steps" if ids else "last"

    def verify(self, seq, logits: torch.Tensor) -> list:
        """Each row's logits in turn, while the target's choice is the proposal; the tokens `seq`
        let out."""
        (ids, qs), self.proposal = self.proposal, None
        before = len(seq.generated)
        self.steps += 1
        self.proposed += len(ids)
        out: list = []
        for j in range(len(ids) + 1):
            seq.logits, seq.ready = logits[j], True
            guess = (ids[j], qs[j] if qs is not None else None) if j < len(ids) else None
            out += seq.sample(guess)
            if seq.finished or guess is None or seq.generated[-1] != guess[0]:
                break
            self.accepted += 1
        keep = len(seq.history) - 1  # the state holds all but the newest id, as after any step
        if seq.state.position > keep:
            seq.state.trim(keep)
        self.proposer.settle(seq.history)
        if self.length is not None:  # a cold kernel's compile is no cost of a round
            t0, c0 = self.began
            self.length.measured(len(seq.generated) - before,
                                 time.perf_counter() - t0 - (compiles.seconds() - c0))
        return out
