"""The measured draft length (decode/draft_length.py): proposals where their rounds let out more
tokens per second than plain decode, none where they would not pay, and it keeps measuring."""

from __future__ import annotations

import random

from larqlpy.decode.draft_length import EXPLORE, TRIES, DraftLength


def _simulate(a: float, c0: float, c1: float, d: float, rounds: int = 300, most: int = 6, seed: int = 0):
    """Rounds on a machine where a pass of r rows takes c0 + c1 (r - 1) and a proposal d, each kept
    with probability a until the first refused: the lengths chosen, and the tuner."""
    rng, tuner, ks = random.Random(seed), DraftLength(most), []
    for _ in range(rounds):
        k = tuner.next()
        ks.append(k)
        kept = 0
        while kept < k and rng.random() < a:
            kept += 1
        noise = 1 + 0.1 * (rng.random() - 0.5)
        tuner.measured(kept + 1, (c0 + c1 * k + d * k) * noise)
    return ks, tuner


def _steady(ks):
    return ks[TRIES * 2:]


def test_cheap_rows_and_kept_proposals_speculate():
    ks, tuner = _simulate(a=0.85, c0=10e-3, c1=0.8e-3, d=0.6e-3)  # VNNI-like: a row ~8% of a step
    steady = _steady(ks)
    assert steady.count(6) >= 0.95 * len(steady) and tuner.every() == 4 * EXPLORE  # a wide gap: rare tries
    why = tuner.why()
    assert why["chosen"] == 6 and why["by_length"]["6"]["tokens_per_s"] > 2 * why["by_length"]["0"]["tokens_per_s"]


def test_costly_rows_turn_speculation_off_but_keep_measuring():
    ks, tuner = _simulate(a=0.6, c0=10e-3, c1=9e-3, d=1.5e-3)  # AVX2-like: a row ~90% of a step
    steady = _steady(ks)
    assert steady.count(0) >= 0.95 * len(steady)
    assert 300 // (4 * EXPLORE) - 1 <= ks[TRIES * 2:].count(6) <= 300 // EXPLORE  # it still tries speculation
    assert tuner.why()["chosen"] == 0


def test_each_choice_is_tried_first_proposals_first():
    t = DraftLength(5)
    seen = []
    for _ in range(TRIES * 2):
        seen.append(t.next())
        t.measured(1, 0.01)
    assert seen == [5] * TRIES + [0] * TRIES



def test_a_round_with_no_room_to_propose_measures_nothing():
    """Near max_tokens (or a decision row of the engine) a proposing round runs as a plain step: it
    is neither a try of proposing nor a figure of it."""
    length = DraftLength(6)
    assert length.next() == 6
    length.not_run()
    length.measured(1, 10.0)  # a slow plain step: not charged to proposing
    assert length.rate(6) == 0.0 and length.tries[6] == 0 and length.rate(0) == 0.0
    assert length.next() == 6  # proposing is still to be tried
