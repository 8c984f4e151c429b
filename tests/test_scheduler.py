"""The scheduler's planning on a fake model: which rows of which sequences go into each step, who
joins when, what the budget holds back, and what a failed step does -- all without a real model."""

from __future__ import annotations

import pytest
import torch

from larqlpy.budget import KVBudget
from larqlpy.config import GenerationConfig
from larqlpy.decode.scheduler import Scheduler, admit, plan
from larqlpy.decode.sequence import Sequence
from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.engines.geometry import LayerGeometry

VOCAB = 8


class FakeModel:
    """One global layer of one KV head of 2 dims. A block appends zero rows to its state's store (so
    positions move as with a model), and each row's logits pick (its id + 1) mod 8. Records every
    call's blocks as (key, rows, which logits); fails on a block of a sequence listed in `poison`."""

    device = torch.device("cpu")

    def __init__(self):
        self.calls: list[list[tuple]] = []
        self.poison: set = set()
        self.seqs: list[Sequence] = []  # to tell a block's sequence by its state

    def owner(self, state):
        return next(s.key for s in self.seqs if s.state is state)

    def geometries(self):
        return [LayerGeometry(0, None, 1, 2)]

    def forward_many(self, blocks):
        self.calls.append([(self.owner(state), len(ids), want) for ids, state, want in blocks])
        if any(self.owner(state) in self.poison for _, state, _ in blocks):
            raise RuntimeError("the step failed")
        out = []
        for ids, state, want in blocks:
            rows = torch.zeros(1, len(ids), 2)
            for store in state.layers:
                store.append(rows, rows)
                store.release()
            state.end_block()
            logits = torch.full((len(ids), VOCAB), -1.0)
            logits[torch.arange(len(ids)), (ids + 1) % VOCAB] = 1.0
            out.append(logits if want == "all" else logits[-1:] if want == "last" else None)
        return out


def seq(model: FakeModel, key, prompt: int = 4, tokens: int = 3, chunk: int = 1024, spec=EngineSpec()):
    s = Sequence(model, [1] * prompt, spec, GenerationConfig(max_tokens=tokens, prefill_chunk=chunk), key=key)
    model.seqs.append(s)
    return s


def run(sched: Scheduler, seqs) -> dict:
    out = {s.key: [] for s in seqs}
    for e in sched.run(seqs):
        if e.token is not None:
            out[e.seq.key].append(e.token.id)
    return out


def test_decode_rows_first_then_prefill_chunks_within_the_step():
    m = FakeModel()
    sched = Scheduler(m, parallel=4, step_tokens=10)
    a, b = seq(m, "a", prompt=3), seq(m, "b", prompt=3)
    long = seq(m, "long", prompt=25, chunk=8)
    short = seq(m, "short", prompt=2)
    for s in (a, b, long, short):
        sched.submit(s)
    sched.step()
    # every prompt's first chunk that fits: a, b (3 rows each), not long's 8 (6 + 8 > 10), short's 2
    assert m.calls[-1] == [("a", 3, "last"), ("b", 3, "last"), ("short", 2, "last")]
    sched.step()
    # a, b, short decode (one row each) ahead of long's first chunk, which is the only prefill and runs
    assert m.calls[-1] == [("a", 1, "last"), ("b", 1, "last"), ("short", 1, "last"), ("long", 8, "none")]
    assert [x for x, _, _ in m.calls[-1]] == [s.key for s in plan([a, b, short], 10)] + ["long"]


def test_one_chunk_always_runs_beside_many_decode_rows():
    m = FakeModel()
    decoding = [seq(m, i, prompt=1, tokens=50) for i in range(6)]
    sched = Scheduler(m, parallel=8, step_tokens=4)
    for s in decoding:
        sched.submit(s)
    while not all(s.generated for s in decoding):  # their one-token prompts, four rows a step at most
        sched.step()
    sched.submit(seq(m, "new", prompt=9, chunk=5))  # now six rows decode: more than step_tokens
    sched.step()
    assert [k for k, n, _ in m.calls[-1] if n > 1] == ["new"] and len(m.calls[-1]) == 7


