"""DeepSeek-V2 and V3 (model/mla.py, model/routing.py, families/deepseek.py) against transformers' own
classes on tiny random checkpoints: logits within 1e-3 in prefill and decode, greedy ids; the KV
engines holding one latent row a position (kv_lora_rank + qk_rope_head_dim values), window/v1
bit-identical to canonical/v1, codec/v1 and cells/v1 running on latent rows."""

from __future__ import annotations

import pytest
import torch
import transformers

from larqlpy.calibration import calibrate, ensure
from larqlpy.config import GenerationConfig
from larqlpy.engines import EngineSpec, build_provider, new_state
from larqlpy.engines.registry import parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.model.families import config_from_dict
from larqlpy.model.decoder import prefill
from larqlpy.tools.residency import residency
from larqlpy.weights.loader import load
from hf_compare import hf_generate, hf_logits, logit_gaps, our_logits
from test_batched import Job, alone, batched
from test_families import canonical_and_window
from tiny import write_tokenizer

IDS = [2] + [7 + (i * 37) % 280 for i in range(40)]
BASE = dict(intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0,
            tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
# (config class, model class, fields): V2 without a q LoRA, group-limited greedy routing over 8
# experts in 4 groups, a YaRN RoPE; V2 with a q LoRA, greedy routing; V3's sigmoid noaux_tc routing
# with its bias, plain (rotate-half) RoPE and a dense first layer
MODELS = {
    "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        BASE, hidden_size=64, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, first_k_dense_replace=1,
        rope_parameters=YARN)),
    "v2-lora": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        BASE, hidden_size=48, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16,
        v_head_dim=8, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, topk_method="greedy",
        first_k_dense_replace=0)),
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        BASE, hidden_size=80, q_lora_rank=40, kv_lora_rank=56, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1, rope_interleave=False)),
}


def make(path, name: str, seed: int = 0, **changes):
    """A random tiny DeepSeek in the HF layout (MODELS[name]'s fields, `changes` over them); returns the
    transformers model."""
    config_cls, model_cls, extra = MODELS[name]
    path.mkdir(parents=True, exist_ok=True)
    cfg = getattr(transformers, config_cls)(**{"vocab_size": write_tokenizer(path), **extra, **changes})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms start at one, the router bias at zero: give them values that matter
        for n, p in [*model.named_parameters(), *model.named_buffers()]:
            if n.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in n:
                p.normal_(1.0, 0.3)
            elif p.is_floating_point() and "inv_freq" not in n:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, make(d, request.param, seed=len(request.param)), load(d, device="cpu")


def test_logits_match_transformers_in_prefill_and_decode(model):
    name, hf, ours = model
    assert max(logit_gaps(ours, hf, IDS)) < 1e-3, name


def test_greedy_ids_match_transformers(model):
    """Alone, and three sequences decoded side by side (the decode kernel's one call over latent rows)."""
    name, hf, ours = model
    gen = GenerationConfig(max_tokens=10, stop_at_eos=False)
    want = {n: hf_generate(hf, IDS[:n], 10) for n in (12, 7, 20)}
    assert alone(ours, Job(IDS[:12], gen=gen))[0] == want[12], name
    together = batched(ours, [Job(IDS[:n], gen=gen, key=n) for n in want], parallel=3)
    assert {n: together[n][0] for n in want} == want, name


def test_window_is_bit_identical_to_canonical(model):
    name, _, ours = model
    canonical, window = canonical_and_window(ours, IDS)
    assert torch.equal(canonical, window), name


def test_engines_hold_one_latent_row_a_position(model):
    """canonical/v1 holds kv_lora_rank + qk_rope_head_dim values a position and layer, no per-head
    K or V; the accounting residency reports says the same."""
    name, _, ours = model
    mla, layers = ours.config.mla, ours.config.num_hidden_layers
    want = (mla.kv_lora_rank + mla.qk_rope_head_dim) * 4  # float32 rows beside float32 weights
    spec = EngineSpec()
    state = new_state(spec, ours.model.geometries(), ours.device)
    prefill(ours.model, state, IDS[:16], 16)
    assert [g.row_bytes for g in ours.model.geometries()] == [want] * layers
    assert build_provider(spec).state_bytes(ours.model.geometries(), 16) == 16 * want * layers, name
    for store in state.layers:
        rows = store.rows.read(0, 16)
        assert list(rows) == ["k"] and rows["k"].shape == (1, 16, mla.kv_lora_rank + mla.qk_rope_head_dim)
    canonical = residency(str(ours.path), 16)["engines"][0]
    assert canonical["engine"] == "canonical/v1" and canonical["bytes"] == 16 * want * layers


