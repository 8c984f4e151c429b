"""The decode loop: sampling, stopping, chunked prefill, metrics."""

from __future__ import annotations

import pytest
import torch

from larqlpy.engines import EngineSpec, new_state, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.config import GenerationConfig, SamplingConfig
from larqlpy.decode.sampling import sample
from larqlpy.decode.stream import generate_step, stream_generate
from larqlpy.model.decoder import prefill
from larqlpy.weights.loader import load
from larqlpy.decode.scheduler import Scheduler
from larqlpy.decode.sequence import Sequence
from tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d)
    return load(d, device="cpu")


def test_sampling_rules():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample(logits, SamplingConfig(), None) == 1
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingConfig(temperature=5.0, top_k=1), gen) for _ in range(50)} == {1}
    assert {sample(logits, SamplingConfig(temperature=5.0, top_p=1e-6), gen) for _ in range(50)} == {1}
    picks = {sample(logits, SamplingConfig(temperature=1.0, top_k=2), gen) for _ in range(200)}
    assert picks == {1, 3}
    counts = torch.bincount(torch.tensor([sample(logits, SamplingConfig(temperature=1.0), gen) for _ in range(4000)]),
                            minlength=4).float() / 4000
    assert torch.allclose(counts, torch.softmax(logits, 0), atol=0.03)


def test_seeded_sampling_reproducible(tiny):
    cfg = GenerationConfig(max_tokens=16, sampling=SamplingConfig(temperature=1.0, seed=11), stop_at_eos=False)
    a = [t.id for t in stream_generate(tiny.model, [2, 40, 41], EngineSpec(), cfg)]
    b = [t.id for t in stream_generate(tiny.model, [2, 40, 41], EngineSpec(), cfg)]
    assert a == b and len(a) == 16


def test_stops_at_eos_and_reports_finish(tiny):
    # force EOS: make it the argmax by treating every token as a stop id
    toks = list(stream_generate(tiny.model, [2, 40], EngineSpec(), GenerationConfig(max_tokens=10),
                         stop_ids=set(range(tiny.config.vocab_size))))
    assert len(toks) == 1 and toks[0].finish_reason == "stop"
    toks = list(stream_generate(tiny.model, [2, 40], EngineSpec(), GenerationConfig(max_tokens=5, stop_at_eos=False)))
    assert [t.finish_reason for t in toks] == [None] * 4 + ["length"]
    assert toks[-1].metrics.decode_tokens == 5 and toks[-1].metrics.position == 2 + 4


def test_chunked_prefill_matches_one_block(tiny):
    ids = list(range(10, 60))
    geo = tiny.model.geometries()
    one = prefill(tiny.model, new_state(EngineSpec(), geo, tiny.device), ids, 64, all_logits=True)
    for chunk in (1, 3, 8, 9):
        got = prefill(tiny.model, new_state(EngineSpec(), geo, tiny.device), ids, chunk, all_logits=True)
        assert (got - one).abs().max().item() < 1e-4


def test_generation_config_from_dict_ignores_unknown_keys():
    cfg = GenerationConfig.from_dict({"max_tokens": 3, "temperature": 0.5, "seed": 1, "colour": "blue", "top_k": None})
    assert cfg.max_tokens == 3 and cfg.sampling.temperature == 0.5 and cfg.sampling.seed == 1 and \
        cfg.sampling.top_k == 0


def test_python_api(tmp_path):
    import larqlpy

    make_tiny(tmp_path)
    m = larqlpy.load(tmp_path, device="cpu")
    toks = list(m.generate("the cat", max_tokens=4, stop_at_eos=False))
    assert len(toks) == 4 and all(t.metrics.prompt_tokens == len(m.tokenizer.encode("the cat")) for t in toks)
    with pytest.raises(larqlpy.LarqlError):
        list(m.generate("x", continuation="nope/v1"))