def test_the_tokens_are_what_the_model_picked_alone_and_batched():
    m = FakeModel()
    got = run(Scheduler(m, parallel=2), [seq(m, i, prompt=2 + i, tokens=4) for i in range(3)])
    assert all(ids == [2, 3, 4, 5] for ids in got.values())  # (1 + 1), then each id + 1


def test_sequences_join_as_slots_free_and_the_budget_holds_them_back():
    m = FakeModel()
    seqs = [seq(m, i, prompt=4, tokens=2) for i in range(4)]
    one = seqs[0].peak_bytes
    assert one == 2 * 2 * 4 * (4 + 2)  # K and V rows of 2 floats, at prompt + max_tokens positions
    joined, refused = admit(seqs, room=3, budget=KVBudget(2 * one))
    assert joined == seqs[:2] and refused == []  # the third waits for the budget, the fourth behind it
    huge = seq(m, "huge", prompt=100)
    joined, refused = admit([huge, *seqs], room=3, budget=KVBudget(2 * one))
    assert refused == [huge] and joined == seqs[:2]
    sched = Scheduler(m, parallel=3, budget=KVBudget(2 * one))
    live = []
    for e in sched.run([huge, *seqs]):
        live.append(len(sched.live))
        assert sched.reserved() <= 2 * one
    assert max(live) == 2 and huge.error.startswith("needs ") and all(s.finish_reason == "length" for s in seqs)


def test_a_failed_step_ends_the_sequences_in_it_and_the_others_go_on():
    m = FakeModel()
    m.poison = {"bad"}
    sched = Scheduler(m, parallel=2, step_tokens=4)
    good, bad, later = seq(m, "good", prompt=2, tokens=3), seq(m, "bad", prompt=6, tokens=3), seq(m, "later")
    events = list(sched.run([good, bad, later]))
    ends = {e.seq.key: e.seq for e in events if e.token is None}
    assert ends["bad"].error == "RuntimeError: the step failed"
    assert ends["good"].error == "RuntimeError: the step failed"  # it shared the step
    assert ends["later"].error is None and ends["later"].output == [2, 3, 4]  # it joined afterwards
    assert ends["bad"].held() is None  # a failed step leaves its state unknown: nothing is kept


def test_replay_rebuilds_every_step_inside_the_sequence():
    m = FakeModel()
    s = seq(m, "r", prompt=3, tokens=3, spec=parse_engine_spec(engine="no-cache"))
    c = seq(m, "c", prompt=3, tokens=3)
    got = run(Scheduler(m, parallel=2), [s, c])
    assert got["r"] == got["c"] == [2, 3, 4]
    rows = [n for call in m.calls for k, n, _ in call if k == "r"]
    assert rows[:3] == [3, 4, 5]  # the whole history each step, never a decode row


def test_cancel_drops_a_sequence_and_frees_its_reservation():
    m = FakeModel()
    budget = KVBudget(10_000)
    sched = Scheduler(m, parallel=2, budget=budget)
    a = seq(m, "a", tokens=50)
    sched.submit(a)
    sched.step()
    assert budget.reserved() > 0 and sched.cancel(a) and budget.reserved() == 0 and sched.idle()
    assert not sched.cancel(a) and a.held().state.position == 4


@pytest.mark.parametrize("parallel", [1, 3])
def test_max_tokens_zero_prefills_and_ends_without_a_token(parallel):
    m = FakeModel()
    s = seq(m, "z", prompt=5, tokens=0)
    events = list(Scheduler(m, parallel=parallel).run([s]))
    assert [e.token for e in events] == [None] and s.finish_reason == "length"
    assert s.held().state.position == 5 and s.held().logits is not None
