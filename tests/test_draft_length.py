"""The measured draft length (decode/draft_length.py): long rounds where verification rows are cheap
and proposals are kept, none where they would not pay, and it keeps measuring."""

from __future__ import annotations

import random

import pytest

from larqlpy.decode.draft_length import EXPLORE, YOUNG, DraftLength


def _simulate(a: float, c0: float, c1: float, d: float, rounds: int = 200, most: int = 6, seed: int = 0):
    """Rounds on a machine where a pass of r rows takes c0 + c1 (r - 1) and a proposal d, each kept
    with probability a: the counts chosen, and the tuner."""
    rng, tuner, ks = random.Random(seed), DraftLength(most), []
    for _ in range(rounds):
        k = tuner.next()
        ks.append(k)
        tuner.proposed(k, d * k)
        kept = 0
        while kept < k and rng.random() < a:
            kept += 1
        noise = 1 + 0.05 * (rng.random() - 0.5)
        tuner.verified(k + 1, (c0 + c1 * k) * noise, kept, kept < k)
    return ks, tuner


def test_cheap_rows_and_kept_proposals_take_long_rounds():
    ks, tuner = _simulate(a=0.8, c0=10e-3, c1=0.8e-3, d=0.6e-3)  # VNNI-like: a row ~8% of a step
    steady = [k for i, k in enumerate(ks[YOUNG:], YOUNG + 1) if i % EXPLORE]
    assert sum(steady) / len(steady) >= 4.5
    why = tuner.why()
    assert why["row_cost"] == pytest.approx(0.08, abs=0.03)
    assert why["acceptance_estimate"] == pytest.approx(0.8, abs=0.1)


def test_costly_rows_turn_speculation_off_but_keep_measuring():
    ks, tuner = _simulate(a=0.6, c0=10e-3, c1=9e-3, d=1.5e-3)  # AVX2-like: a row ~90% of a step
    steady = [k for i, k in enumerate(ks[YOUNG:], YOUNG + 1) if i % EXPLORE]
    assert steady.count(0) >= 0.9 * len(steady)
    explored = [k for i, k in enumerate(ks[YOUNG:], YOUNG + 1) if i % EXPLORE == 0]
    assert explored and all(k >= 2 for k in explored if k)  # it still tries, so acceptance stays measured
    assert tuner.why()["plain_rounds"] >= 0.8 * len(ks)


def test_the_gain_is_plain_decode_at_zero_and_the_expected_ids_per_cost_past_it():
    t = DraftLength(4)
    assert t.gain(0, 0.7, 1.0, 0.1, 0.1) == 1.0
    assert t.gain(2, 0.5, 1.0, 0.0, 0.0) == pytest.approx(1.75)  # 1 + 0.5 + 0.25 ids for one pass
    assert t.gain(3, 1.0, 1.0, 0.5, 0.0) == pytest.approx(4 / 2.5)


def test_young_estimates_propose_the_most_and_one_size_of_pass_tries_another():
    t = DraftLength(5)
    assert [t.next() for _ in range(YOUNG)] == [5] * YOUNG
    for _ in range(YOUNG):
        t.verified(6, 0.01, 5, False)
    assert t.step_costs() is None and t.next() == 5  # no line through passes of one size: the most
