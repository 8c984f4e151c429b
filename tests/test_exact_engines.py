"""Gates: window/v1 is bit-identical to canonical/v1; the no-cache replay agrees; horizons hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from larqlpy.engines import EngineSpec, build_provider, new_state, parse_engine_spec
from larqlpy.config import GenerationConfig
from larqlpy.decode.stream import stream_generate
from larqlpy.weights.loader import load
from tiny import make_tiny

WINDOW = parse_engine_spec(continuation="window/v1")
CANONICAL = EngineSpec()


def run_steps(loaded, spec, ids, chunks, decode_steps, check_horizon=None, kv_dtype=None):
    """Prefill `ids` in blocks of the given sizes (all logits), then greedy-decode; returns
    (prefill logits, decode logits per step, generated ids). kv_dtype: exact rows in that dtype
    instead of the model's."""
    geoms = loaded.model.geometries()
    if kv_dtype is not None:
        geoms = [dataclasses.replace(g, kv_dtype=kv_dtype) for g in geoms]
    state = new_state(spec, geoms, loaded.device)
    pos, outs = 0, []
    for size in chunks:
        outs.append(loaded.model(torch.tensor(ids[pos:pos + size]), state, all_logits=True))
        pos += size
        if check_horizon:
            check_horizon(state)
    assert pos == len(ids)
    logits, gen, steps = torch.cat(outs), [], []
    nxt = int(logits[-1].argmax())
    for _ in range(decode_steps):
        gen.append(nxt)
        step = loaded.model(torch.tensor([nxt]), state)[-1]
        steps.append(step)
        if check_horizon:
            check_horizon(state)
        nxt = int(step.argmax())
    return logits, torch.stack(steps), gen


def horizon_checker(keep_by_layer):
    def check(state):
        for store in state.layers:
            base, end = store.retained()
            assert end == state.position
            keep = keep_by_layer(store.geometry)
            assert base == (0 if keep is None else max(0, end - keep)), (store.geometry, base, end)
    return check


@pytest.fixture(scope="module")
def prompt(real, long_text):
    return real.tokenizer.encode(long_text)[:700]  # past the 512-token window


# CI keeps one blocking on the 270M, and the tiny models' below
@pytest.mark.parametrize("chunks", [[700], pytest.param([300, 250, 150], marks=pytest.mark.heavy),
                                    pytest.param([512, 1, 187], marks=pytest.mark.heavy)])
def test_window_is_bit_identical_to_canonical_on_270m(real, prompt, chunks):
    ref = run_steps(real, CANONICAL, prompt, chunks, 16, horizon_checker(lambda g: None))
    got = run_steps(real, WINDOW, prompt, chunks, 16, horizon_checker(lambda g: g.window))
    assert torch.equal(ref[0], got[0])  # every prefill position
    assert torch.equal(ref[1], got[1])  # every decode step
    assert ref[2] == got[2]


def test_window_resident_bytes_are_bounded_on_270m(real, prompt):
    state = new_state(WINDOW, real.model.geometries(), real.device)
    row = 2 * 256 * 4
    for lo in range(0, 700, 100):
        real.model(torch.tensor(prompt[lo:lo + 100]), state)
        by_kind = state.resident_by_kind()
        assert by_kind["sliding"] <= 15 * 512 * row  # never more than the ring ...
        if lo + 100 >= 512:
            assert by_kind["sliding"] == 15 * 512 * row  # ... and exactly the ring once it is full
        assert by_kind["global"] >= 3 * (lo + 100) * row
    provider = build_provider(WINDOW)
    accounted = sum(provider.retained_rows(g, 700) * provider.row_bytes(g) for g in real.model.geometries()
                    if g.kind == "sliding")
    assert accounted == state.resident_by_kind()["sliding"]


@pytest.mark.parametrize("continuation", [None, pytest.param("window/v1", marks=pytest.mark.heavy)])
def test_no_cache_replay_matches_canonical_on_270m(real, prompt, continuation):
    cfg = GenerationConfig(max_tokens=6, stop_at_eos=False)
    ids = prompt[:600]
    ref = list(stream_generate(real.model, ids, CANONICAL, cfg))
    spec = parse_engine_spec("no-cache", continuation)
    assert spec.replay
    got = list(stream_generate(real.model, ids, spec, cfg))
    assert [t.id for t in got] == [t.id for t in ref]
    diff = max((a.logits - b.logits).abs().max().item() for a, b in zip(got, ref))
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("n_kv, window", [(2, 5), (1, 8), (2, 3)])
def test_window_bit_identical_on_tiny_models(tmp_path, n_kv, window):
    make_tiny(tmp_path, num_key_value_heads=n_kv, sliding_window=window)
    loaded = load(tmp_path, device="cpu")
    ids = list(range(10, 47))
    for chunks in ([37], [4, 9, 1, 23], [1] * 37):
        ref = run_steps(loaded, CANONICAL, ids, chunks, 20)
        got = run_steps(loaded, WINDOW, ids, chunks, 20, horizon_checker(lambda g: g.window))
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]) and ref[2] == got[2]


def test_window_option_keeps_more_rows_and_stays_exact(tmp_path):
    make_tiny(tmp_path, sliding_window=5)
    loaded = load(tmp_path, device="cpu")
    spec = parse_engine_spec(engine="windowed-checkpoint:window=12")
    assert spec.identity == "window/v1" and spec.options_dict == {"window": 12}
    ids = list(range(10, 40))
    ref = run_steps(loaded, CANONICAL, ids, [7, 23], 10)
    got = run_steps(loaded, spec, ids, [7, 23], 10, horizon_checker(lambda g: None if g.window is None else 12))
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_window_option_below_the_model_window_is_refused(tmp_path):
    from larqlpy.errors import LarqlError

    make_tiny(tmp_path, sliding_window=8)
    loaded = load(tmp_path, device="cpu")
    with pytest.raises(LarqlError, match="below layer 0's sliding window 8"):
        new_state(parse_engine_spec(engine="windowed-checkpoint:window=4"),
            loaded.model.geometries(), loaded.device)
