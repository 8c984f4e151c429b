"""What a sequence's settings do to a row of logits before it is sampled, and the log-probabilities
reported of it. The order: llama.cpp's repetition penalty, OpenAI's frequency and presence
penalties, the logit bias, then the grammar's mask (so that nothing a bias adds can escape it), then
a thinking budget's forced id (decode/forcing.py) where the grammar allows it.
Log-probabilities are the log-softmax of those logits over the temperature (1 under greedy): what
is sampled from, before top-k / top-p cut the tail."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from larqlpy.config import GenerationConfig
from larqlpy.decode.constraint import Constraint
from larqlpy.decode.forcing import ThinkingBudget


@dataclass(frozen=True)
class Logprob:
    """A generated token's log-probability, and the likeliest ids beside it (id, log-probability)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Shaper:
    """One sequence's logits shaping: its counts of generated ids, its grammar's state and its
    thinking budget."""

    def __init__(self, gen: GenerationConfig, vocab_size: int, constraint: Constraint | None = None,
                 budget: ThinkingBudget | None = None):
        self.gen, self.constraint, self.budget = gen, constraint, budget
        self.active = gen.shapes_logits or budget is not None
        self.counts = torch.zeros(vocab_size) if gen.frequency_penalty or gen.presence_penalty else None
        if gen.logit_bias:
            self.bias = (torch.tensor([t for t, _ in gen.logit_bias]), torch.tensor([b for _, b in gen.logit_bias]))
        else:
            self.bias = None

    def __call__(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The logits `logits` (V,) become under these settings (a new tensor, on the CPU: the
        counts, the bias and the grammar's mask are host-side, and the chosen id goes there anyway)."""
        out = logits.detach().to("cpu", torch.float32, copy=True)
        g = self.gen
        if g.repetition_penalty != 1.0:
            recent = history if g.repeat_last_n == -1 else history[len(history) - g.repeat_last_n:] \
                if g.repeat_last_n else []
            if recent:
                ids = torch.tensor(sorted(set(recent)))
                x = out[ids]
                out[ids] = torch.where(x > 0, x / g.repetition_penalty, x * g.repetition_penalty)
        if self.counts is not None:
            out -= self.counts * g.frequency_penalty + (self.counts > 0).float() * g.presence_penalty
        if self.bias is not None:
            out.index_add_(0, self.bias[0], self.bias[1])
        if self.constraint is not None:
            out.masked_fill_(~torch.from_numpy(self.constraint.allowed()), float("-inf"))
        forced = self.budget.forced() if self.budget is not None else None
        if forced is not None:
            if out[forced] == float("-inf"):  # the grammar refuses it (or a bias of -inf): the grammar rules
                self.budget.refuse()
            else:
                keep = out[forced].clone()
                out.fill_(float("-inf"))
                out[forced] = keep
        return out

    def accept(self, tok: int) -> None:
        """`tok` was sampled."""
        if self.counts is not None:
            self.counts[tok] += 1
        if self.constraint is not None:
            self.constraint.accept(tok)
        if self.budget is not None:
            self.budget.accept(tok)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but an end may follow."""
        return self.constraint is not None and self.constraint.done


def logprob(logits: torch.Tensor, temperature: float, tok: int, top: int) -> Logprob:
    """`tok`'s log-probability under `logits` over the temperature, and the `top` likeliest ids
    (those the grammar masks out never among them)."""
    lp = torch.log_softmax(logits.float() / (temperature or 1.0), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]))
        best = tuple((int(i), float(v)) for v, i in zip(values, ids) if v != float("-inf"))
    return Logprob(float(lp[tok]), best)


def described(tokenizer, tok: int, lp: Logprob) -> dict:
    """One token's log-probabilities as OpenAI's chat API shows them (token text, logprob, bytes,
    top_logprobs), each with its id."""
    def one(i: int, value: float) -> dict:
        raw = tokenizer.token_bytes(i)
        return {"id": i, "token": raw.decode("utf-8", "replace"), "logprob": value, "bytes": list(raw)}

    return {**one(tok, lp.logprob), "top_logprobs": [one(i, v) for i, v in lp.top]}
