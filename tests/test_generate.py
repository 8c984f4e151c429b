"""The decode loop: sampling, stopping, chunked prefill, metrics."""

from __future__ import annotations

import pytest
import torch

from larqlpy.engines import EngineSpec, build_provider
from larqlpy.generate import GenerationConfig, SamplingConfig, generate, prefill, sample
from larqlpy.model.loader import load
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
    a = [t.id for t in generate(tiny.model, [2, 40, 41], EngineSpec(), cfg)]
    b = [t.id for t in generate(tiny.model, [2, 40, 41], EngineSpec(), cfg)]
    assert a == b and len(a) == 16


def test_stops_at_eos_and_reports_finish(tiny):
    # force EOS: make it the argmax by treating every token as a stop id
    toks = list(generate(tiny.model, [2, 40], EngineSpec(), GenerationConfig(max_tokens=10),
                         stop_ids=set(range(tiny.config.vocab_size))))
    assert len(toks) == 1 and toks[0].finish_reason == "stop"
    toks = list(generate(tiny.model, [2, 40], EngineSpec(), GenerationConfig(max_tokens=5, stop_at_eos=False)))
    assert [t.finish_reason for t in toks] == [None] * 4 + ["length"]
    assert toks[-1].metrics.decode_tokens == 5 and toks[-1].metrics.position == 2 + 4


def test_chunked_prefill_matches_one_block(tiny):
    ids = list(range(10, 60))
    geo = tiny.model.geometries()
    one = prefill(tiny.model, build_provider(EngineSpec()).new_state(geo, tiny.device), ids, 64, all_logits=True)
    for chunk in (1, 3, 8, 9):
        got = prefill(tiny.model, build_provider(EngineSpec()).new_state(geo, tiny.device), ids, chunk, all_logits=True)
        assert (got - one).abs().max().item() < 1e-4


def test_generation_config_from_dict_ignores_unknown_keys():
    cfg = GenerationConfig.from_dict({"max_tokens": 3, "temperature": 0.5, "seed": 1, "colour": "blue", "top_k": None})
    assert cfg.max_tokens == 3 and cfg.sampling.temperature == 0.5 and cfg.sampling.seed == 1 and cfg.sampling.top_k == 0


def test_python_api(tmp_path):
    import larqlpy

    make_tiny(tmp_path)
    m = larqlpy.load(tmp_path, device="cpu")
    toks = list(m.generate("the cat", max_tokens=4, stop_at_eos=False))
    assert len(toks) == 4 and all(t.metrics.prompt_tokens == len(m.tokenizer.encode("the cat")) for t in toks)
    with pytest.raises(larqlpy.LarqlError):
        list(m.generate("x", continuation="nope/v1"))
