"""Every supported family against transformers' own model classes: tiny random configs, logits over
a prompt that crosses the sliding windows (both layer kinds where a family has them), prefill and
step-by-step decode, and the exact engines bit-identical on each."""

from __future__ import annotations

import pytest
import torch

from larqlpy.engines import EngineSpec, new_state, parse_engine_spec
from larqlpy.model.decoder import prefill
from larqlpy.weights.loader import load
from tiny import FAMILIES, make_tiny

IDS = [2] + [7 + (i * 37) % 280 for i in range(40)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    from tiny import make_tiny_family

    d = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_family(d, request.param)
    return request.param, hf, load(d, device="cpu")


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_logits_match_transformers(family):
    name, hf, ours = family
    want = hf_logits(hf, IDS)
    state = new_state(EngineSpec(), ours.model.geometries(), ours.device)
    got = prefill(ours.model, state, IDS, 64, all_logits=True)
    assert (got - want).abs().max().item() < 1e-4, name
    kinds = {g.kind for g in ours.model.geometries()}
    if name in ("mistral", "qwen2-sliding", "gemma2"):
        assert kinds == ({"sliding"} if name == "mistral" else {"sliding", "global"})
        assert len(IDS) > min(g.window for g in ours.model.geometries() if g.window)  # the windows are crossed


def test_decode_steps_match_transformers(family):
    """One position at a time: the decode kernels (jitted norms, GEMV, one-query attention with
    softcapping) against transformers' full forward."""
    name, hf, ours = family
    want = hf_logits(hf, IDS)
    state = new_state(EngineSpec(), ours.model.geometries(), ours.device)
    prefill(ours.model, state, IDS[:20], 64)
    got = torch.stack([ours.model(torch.tensor([t]), state)[-1] for t in IDS[20:]])
    assert (got - want[20:]).abs().max().item() < 1e-4, name


def canonical_and_window(loaded, ids=IDS) -> list[torch.Tensor]:
    """Logits of a prompt in chunks of 8, then a token at a time, on canonical/v1 and on window/v1."""
    out = []
    for spec in (EngineSpec(), parse_engine_spec(continuation="window/v1")):
        state = new_state(spec, loaded.model.geometries(), loaded.device)
        logits = [prefill(loaded.model, state, ids[:25], 8, all_logits=True)]
        logits += [loaded.model(torch.tensor([t]), state) for t in ids[25:]]
        out.append(torch.cat(logits))
    return out


def test_window_is_bit_identical_to_canonical(family):
    name, _, ours = family
    canonical, window = canonical_and_window(ours)
    assert torch.equal(canonical, window), name


def test_gemma3_is_still_gemma3(tmp_path):
    hf = make_tiny(tmp_path)
    ours = load(tmp_path, device="cpu")
    state = new_state(EngineSpec(), ours.model.geometries(), ours.device)
    assert (prefill(ours.model, state, IDS, 64, all_logits=True) - hf_logits(hf, IDS)).abs().max().item() < 1e-4


def test_unknown_families_and_features_are_refused_in_one_line():
    from larqlpy.errors import LarqlError
    from larqlpy.model.families import config_from_dict

    for model_type in ("falcon", "phi3", None):
        with pytest.raises(LarqlError, match=f"unsupported model_type {model_type!r}"):
            config_from_dict({"model_type": model_type})
    llama = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 1, "vocab_size": 8}
    with pytest.raises(LarqlError, match="unsupported rope_type 'longrope'"):
        config_from_dict({**llama, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(LarqlError, match="yarn rope scaling needs original_max_position_embeddings"):
        config_from_dict({**llama, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(LarqlError, match="missing or invalid hidden_size"):
        config_from_dict({**llama, "hidden_size": "8"})
