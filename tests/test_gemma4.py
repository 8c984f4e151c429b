"""Gemma 4 (`gemma4_text`) against transformers' own Gemma4ForCausalLM on tiny random checkpoints,
each option on and off: K/V shared by the last layers (with the double-wide MLP), K used as V on
global layers, experts beside the MLP, per-layer inputs, wide proportional-RoPE global heads; and the
KV engines on layers that read an earlier layer's rows."""

from __future__ import annotations

import pytest
import torch
import transformers

from larqlpy.calibration import calibrate
from larqlpy.config import GenerationConfig
from larqlpy.engines import new_state, parse_engine_spec
from larqlpy.engines.registry import build_provider
from larqlpy.model.decoder import prefill
from larqlpy.tools.residency import residency
from larqlpy.weights import calibration_file
from larqlpy.weights.loader import load
from hf_compare import hf_generate, logit_gaps
from test_batched import Job, alone
from test_families import canonical_and_window
from test_moe import IDS
from test_speculative import states_equal
from tiny import write_tokenizer

LONG = IDS * 8  # crosses the window many times, and cells of 64 positions (cells/v1) past its active ones

S, G = "sliding_attention", "full_attention"
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, sliding_window=8, layer_types=[S, S, G, S, S, G],
            max_position_embeddings=256, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
            bos_token_id=2, eos_token_id=1, pad_token_id=0)
SHARED = dict(num_kv_shared_layers=3, use_double_wide_mlp=True)  # layers 3, 4 read layer 1's rows; 5 reads 2's
# each variant: its overrides and its seed
VARIANTS = {
    "shared": (dict(SHARED, hidden_size_per_layer_input=32), 0),  # 32: the per-layer projection packs (int8)
    "k_eq_v": (dict(attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size=48), 1),
    "moe": (dict(SHARED, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                 hidden_size=80), 2),
    "plain": (dict(hidden_size_per_layer_input=8, head_dim=8, global_head_dim=16), 3),
}


def make(path, overrides: dict, seed: int):
    """A random tiny Gemma 4 in the HF layout (norms, scalars and router scales given values that
    matter); returns the transformers model."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    cfg = transformers.Gemma4TextConfig(**{"vocab_size": vocab, "vocab_size_per_layer_input": vocab, **BASE,
                                           **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            gain = "norm" in n or "scale" in n
            p.normal_(1.0 if gain else 0.0, 0.3 if gain else 0.08)
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, make(d, *VARIANTS[request.param]), load(d, device="cpu")


_PACKED: dict = {}


def packed(variant):
    """The variant's checkpoint with int8 weights (loaded once)."""
    name, _, ours = variant
    if name not in _PACKED:
        _PACKED[name] = load(ours.path, device="cpu", weights="int8")
    return _PACKED[name]


def test_logits_match_transformers_in_prefill_and_decode(variant):
    name, hf, ours = variant
    assert max(logit_gaps(ours, hf, IDS)) < 1e-3, name


def test_greedy_ids_match_transformers(variant):
    name, hf, ours = variant
    gen = GenerationConfig(max_tokens=10, stop_at_eos=False)
    assert alone(ours, Job(IDS[:12], gen=gen))[0] == hf_generate(hf, IDS[:12], 10), name


def test_the_config_declares_each_option(variant):
    name, _, ours = variant
    c = ours.config
    reads = [c.shape(i).reads for i in range(6)]
    assert reads == ([None, None, None, 1, 1, 2] if name in ("shared", "moe") else [None] * 6)
    assert [c.shape(i).head_dim for i in range(6)] == [c.head_dim] * 2 + [2 * c.head_dim] + [c.head_dim] * 2 + \
        [2 * c.head_dim]
    assert c.shape(2).k_as_v == (name == "k_eq_v") and c.shape(2).kv_heads == (1 if name == "k_eq_v" else 2)
    assert c.shape(4).intermediate_size == (192 if name in ("shared", "moe") else 96)
    assert (c.moe is not None) == (name == "moe") and (c.per_layer_inputs is not None) == (name in ("shared", "plain"))


@pytest.mark.parametrize("variant", ["shared"], indirect=True)
def test_window_is_bit_identical_to_canonical_on_shared_layers(variant):
    _, _, ours = variant
    canonical, window = canonical_and_window(ours, IDS)
    assert torch.equal(canonical, window)


@pytest.mark.parametrize("variant", ["shared"], indirect=True)
@pytest.mark.parametrize("engine", ["codec/v1 k_bits=8 v_bits=8 calib=off", "cells/v1 budget=100KiB bits=4",
                                    "window/v1"])