def test_each_token_carries_its_own_metrics_snapshot(tiny):
    toks = list(stream_generate(tiny.model, [2, 40, 41], EngineSpec(),
                                GenerationConfig(max_tokens=6, stop_at_eos=False)))
    assert [t.metrics.decode_tokens for t in toks] == [1, 2, 3, 4, 5, 6]  # an earlier token's figures stay its own
    assert [t.metrics.position for t in toks] == [3, 4, 5, 6, 7, 8]
    assert all(a.metrics.decode_seconds <= b.metrics.decode_seconds for a, b in zip(toks, toks[1:]))
    with pytest.raises(Exception):
        toks[0].metrics.decode_tokens = 9  # frozen


def test_streamed_text_waits_for_characters_split_across_ids(tiny):
    tok = tiny.tokenizer
    text = "the é and 日本 then 🙂 in"
    ids = tok.encode(text)[1:]
    assert len(ids) > len(text.split())  # the accented and CJK characters come as byte-fallback ids
    d = tok.stream()
    pieces = [d.step(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    # a 4-byte character arrives over four byte ids: nothing until the last, then the whole character
    emoji = tok.inner.encode("🙂", add_special_tokens=False).ids
    d = tok.stream()
    assert len(emoji) == 4 and [d.step(i) for i in emoji] == ["", "", "", "🙂"]


def test_the_detokenizer_window_stays_short_over_a_long_output(tiny):
    d = tiny.tokenizer.stream()
    ids = tiny.tokenizer.encode("the cat in the garden " * 400)[1:]
    out = []
    for i in ids:
        out.append(d.step(i))
        assert len(d.ids) <= d.WAIT + 1  # what a step decodes does not grow with the output
    assert "".join(out) == tiny.tokenizer.decode(ids)
    bad = [tiny.tokenizer.inner.token_to_id("<0xFF>")] * 6 + ids[:3]  # bytes that are never UTF-8
    d = tiny.tokenizer.stream()
    assert "".join(d.step(i) for i in bad).startswith("\ufffd")


def test_replay_is_handled_inside_the_sequence(tiny):
    """no-cache rebuilds its state from the ids every step, and gives the cached ids."""
    cfg = GenerationConfig(max_tokens=5, stop_at_eos=False)
    cached = [t.id for t in stream_generate(tiny.model, [2, 40, 41], EngineSpec(), cfg)]
    replay = parse_engine_spec(engine="no-cache")
    seq = Sequence(tiny.model, [2, 40, 41], replay, cfg)
    replayed = []
    for tok in generate_step(tiny.model, seq):
        replayed.append(tok.id)
        assert seq.state.position == 0 or seq.finished  # a fresh state after every token
    assert cached == replayed and seq.held() is None  # no-cache keeps no state


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_non_finite_logits_stop_the_run(tiny, bad, temperature):
    """A NaN or an infinity reaching the logits is refused, greedy (seen in the argmax itself) and
    sampled (the sum), alone and in a batch -- never sampled from."""
    one = torch.zeros(8)
    one[3] = bad
    with pytest.raises(LarqlError, match="non-finite logits"):
        sample(one, SamplingConfig(temperature=temperature), torch.Generator().manual_seed(0))
    ok = torch.zeros(8)
    ok[5] = float("-inf")  # a masked-out token alone is no overflow
    assert sample(ok, SamplingConfig(temperature=0.0), None) == 0
    head = tiny.model.embed_tokens.data if tiny.model.cfg.tie_word_embeddings else tiny.model.lm_head.data
    saved = head[7].clone()
    head[7] = bad  # one vocabulary row: every logit finite but that one
    try:
        gen = GenerationConfig(max_tokens=3, sampling=SamplingConfig(temperature=temperature, seed=1))
        with pytest.raises(LarqlError, match="non-finite logits"):
            list(stream_generate(tiny.model, [2, 5, 9], EngineSpec(), gen))
        seqs = [Sequence(tiny.model, [2, 5, 9], gen=gen, key=0), Sequence(tiny.model, [4, 4], gen=gen, key=1)]
        ends = [e.seq for e in Scheduler(tiny.model, parallel=2).run(seqs) if e.token is None]
        assert sorted(s.key for s in ends) == [0, 1]  # a failed step is an error event of each sequence in it
        assert all("non-finite logits" in s.error for s in ends)
    finally:
        head[7] = saved
