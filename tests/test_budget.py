"""One KV budget for a process: live sequences reserve what they may grow to, kept states live in
what is left and are pushed out (persisted) when a live sequence joins."""

from __future__ import annotations

import pytest

from larqlpy.budget import KVBudget
from larqlpy.config import GenerationConfig
from larqlpy.decode.scheduler import Scheduler
from larqlpy.errors import LarqlError
from larqlpy.state.prefix_cache import PrefixCache
from larqlpy.pipeline.prepare import prepare
from larqlpy.pipeline.request import Request
from larqlpy.weights.loader import load
from tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, sliding_window=64)
    return load(d, device="cpu")


def request(ids: list[int], n: int = 8) -> Request:
    return Request(ids=tuple(ids), gen=GenerationConfig(max_tokens=n, stop_at_eos=False))


def test_a_live_sequence_pushes_kept_states_out_and_the_total_holds(tiny):
    first = [2] + [7 + i % 200 for i in range(60)]
    second = [2] + [100 + i % 150 for i in range(60)]  # shares nothing with the first
    peak = prepare(tiny, request(first)).peak_bytes
    budget = KVBudget(int(1.5 * peak))  # one live sequence and half a kept one
    cache = PrefixCache(tiny, budget)
    sched = Scheduler(tiny.model, parallel=2, budget=budget)
    for ids in (first, second):
        seq = prepare(tiny, request(ids), source=cache)
        for event in sched.run([seq]):
            # after every step: what the live sequences reserved and what stays kept, together
            assert budget.reserved() + cache.resident_bytes() <= budget.limit
        assert seq.finish_reason == "length"
        cache.put(seq.held())
    assert cache.transitions["ACTIVE->PERSISTED"] == 1  # the first, when the second joined
    again = prepare(tiny, request(first + [5, 6]), source=cache)
    list(sched.run([again]))
    assert again.held_from == len(first) and cache.transitions["RECOVERING->ACTIVE"] == 1  # back from its file
    cache.close()


def test_what_can_never_fit_is_refused_and_a_process_budget_must_be_positive(tiny):
    seq = prepare(tiny, request([2, 3, 4], n=100))
    budget = KVBudget(seq.peak_bytes - 1)
    (event,) = list(Scheduler(tiny.model, budget=budget).run([seq]))
    assert event.token is None and seq.error.startswith("needs ") and seq.state is None
    with pytest.raises(LarqlError, match="`kv_budget` must be positive"):
        KVBudget(0)


def test_a_state_dir_loses_the_temp_files_of_a_server_that_died_while_saving(tiny, tmp_path):
    stale = tmp_path / ".0123abcd.lqkv.999999.deadbeef.tmp"  # a kill -9 in the middle of a persist
    stale.write_bytes(b"x" * 4096)
    kept = tmp_path / "notes.txt"
    kept.write_text("not ours")
    cache = PrefixCache(tiny, KVBudget(), state_dir=tmp_path)
    assert not stale.exists() and kept.exists() and cache.entries == []


def test_kept_states_go_least_recently_used_first(tiny):
    """Three kept states made in the order a, b, c; then a request continues a. Under pressure b goes
    first: a hit hands a's state to the request, and its state comes back, used last, when it ends."""
    prompts = {name: [2] + [base + i % 90 for i in range(40)] for name, base in (("a", 10), ("b", 110), ("c", 210))}
    cache = PrefixCache(tiny, KVBudget())
    sched = Scheduler(tiny.model, parallel=1)

    def turn(ids: list[int]):
        seq = prepare(tiny, request(ids, 4), source=cache)
        list(sched.run([seq]))
        cache.put(seq.held())
        return seq

    for name in "abc":
        turn(prompts[name])
    again = turn(prompts["a"] + [5, 6, 7])
    assert again.held_from == len(prompts["a"])  # it continued a's state
    order = [e.tokens[:len(prompts["a"])] for e in sorted(cache.entries, key=lambda e: e.used)]
    assert order == [prompts["b"], prompts["c"], prompts["a"]]
    one = max(e.nbytes() for e in cache.entries)
    cache.budget.limit = 2 * one + one // 2  # room for two of the three
    cache.enforce()
    stages = {n: next(e.stage for e in cache.entries if e.tokens[:len(p)] == p) for n, p in prompts.items()}
    assert stages == {"a": "ACTIVE", "b": "PERSISTED", "c": "ACTIVE"}
    cache.close()
