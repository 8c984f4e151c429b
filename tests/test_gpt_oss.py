"""GPT-OSS against transformers' own classes on tiny random checkpoints: logits in prefill and decode,
greedy ids (f32 and bf16 weights, two sizes); its attention sinks in every KV engine (window/v1 bit
for bit against canonical/v1, cells/v1 beside it, codec/v1's decode on codes against decoding them,
the decode kernel against the softmax written out); YaRN's frequencies against transformers'."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from larqlpy.engines import EngineSpec, new_state
from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.registry import parse_engine_spec
from larqlpy.engines.stores.base import AttentionParams, attention
from larqlpy.engines.stores.codec import CodecStore
from larqlpy.engines.stores.kvcodec import KVCodec
from larqlpy.engines.stores.state import Scratch
from larqlpy.errors import LarqlError
from larqlpy.kernels.attention.decode import Span, attend_rows
from larqlpy.kernels.kvcodec.rowcodec import TurboQuantCodec
from larqlpy.model.decoder import inv_freq, prefill
from larqlpy.model.families import config_from_dict
from larqlpy.weights.loader import load
from hf_compare import greedy_hf, greedy_ours, logit_gaps
from test_moe import IDS
from tiny import write_tokenizer

CPU = torch.device("cpu")
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
# (weights' dtype, seed, sizes): a window of 8 rows, so a 40-token prompt crosses it
CASES = {
    "f32": (torch.float32, 0, dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
    "bf16": (torch.bfloat16, 1, dict(hidden_size=48, intermediate_size=40, num_attention_heads=6,
                                     num_key_value_heads=2, head_dim=8, num_local_experts=5, num_experts_per_tok=3)),
}


def randomized(cfg, seed: int, each=lambda n, p: None):
    """transformers' model of `cfg` (eager attention), seeded random values, `each(name, param)` after."""
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0.0, 1.0 if "sinks" in n else 0.3 if "norm" in n or "bias" in n else 0.08)
            if "norm" in n:
                p.add_(1.0)
            each(n, p)
    return model