def test_engines_run_on_shared_layers_and_store_them_once(variant, engine):
    """Every engine builds stores for the three layers that keep rows only; the others read them.
    A prompt in blocks then decode steps: logits near canonical/v1's (window/v1's the same), cells
    quantized under the budget; the bytes the accounting charges are those of the three layers."""
    _, _, ours = variant
    name, *options = engine.split()
    spec = parse_engine_spec(continuation=name, options=options)
    geometries, ids = ours.model.geometries(), LONG[:300]
    states = [new_state(s, geometries, ours.device) for s in (parse_engine_spec(), spec)]
    logits = []
    for s in states:
        s.reserve(len(ids))
        out = [prefill(ours.model, s, ids[:290], 32, all_logits=True)]
        logits.append(torch.cat(out + [ours.model(torch.tensor([t]), s) for t in ids[290:]]))
        assert [type(x).__name__ for x in s.layers[3:]] == ["ReadsEarlier"] * 3
        assert sum(x.resident_bytes() for x in s.layers[3:]) == 0
    gap = (logits[1] - logits[0]).abs().max().item()
    assert gap == 0.0 if name == "window/v1" else 0 < gap < 2.0
    provider = build_provider(spec)
    kept = [g for g in geometries if g.reads is None]
    assert provider.state_bytes(geometries, len(ids)) == provider.state_bytes(kept, len(ids))
    if name == "window/v1":  # exact accounting: what the three stores hold
        assert states[1].resident_bytes() == provider.state_bytes(geometries, len(ids))
    if name == "cells/v1":
        assert any(t["event"] == "MEMORY_PRESSURE" for t in states[1].report()["transitions"])


@pytest.mark.parametrize("variant", ["shared"], indirect=True)
@pytest.mark.parametrize("engine", [["canonical/v1"], ["window/v1"], ["codec/v1", "bits=4", "calib=off"],
                                    ["cells/v1", "budget=100KiB"]])
def test_a_verification_on_shared_layers_is_plain_decode_and_rolls_back(variant, engine):
    """Speculation's verification rows, each attended as its own decode step on layers that read an
    earlier layer's rows (which took the whole block first), give plain decode's logits bit for bit
    (int8 weights, whose products do not depend on the rows beside them); trimmed back, the state is
    plain decode's."""
    model, spec, ids = packed(variant).model, parse_engine_spec(None, engine[0], engine[1:]), LONG[:60]
    spec_state, plain = (new_state(spec, model.geometries(), model.device) for _ in range(2))
    spec_state.keep_rollback(5)
    for s in (spec_state, plain):
        prefill(model, s, ids[:30], 16)  # the window-8 rings have wrapped
    steps = [model(torch.tensor([t]), plain)[-1] for t in ids[30:33]]
    verified = model.forward_many([(torch.tensor(ids[30:33] + [1, 2]), spec_state, "steps")])[0]
    assert all(torch.equal(a, b) for a, b in zip(steps, verified[:3]))
    spec_state.trim(33)
    assert states_equal(spec_state, plain)
    after = [model(torch.tensor([t]), s)[-1] for s in (spec_state, plain) for t in ids[33:40]]
    assert all(torch.equal(a, b) for a, b in zip(after[:7], after[7:]))


def test_residency_counts_layers_that_read_others_rows_once():
    """gemma4-e2b (35 layers, a global one every fifth, the last 20 reading layers 13 and 14): the
    rows and bytes of its first 15 layers only, each kind at its own head width."""
    r = residency("gemma4-e2b", 4096, [parse_engine_spec()])
    assert r["shared"] == 20 and r["kinds"] == {"sliding": 28, "global": 7}
    sliding, global_ = (r["engines"][0]["by_kind"][k] for k in ("sliding", "global"))
    assert (sliding["layers"], sliding["rows"], global_["rows"]) == (28, 12 * 4096, 3 * 4096)
    assert sliding["bytes"] == 12 * 4096 * 2 * 256 * 4 and global_["bytes"] == 3 * 4096 * 2 * 512 * 4


@pytest.mark.parametrize("variant", ["shared"], indirect=True)
def test_a_key_calibration_of_layers_of_two_head_widths_is_measured_kept_and_read_back(variant):
    """Measured (on a short text: the packaged one takes minutes through the byte-level tokenizer),
    saved with each layer's own head shape, read back at the next load as usable."""
    _, _, ours = variant
    cals, meta = calibrate(ours, text="the cat sat on the mat and then ran " * 12)
    calibration_file.save(ours.home, cals, meta)
    again = load(ours.path, device="cpu")
    assert again.model.calibration_problem is None and again.model.key_calibration is not None
    assert [c.mean.shape[-1] for c in again.model.key_calibration[:3]] == [16, 16, 32]
