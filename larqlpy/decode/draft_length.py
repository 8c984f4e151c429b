"""How many ids to propose in the next speculative round, from what this run measures: the share
of proposals the target keeps, what a verification row costs on this machine, and what a proposal
costs to make. Down to none -- plain decode -- where speculation would not pay.

A round that proposes k ids and verifies them in one pass of k + 1 rows lets out, with each
proposal kept with probability a (until the first refused one),
    E(k) = (1 - a^(k+1)) / (1 - a)
ids, and costs  step(k + 1) + k * draft,  where step(r) = c0 + c1 * (r - 1) is the target's pass over
r rows. Plain decode lets out one id per c0. The round proposes the k <= most with the best
E(k) * c0 / cost(k); none when that best is not above 1. On a CPU with integer dot products for
several rows at once (VNNI) c1 is a small part of c0 and long rounds pay; on AVX2 each extra row
costs nearly its own arithmetic, and short rounds or none are best (docs/speculative.md).

The estimates are running ones, older rounds weighing less (DECAY a round). While the estimates are
young the round proposes `most`; after that, one round in EXPLORE tries one id more or fewer than
the best (at least 2 ids where the best is none), so both the acceptance and the cost of a row
keep being measured. No number a sequence lets out depends on k: a verification keeps exactly
what plain decode would.
"""

from __future__ import annotations

DECAY, YOUNG, EXPLORE = 0.9, 4, 8


class Ewm:
    """An exponentially weighted running sum of a few quantities."""

    def __init__(self, n: int):
        self.s = [0.0] * n

    def add(self, *xs: float) -> None:
        self.s = [DECAY * a + x for a, x in zip(self.s, xs)]


class DraftLength:
    """The next round's proposal count, and what the choice rests on (`why`)."""

    def __init__(self, most: int):
        self.most, self.rounds, self.plain = most, 0, 0
        self.kept = Ewm(2)  # ids kept, rounds that ended at a refused id
        self.rows = Ewm(5)  # weight, r, r*r, seconds, r*seconds over passes of r rows
        self.draft = Ewm(2)  # ids proposed, seconds spent proposing them
        self.chosen = 0  # sum of the k chosen

    # -- what was measured ------------------------------------------------------------------
    def proposed(self, ids: int, seconds: float) -> None:
        if ids:
            self.draft.add(ids, seconds)

    def verified(self, rows: int, seconds: float, kept: int, refused: bool) -> None:
        self.rows.add(1.0, rows, rows * rows, seconds, rows * seconds)
        if rows > 1:
            self.kept.add(kept, float(refused))

    # -- the estimates --------------------------------------------------------------------------
    def acceptance(self) -> float:
        kept, refused = self.kept.s
        return kept / (kept + refused) if kept + refused else 0.0

    def step_costs(self) -> tuple[float, float] | None:
        """(c0, c1): a one-row pass and each row past the first, from a line through the passes
        measured (None until there are passes of two sizes)."""
        w, r, rr, t, rt = self.rows.s
        if w <= 0:
            return None
        var = rr / w - (r / w) ** 2
        if var < 1e-6:
            return None
        c1 = max(0.0, (rt / w - (r / w) * (t / w)) / var)
        c0 = t / w - c1 * (r / w - 1)
        return (c0, c1) if c0 > 0 else None

    def gain(self, k: int, a: float, c0: float, c1: float, d: float) -> float:
        """E(k) * c0 / cost(k): ids per unit of time against plain decode's."""
        if k == 0:
            return 1.0
        ids = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
        return ids * c0 / (c0 + c1 * k + d * k)

    # -- the choice -----------------------------------------------------------------------------
    def next(self) -> int:
        self.rounds += 1
        k = self.most if self.rounds <= YOUNG else self.best()
        if self.rounds > YOUNG and self.rounds % EXPLORE == 0:  # a neighbour, so the estimates stay measured
            k = min(2, self.most) if k == 0 else k - 1 if k == self.most else k + 1
        self.plain += k == 0
        self.chosen += k
        return k

    def best(self) -> int:
        costs = self.step_costs()
        if costs is None:
            return self.most
        c0, c1 = costs
        n, secs = self.draft.s
        d = secs / n if n else 0.0
        a = self.acceptance()
        gains = [self.gain(k, a, c0, c1, d) for k in range(self.most + 1)]
        return max(range(self.most + 1), key=lambda k: (gains[k], -k))

    def why(self) -> dict:
        """What the choices were and what they rest on, for stats."""
        out = {"rounds": self.rounds, "mean_draft_tokens": round(self.chosen / self.rounds, 2) if self.rounds else 0.0,
               "plain_rounds": self.plain, "acceptance_estimate": round(self.acceptance(), 3)}
        costs = self.step_costs()
        if costs is not None:
            n, secs = self.draft.s
            out.update(row_cost=round(costs[1] / costs[0], 3),
                       draft_cost=round(secs / n / costs[0], 3) if n else 0.0)
        return out
