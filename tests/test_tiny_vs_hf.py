"""Logits against Hugging Face transformers' Gemma3ForCausalLM on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from larqlpy.engines import EngineSpec, new_state
from larqlpy.config import GenerationConfig
from larqlpy.model.decoder import prefill
from larqlpy.decode.stream import stream_generate
from larqlpy.weights.loader import load
from tiny import make_tiny

VARIANTS = {
    "plain": {},
    "softcap+linear-rope": dict(final_logit_softcapping=30.0,
                                rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "mqa-pattern": dict(num_key_value_heads=1, layer_types=None, sliding_window_pattern=3, sliding_window=5),
}


def ours_all_logits(loaded, ids, chunk):
    state = new_state(EngineSpec(), loaded.model.geometries(), loaded.device)
    return prefill(loaded.model, state, ids, chunk, all_logits=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_transformers(tmp_path, variant):
    hf = make_tiny(tmp_path, **VARIANTS[variant])
    loaded = load(tmp_path, device="cpu")
    ids = torch.randint(7, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunk in (40, 7, 1):  # one block, uneven chunks across the window, token by token
        got = ours_all_logits(loaded, ids, chunk)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-4, (variant, chunk)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_ids_match_transformers(tmp_path, variant):
    hf = make_tiny(tmp_path, seed=3, **VARIANTS[variant])
    loaded = load(tmp_path, device="cpu")
    ids = torch.randint(7, hf.config.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    cfg = GenerationConfig(max_tokens=24, prefill_chunk=5, stop_at_eos=False)
    got = [t.id for t in stream_generate(loaded.model, ids, EngineSpec(), cfg)]
    assert got == ref


def test_multimodal_gemma3_layout_loads_text_part(tmp_path):
    hf = make_tiny(tmp_path / "text")
    mm = tmp_path / "mm"
    mm.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (mm / f).write_bytes((tmp_path / "text" / f).read_bytes())
    text_cfg = json.loads((tmp_path / "text" / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text_cfg,
                                                "eos_token_id": [1, 6]}))
    weights = load_file(str(tmp_path / "text" / "model.safetensors"))
    save_file({"language_model." + k: v for k, v in weights.items()}, str(mm / "model.safetensors"))
    loaded = load(mm, device="cpu")
    assert loaded.config.eos_token_ids == (1, 6)
    ids = list(range(10, 30))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours_all_logits(loaded, ids, 8) - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint(tmp_path):
    hf = make_tiny(tmp_path / "one")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / f).write_bytes((tmp_path / "one" / f).read_bytes())
    ids = list(range(10, 30))
    a = ours_all_logits(load(sharded, device="cpu"), ids, 8)
    b = ours_all_logits(load(tmp_path / "one", device="cpu"), ids, 8)
    assert torch.equal(a, b)


def test_bfloat16_runs_close_to_float32(tmp_path):
    make_tiny(tmp_path)
    ids = list(range(10, 40))
    f32 = ours_all_logits(load(tmp_path, device="cpu"), ids, 8)
    bf16 = ours_all_logits(load(tmp_path, device="cpu", dtype="bfloat16"), ids, 8)
    assert bf16.dtype == torch.float32  # logits come back as f32 either way
    assert (f32.argmax(-1) == bf16.argmax(-1)).float().mean() >= 0.8
    assert (f32 - bf16).abs().max().item() < 0.5
