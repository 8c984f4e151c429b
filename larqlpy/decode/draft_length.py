"""Whether the next speculative round proposes (up to the most the request allows) or not at all,
from what this run measures: the tokens a round lets out per second with proposals, and without
them (plain decode), each a running figure over its own rounds, older rounds weighing less. A
round does what measures best.

Measured, not modelled: what speculation is worth depends on things a model of it gets wrong. A
verification row costs a small part of a step where the CPU multiplies several rows at once (VNNI),
nearly a whole step's arithmetic on AVX2. The draft's own steps, and its catch-up after a refusal,
cost what they cost on this machine. A round's wall time, from its proposals to its last verified
token, holds all of that; the share of proposals kept is in the tokens it lets out. Within a round
the draft already proposes fewer where it is unsure (`draft_p_min`). A middle length as a third
choice was tried: a round's tokens vary so much (a run of kept proposals ends at the first refused)
that it was often chosen where the most was better by 17% (docs/speculative.md).

Each choice is tried TRIES times first, proposals first. After that, one round in EXPLORE tries the
other (one in 2 or 4 EXPLORE where the gap is wide), so a change (a stretch of text the draft
predicts well, a machine that got busy) is found. Where plain decode measures best, speculation
costs at most one round in EXPLORE. No number a sequence lets
out depends on the choice: a verification keeps exactly what plain decode would.
"""

from __future__ import annotations

DECAY, TRIES, EXPLORE = 0.95, 2, 8


class DraftLength:
    """The next round's proposal count, and what the choice rests on (`why`)."""

    def __init__(self, most: int):
        self.arms = [most, 0]  # the lengths it chooses between
        self.tokens = dict.fromkeys(self.arms, 0.0)  # running sums per length: tokens let out, seconds
        self.seconds = dict.fromkeys(self.arms, 0.0)
        self.tries = dict.fromkeys(self.arms, 0)
        self.rounds = 0
        self.current: int | None = most  # None: the running round measures neither choice

    def rate(self, k: int) -> float:
        """Tokens per second a round of length k let out, as measured so far (0: not yet)."""
        return self.tokens[k] / self.seconds[k] if self.seconds[k] > 0 else 0.0

    def best(self) -> int:
        return max(self.arms, key=lambda k: (self.rate(k), k))

    def every(self) -> int:
        """Rounds between tries of the other choice: EXPLORE, and 2x or 4x that where the best
        measures 1.25x or 1.6x the other (a try costs more, and finds less, the wider the gap)."""
        rates = sorted((self.rate(k) for k in self.arms), reverse=True)
        gap = rates[0] / rates[1] if rates[1] > 0 else 1.0
        return EXPLORE * (4 if gap >= 1.6 else 2 if gap >= 1.25 else 1)

    def next(self) -> int:
        """The length of the round about to run."""
        self.rounds += 1
        young = [k for k in self.arms if self.tries[k] < TRIES]
        if young:
            self.current = young[0]
        elif self.rounds % self.every() == 0:  # the other choice
            self.current = next(k for k in self.arms if k != self.best())
        else:
            self.current = self.best()
        self.tries[self.current] += 1
        return self.current

    def not_run(self) -> None:
        """The round chosen to propose had no room to (max_tokens, or an engine about to decide at the
        next row): a plain step, which measures nothing of proposing and is no try of it."""
        self.tries[self.current] -= 1
        self.current = None

    def measured(self, tokens: int, seconds: float) -> None:
        """The round of length `current` let out `tokens` in `seconds` (proposals, verification, sampling)."""
        k = self.current
        if k is None:
            return
        self.tokens[k] = DECAY * self.tokens[k] + tokens
        self.seconds[k] = DECAY * self.seconds[k] + seconds

    def why(self) -> dict:
        """What was chosen and what it rests on, for stats: rounds and tokens/s per length."""
        return {"rounds": self.rounds,
                "by_length": {str(k): {"rounds": self.tries[k], "tokens_per_s": round(self.rate(k), 2)}
                              for k in self.arms},
                "chosen": self.best()}
