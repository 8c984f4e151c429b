"""Batched decode: a sequence decoded among others gives the ids it gives alone -- and, with the
packed integer weights, the same logits bit for bit; the KV budget holds at every step."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

from larqlpy.config import GenerationConfig
from larqlpy.engines import EngineSpec, parse_engine_spec, preset_spec
from larqlpy.engines.presets import RECOMMENDED
from larqlpy.budget import KVBudget
from larqlpy.decode.scheduler import Scheduler
from larqlpy.decode.sequence import Sequence
from larqlpy.decode.stream import stream_generate
from larqlpy.weights.loader import load
from tiny import make_tiny

ENGINES = {
    "canonical": EngineSpec(),
    "window": parse_engine_spec(continuation="window/v1"),
    "codec": preset_spec(RECOMMENDED),
    "cells": parse_engine_spec(continuation="cells/v1"),
    "no-cache": parse_engine_spec(engine="no-cache"),
}
# GEMM against GEMV rounding with float32 weights, exact engines (measured up to 1e-4 on logits of
# magnitude ~25: docs/batch.md). codec/v1 has no such bound: a rounding apart can flip a K/V code.
F32_LOGIT_BOUND = 5e-4


class Job(NamedTuple):
    """What to generate, as often as a test needs a sequence of it (a sequence runs once)."""

    prompt_ids: list[int]
    spec: EngineSpec = EngineSpec()
    gen: GenerationConfig = GenerationConfig()
    key: object = None

    def seq(self, loaded) -> Sequence:
        return Sequence(loaded.model, self.prompt_ids, self.spec, self.gen, key=self.key)


def alone(loaded, job: Job) -> tuple[list[int], list[torch.Tensor]]:
    toks = list(stream_generate(loaded.model, job.prompt_ids, job.spec, job.gen))
    return [t.id for t in toks], [t.logits for t in toks]


def batched(loaded, jobs: list[Job], parallel: int, **kw) -> dict:
    out = {j.key: ([], []) for j in jobs}
    for e in Scheduler(loaded.model, parallel=parallel, **kw).run([j.seq(loaded) for j in jobs]):
        assert e.seq.error is None
        if e.token is not None:
            out[e.seq.key][0].append(e.token.id)
            out[e.seq.key][1].append(e.token.logits)
    return out


@pytest.fixture(scope="module")
def real_int8(real_dir):
    return load(real_dir, device="cpu", weights="int8")


def mixed_jobs(tokenizer, text: str, tokens: int = 12) -> list[Job]:
    """Mixed prompt lengths (one past the 270M's 512-row window) on every engine; more jobs than
    slots, so sequences join mid-run."""
    ids = tokenizer.encode(text)
    lengths = [5, 40, 600, 17, 90, 3, 230]
    names = ["canonical", "window", "window", "codec", "cells", "no-cache", "canonical"]
    gen = GenerationConfig(max_tokens=tokens, stop_at_eos=False)
    return [Job(ids[i * 7:i * 7 + n], ENGINES[name], gen, key=(name, n))
            for i, (n, name) in enumerate(zip(lengths, names))]


def test_a_sequence_in_a_batch_is_bit_identical_to_alone_with_int8_weights(real_int8, long_text):
    jobs = mixed_jobs(real_int8.tokenizer, long_text)
    got = batched(real_int8, jobs, parallel=3)
    for job in jobs:
        ids, logits = alone(real_int8, job)
        assert got[job.key][0] == ids, job.key
        assert all(torch.equal(a, b) for a, b in zip(got[job.key][1], logits)), job.key


@pytest.mark.heavy  # the suite's 30-minute budget
def test_native_weights_too(real_dir, long_text):
    loaded = load(real_dir, device="cpu", weights="native")
    jobs = mixed_jobs(loaded.tokenizer, long_text, tokens=6)[:4]
    got = batched(loaded, jobs, parallel=4)
    for job in jobs:
        ids, logits = alone(loaded, job)
        assert got[job.key][0] == ids and all(torch.equal(a, b) for a, b in zip(got[job.key][1], logits)), job.key


def test_float32_weights_give_the_same_ids_within_the_stated_logit_bound(real, long_text):
    jobs = mixed_jobs(real.tokenizer, long_text)[:5]
    got = batched(real, jobs, parallel=5)
    worst = 0.0
    for job in jobs:
        ids, logits = alone(real, job)
        assert got[job.key][0] == ids, job.key
        if job.spec.identity != "codec/v1":
            worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(got[job.key][1], logits)))
    assert 0 < worst <= F32_LOGIT_BOUND


def test_a_prefill_chunk_shares_steps_with_decode_rows(real_int8, long_text):
    """A 600-token prompt in chunks of 128 while two short ones decode: they are not held up."""
    ids = real_int8.tokenizer.encode(long_text)
    gen = GenerationConfig(max_tokens=8, stop_at_eos=False, prefill_chunk=128)
    jobs = [Job(ids[:6], gen=gen, key="a"), Job(ids[10:20], gen=gen, key="b"), Job(ids[:600], gen=gen, key="long")]
    sched = Scheduler(real_int8.model, parallel=3, step_tokens=130)
    seen = []
    for e in sched.run([j.seq(real_int8) for j in jobs]):
        if e.token is not None:
            seen.append(e.seq.key)
    assert seen.index("a") < seen.index("long") and seen.count("a") == 8
    for job in jobs:
        assert alone(real_int8, job)[0] == batched(real_int8, [job], 1)[job.key][0]


def test_sampling_is_per_sequence(real_int8):
    tok = real_int8.tokenizer
    gen = GenerationConfig.from_dict({"max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 7})
    greedy = GenerationConfig(max_tokens=10)
    jobs = [Job(tok.encode("Once upon a time"), gen=gen, key="s"), Job(tok.encode("The sea"), gen=greedy, key="g")]
    got = batched(real_int8, jobs, parallel=2)
    for job in jobs:
        assert got[job.key][0] == alone(real_int8, job)[0]


def test_the_kv_budget_holds_at_every_step(real_int8, long_text):
    ids = real_int8.tokenizer.encode(long_text)
    gen = GenerationConfig(max_tokens=24, stop_at_eos=False, prefill_chunk=256)
    specs = [ENGINES["canonical"], ENGINES["window"], ENGINES["codec"]]
    jobs = [Job(ids[i * 50:i * 50 + 300 + 40 * i], specs[i % 3], gen, key=i) for i in range(6)]
    assert sum(len(j.prompt_ids) + gen.max_tokens for j in jobs) >= 2000
    seqs = [j.seq(real_int8) for j in jobs]
    peaks = [s.peak_bytes for s in seqs]
    budget = sorted(peaks)[-1] + sorted(peaks)[-2]  # two of the largest fit at once, never six
    sched = Scheduler(real_int8.model, parallel=6, budget=KVBudget(budget))
    most_live, steps = 0, 0
    while seqs or not sched.idle():
        while seqs and sched.has_room():
            sched.submit(seqs.pop(0))
        for e in sched.step():
            assert e.seq.error is None
        steps += 1
        assert sched.resident_bytes() <= sched.reserved() <= budget  # after every step
        most_live = max(most_live, len(sched.live))
    assert steps > 24 and 1 < most_live < 6


def test_a_job_larger_than_the_whole_budget_is_refused_not_waited_on(real_int8):
    sched = Scheduler(real_int8.model, parallel=2, budget=KVBudget(1000))
    events = list(sched.run([Job([2, 100, 200], gen=GenerationConfig(max_tokens=4), key="big").seq(real_int8)]))
    error = events[0].seq.error
    assert events[0].token is None and error.startswith("needs ") and "budget of 1,000 bytes" in error


def test_save_after_a_batch_equals_save_alone(real_int8, tmp_path):
    from larqlpy.pipeline.request import Request
    from larqlpy.pipeline.runner import execute, execute_many
    from larqlpy.state.format import load_state

    reqs = [Request.from_dict({"prompt": p, "max_tokens": 6, "save_state": str(tmp_path / f"b{i}.lqkv")})
            for i, p in enumerate(["The capital of France is", "Water boils at", "In 1492, Columbus"])]
    in_batch = dict(execute_many(real_int8, list(enumerate(reqs)), parallel=3))
    solo = execute(real_int8, Request.from_dict({**{"prompt": "Water boils at", "max_tokens": 6},
                                                  "save_state": str(tmp_path / "solo.lqkv")}))
    assert in_batch[1]["tokens"] == solo["tokens"]
    a, b = load_state(tmp_path / "b1.lqkv"), load_state(tmp_path / "solo.lqkv")
    assert a.tokens == b.tokens and np.array_equal(a.logits, b.logits)
    for layer in b.records:
        for (ma, fa), (mb, fb) in zip(a.records[layer], b.records[layer]):
            strip = {k: v for k, v in ma.items() if k != "_where"}  # where in its own file the data lies
            assert strip == {k: v for k, v in mb.items() if k != "_where"} and \
                all(np.array_equal(fa[k], fb[k]) for k in fb)
    resumed = execute(real_int8, Request.from_dict({"prompt": "", "resume": str(tmp_path / "b1.lqkv"),
                                                    "max_tokens": 5}))
    again = execute(real_int8, Request.from_dict({"prompt": "", "resume": str(tmp_path / "solo.lqkv"),
                                                  "max_tokens": 5}))
    assert resumed["tokens"] == again["tokens"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: `make test-cuda` runs these where one is")])])
@pytest.mark.parametrize("weights", ["f32", "int8"])
def test_tiny_model_batched_past_the_window_on_each_device(tmp_path, device, weights):
    make_tiny(tmp_path / "m")
    loaded = load(tmp_path / "m", device=device, weights=weights)
    gen = GenerationConfig(max_tokens=20, stop_at_eos=False, prefill_chunk=5)
    prompts = [[2, 5, 9, 30, 31, 32, 33, 40, 41, 42, 43, 50], [2, 7], [2, 8, 9, 10, 11, 12, 13]]
    jobs = [Job(p, spec, gen, key=i)
            for i, (p, spec) in enumerate(zip(prompts, [ENGINES["window"], ENGINES["canonical"], ENGINES["window"]]))]
    got = batched(loaded, jobs, parallel=2)
    for job in jobs:
        ids, logits = alone(loaded, job)
        assert got[job.key][0] == ids
        diff = max(float((a - b).abs().max()) for a, b in zip(got[job.key][1], logits))
        assert diff == 0.0 if weights == "int8" and device == "cpu" else diff < 1e-4