def make(path, dtype, seed, sizes):
    """A random tiny GPT-OSS in the HF layout (weights in `dtype`); returns transformers' model in
    float32 over the same (rounded) weights. Sinks of spread 1, so they take a real share."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = transformers.GptOssConfig(vocab_size=write_tokenizer(path), num_hidden_layers=4, sliding_window=8,
                                    max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                                    rope_parameters=YARN, **sizes)
    model = randomized(cfg, seed)
    model.to(dtype).save_pretrained(str(path), safe_serialization=True)
    return model.float()


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"gpt_oss_{request.param}")
    hf = make(d, *CASES[request.param])
    return request.param, hf, load(d, device="cpu")


def test_config_reads_the_family():
    raw = {"model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 32,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_local_experts": 4, "num_experts_per_tok": 2}
    cfg = config_from_dict(raw)
    assert cfg.windows == (128, None, 128, None) and cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias
    assert cfg.rope_global.rope_type == "yarn" and cfg.rope_global.theta == 150000.0
    assert cfg.moe.softmax_after_topk and cfg.moe.swiglu_limit == 7.0 and cfg.moe.swiglu_alpha == 1.702
    for bad, says in (({"swiglu_limit": "7"}, "swiglu_limit"), ({"num_local_experts": 0}, "num_local_experts"),
                      ({"rope_parameters": {"rope_type": "yarn"}}, "yarn rope scaling needs")):
        with pytest.raises(LarqlError, match=says):
            config_from_dict({**raw, **bad})
    # mscale and mscale_all_dim (DeepSeek's) set the attention factor for any family, as in transformers
    yarn = {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "rope_theta": 1e4}
    for extra, want in (({"mscale": 1.0}, 0.1 * math.log(4) + 1), ({"mscale": 1.0, "mscale_all_dim": 1.0}, 1.0)):
        assert config_from_dict({**raw, "rope_parameters": {**yarn, **extra}}).rope_global.attention_factor == \
            pytest.approx(want)


def test_yarn_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for extra in ({}, {"truncate": True}, {"attention_factor": 0.7}):
        hf_cfg = transformers.GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                           max_position_embeddings=256, rope_parameters={**YARN, **extra})
        want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
        ours = config_from_dict({**hf_cfg.to_dict(), "vocab_size": 300}).rope_global
        assert torch.allclose(inv_freq(ours, 16), want, rtol=1e-6) and ours.attention_factor == pytest.approx(factor)


def test_logits_match_transformers_in_prefill_and_decode(tiny):
    name, hf, ours = tiny
    assert max(logit_gaps(ours, hf, IDS)) < 1e-3, name


def test_greedy_ids_match_transformers(tiny):
    name, hf, ours = tiny
    assert greedy_ours(ours, IDS[:12], 12) == greedy_hf(hf, IDS[:12], 12), name


def engine_logits(loaded, spec) -> torch.Tensor:
    """A prompt in chunks of 8, then a token at a time, on one engine."""
    state = new_state(spec, loaded.model.geometries(), loaded.device)
    logits = [prefill(loaded.model, state, IDS[:25], 8, all_logits=True)]
    return torch.cat(logits + [loaded.model(torch.tensor([t]), state) for t in IDS[25:]])


def test_sinks_in_window_and_cells_engines(tiny):
    """window/v1's ring gives canonical/v1's bits, sinks and all; cells/v1 (rows kept exact while no
    pressure comes) its numbers."""
    name, _, ours = tiny
    canonical = engine_logits(ours, EngineSpec())
    assert torch.equal(canonical, engine_logits(ours, parse_engine_spec(continuation="window/v1"))), name
    assert (canonical - engine_logits(ours, parse_engine_spec(continuation="cells/v1"))).abs().max() < 1e-4, name


def test_sinks_in_the_codec_engine(tiny):
    """codec/v1 runs the model with its sinks: its logits follow canonical/v1's, on average, closer than a run
    with the sinks dropped does."""
    name, _, ours = tiny
    canonical = engine_logits(ours, EngineSpec())
    codec = engine_logits(ours, parse_engine_spec(continuation="codec/v1", options=["bits=4", "calib=off"]))
    for block in ours.model.layers:
        block.hot()
        block.attn = AttentionParams(block.attn.scale)
    try:
        dropped = engine_logits(ours, EngineSpec())
    finally:
        for block in ours.model.layers:
            block.__dict__.pop("_hot")
    assert (codec - canonical).abs().mean() < 0.3 * (dropped - canonical).abs().mean(), name


def reference(q, k, v, p) -> torch.Tensor:
    """Attention of one query (H, 1, D) over every row, the sinks joined to the softmax, written out."""
    group = q.shape[0] // k.shape[0]
    s = (q @ k.repeat_interleave(group, 0).transpose(1, 2)) * p.scale  # (H, 1, N)
    s = torch.cat((s, p.sinks.reshape(-1, 1, 1)), dim=-1)
    return torch.softmax(s, dim=-1)[..., :-1] @ v.repeat_interleave(group, 0)


@pytest.mark.parametrize("n", [5, 300])
def test_decode_kernel_and_codes_take_the_sinks(n):
    """The decode kernel (one chunk, and many merged) against the softmax written out, two sequences
    in one call; codec/v1's step on codes against decoding its codes (the sinks matter in both)."""
    gen = torch.Generator().manual_seed(n)
    d, p = 64, AttentionParams(scale=0.125, sinks=torch.randn(4, generator=gen) + 5)
    q = torch.randn(2, 4, d, generator=gen)
    rows = [(torch.randn(2, m, d, generator=gen), torch.randn(2, m, d, generator=gen)) for m in (n, n + 7)]
    got = attend_rows(q, [Span(k, v, 0, k.shape[1]) for k, v in rows], p.scale, sinks=p.sink_logits)
    for s, (k, v) in enumerate(rows):
        want = reference(q[s].unsqueeze(1), k, v, p)[:, 0]
        assert (got[s] - want).abs().max() < 1e-5
        assert (got[s] - reference(q[s].unsqueeze(1), k, v, AttentionParams(0.125, sinks=p.sinks * 0 - 30))[:, 0]
                ).abs().max() > 1e-2
        assert (attention(q[s].unsqueeze(1), k, v, k.shape[1] - 1, 0, None, p)[:, 0] - want).abs().max() < 1e-5
    g, codec = LayerGeometry(0, None, 2, d), TurboQuantCodec(d, 4, CPU)
    fused, plain = (CodecStore(g, CPU, codec=KVCodec(codec, codec), keep=None, scratch=Scratch(CPU), fused=f)
                    for f in (True, False))
    k, v = rows[0]
    for store in (fused, plain):
        store.attend(q[:1].transpose(0, 1).expand(4, n - 1, d).contiguous(), k[:, :-1], v[:, :-1], p)
    a, b = (s.attend(q[0].unsqueeze(1), k[:, -1:], v[:, -1:], p) for s in (fused, plain))
    assert (a - b).abs().max() < 1e-4
    keys, values = plain.read(0, torch.float32)
    assert (b - reference(q[0].unsqueeze(1), keys, values, p)).abs().max() < 1e-4


def test_codec_branches_take_the_sinks_in_their_family_call(tiny, monkeypatch):
    """Two branches of one prompt on codec/v1 decode in one family call per full layer
    (tq_attend.attend_family, sinks and all) the bits of two sequences that never forked."""
    from larqlpy.kernels.kvcodec import tq_attend

    name, _, ours = tiny
    calls, real = [], tq_attend.attend_family
    monkeypatch.setattr(tq_attend, "attend_family", lambda *a: calls.append(a[-2].shape) or real(*a))
    model, spec = ours.model, parse_engine_spec(continuation="codec/v1", options=["bits=4", "calib=off"])
    ids = [10 + i % 37 for i in range(150)]
    parent, plain = new_state(spec, model.geometries(), CPU), [new_state(spec, model.geometries(), CPU) for _ in "ab"]
    children = [new_state(spec, model.geometries(), CPU) for _ in "ab"]
    for state in (parent, *plain):
        prefill(model, state, ids, 64)
    for child in children:
        child.fork_from(parent)
    for t in range(4):
        tokens = [torch.tensor([40 + t * (i + 1)]) for i in range(2)]
        got = model.forward_many([(tok, s, "last") for tok, s in zip(tokens, children)])
        want = model.forward_many([(tok, s, "last") for tok, s in zip(tokens, plain)])
        assert all(torch.equal(x, y) for x, y in zip(got, want)), (name, t)
    assert calls and all(shape == (model.cfg.num_attention_heads,) for shape in calls), name
