"""Granite, Granite-MoE, StarCoder2 and GPT-2 against transformers' own classes on tiny random
checkpoints (logits in prefill and decode, greedy ids), window/v1 against canonical/v1, GPT-2 under
no-cache replay, and the same models written as GGUF files the way llama.cpp's converter lays them
out, read by larqlpy (and by transformers where its GGUF loader takes the architecture)."""

from __future__ import annotations

import pytest
import torch
import transformers

from larqlpy.config import GenerationConfig
from larqlpy.engines.registry import parse_engine_spec
from larqlpy.weights.loader import load
from hf_compare import hf_generate, logit_gaps
from test_batched import Job, alone
from test_families import canonical_and_window
from tiny import write_tokenizer

IDS = [2] + [7 + (i * 37) % 280 for i in range(40)]
SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0)
GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5)
# transformers' config class and extra fields, sized to run in milliseconds; StarCoder2's window
# short enough that a 40-token prompt crosses it
FAMILIES = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(SIZES, tie_word_embeddings=False, **GRANITE)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        SIZES, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True, **GRANITE)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        SIZES, sliding_window=8, use_bias=True, norm_epsilon=1e-5, tie_word_embeddings=False)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=3, n_head=4, n_positions=128, bos_token_id=2,
                                                   eos_token_id=1)),
}


def make(path, name: str, seed: int = 0, **overrides):
    """A random tiny model of `name` in the HF layout; returns the transformers model."""
    config_cls, model_cls, extra = FAMILIES[name]
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    cfg = getattr(transformers, config_cls)(**{"vocab_size": vocab, **extra, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms and biases start at constants; give them values so they matter
        for n, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in n or "bias" in n or "ln_" in n else 0.08)
            if ("norm" in n or "ln_" in n) and n.endswith("weight"):
                p.add_(1.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, make(d, request.param), load(d, device="cpu")


def test_logits_match_transformers_in_prefill_and_decode(family):
    name, _, hf, ours = family
    assert max(logit_gaps(ours, hf, IDS)) < 1e-3, name


def test_greedy_ids_match_transformers(family):
    name, _, hf, ours = family
    want = hf_generate(hf, IDS[:12], 10)
    gen = GenerationConfig(max_tokens=10, stop_at_eos=False)
    assert alone(ours, Job(IDS[:12], gen=gen))[0] == want, name
    if name == "gpt2":  # replayed from position 0 every step: learned positions right each time
        assert alone(ours, Job(IDS[:12], spec=parse_engine_spec(engine="no-cache"), gen=gen))[0] == want


def test_starcoder2_window_is_bit_identical_to_canonical(family):
    name, _, _, ours = family
    if name != "starcoder2":
        pytest.skip("one family is enough: the window engine sees no family difference")
    assert ours.config.windows == (8,) * 3
    canonical, window = canonical_and_window(ours, IDS)
    assert torch.equal(canonical, window)