def test_named_geometries_account_latent_rows():
    """DeepSeek-V3: 61 layers of 512 + 64 values a position, nothing per head."""
    r = residency("deepseek-v3", 4096)
    assert r["engines"][0]["bytes"] == 4096 * 61 * 576 * 4
    assert "codec/v1" not in [e["engine"] for e in r["engines"]]  # TurboQuant needs a power-of-two row
    assert residency("deepseek-v2-lite", 1000)["engines"][0]["bytes"] == 1000 * 27 * 576 * 4


@pytest.mark.parametrize("change, words", [
    ({"kv_lora_rank": 0}, "kv_lora_rank"), ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
    ({"topk_method": "sinkhorn"}, "unsupported topk_method"), ({"n_group": 3}, "do not fit together"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
])
def test_bad_configs_are_refused_in_one_line(change, words):
    raw = {"model_type": "deepseek_v2", "vocab_size": 300, **MODELS["v2"][2], **change}
    with pytest.raises(LarqlError, match=words) as e:
        config_from_dict(raw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("engine", ["codec/v1", "cells/v1"])
def test_codec_and_cells_run_on_latent_rows(model, engine):
    """Coded latent rows (K and V coded apart: the same row twice) give logits near transformers',
    and not exactly theirs (cells/v1 under a budget that quantizes every cell but the newest)."""
    name, hf, ours = model
    if name != "v3":
        pytest.skip("one model is enough")
    ids = [2] + [7 + (i * 37) % 280 for i in range(249)]
    options = ["bits=4"] if engine == "codec/v1" else ["budget=200KiB"]
    state = new_state(parse_engine_spec(continuation=engine, options=options), ours.model.geometries(), ours.device)
    got = prefill(ours.model, state, ids[:240], 48, all_logits=True)
    steps = torch.stack([ours.model(torch.tensor([t]), state)[-1] for t in ids[240:]])
    want = hf_logits(hf, ids)
    gap = (torch.cat([got, steps]) - want).abs().mean().item()
    assert 1e-4 < gap < 0.1 * want.abs().mean().item(), (engine, gap)
    assert (steps.argmax(-1) == want[240:].argmax(-1)).float().mean() > 0.7, engine


def test_speculative_steps_equal_plain_decode(model):
    """Rows verified as successive decode steps (attend_block's stepped path over latent rows) give
    the logits plain decode steps give (float32 experts of several rows round apart from one row's,
    docs/model.md, ~1e-7), and the rows kept after them are the same."""
    name, _, ours = model
    states = [new_state(EngineSpec(), ours.model.geometries(), ours.device) for _ in range(2)]
    for s in states:
        prefill(ours.model, s, IDS[:20], 8)
    plain = torch.stack([ours.model(torch.tensor([t]), states[0])[-1] for t in IDS[20:25]])
    steps = ours.model.forward_many([(torch.tensor(IDS[20:25]), states[1], "steps")])[0]
    assert (plain - steps).abs().max().item() < 1e-5, name
    for a, b in zip(*(s.layers for s in states)):
        assert (a.rows.read(0, 25)["k"] - b.rows.read(0, 25)["k"]).abs().max().item() < 1e-5, name


def test_v3_multi_token_prediction_layers_are_left(model, tmp_path):
    """A V3 checkpoint's MTP layer (layers.{num_hidden_layers}, num_nextn_predict_layers) is not
    run and does not stop the load; a V2 checkpoint with such a layer is refused as any stray tensor."""
    from safetensors.numpy import load_file, save_file

    name, _, ours = model
    if name == "v2-lora":
        pytest.skip("one of each version is enough")
    for f in ours.path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    n = ours.config.num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = tensors[f"model.layers.{n - 1}.self_attn.o_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    if name == "v3":
        assert torch.equal(our_logits(load(tmp_path, device="cpu"), IDS[:8]), our_logits(ours, IDS[:8]))
    else:
        with pytest.raises(LarqlError, match="not used by its family"):
            load(tmp_path, device="cpu")


def test_key_calibration_refused_in_one_line_and_left_out_under_auto(model):
    name, _, ours = model
    if name != "v3":
        pytest.skip("one model is enough")
    with pytest.raises(LarqlError, match="no key calibration for multi-head latent attention"):
        calibrate(ours)
    assert ensure(ours, parse_engine_spec(continuation="codec/v1", options=["bits=4"])) is None  # calib=auto
    assert ours.model.key_calibration is None
