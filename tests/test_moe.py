"""Mixtures of experts (model/moe.py): Mixtral and Qwen3-MoE against transformers' own classes on tiny
random checkpoints (logits, greedy ids), rows grouped by expert against one row at a time, batched
decode, window/v1 against canonical/v1, and the same models written as GGUF files the way llama.cpp's
converter lays them out (experts as 3-D tensors), at float32 and as Q8_0 codes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from larqlpy.config import GenerationConfig
from larqlpy.convert.gguf import convert_gguf
from larqlpy.engines import EngineSpec, new_state
from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.qweight import PackedPart, PackedWeight
from larqlpy.model.decoder import prefill
from larqlpy.model.families import config_from_dict
from larqlpy.weights.info import describe
from larqlpy.weights.loader import load
from hf_compare import hf_generate, hf_logits, logit_gaps
from test_batched import Job, alone, batched
from test_families import canonical_and_window
from test_gguf_archs import TOKENS, header, permute
from tiny import make_tiny_family

IDS = [2] + [7 + (i * 37) % 280 for i in range(40)]


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, make_tiny_family(d, request.param), load(d, device="cpu")


def test_logits_match_transformers_in_prefill_and_decode(family):
    name, _, hf, ours = family
    sparse = [ours.config.is_sparse(i) for i in range(ours.config.num_hidden_layers)]
    assert sparse == ([True] * 4 if name == "mixtral" else [True, False, True, True])
    assert max(logit_gaps(ours, hf, IDS)) < 1e-3, name  # decode: one row runs its k experts


def test_greedy_ids_match_transformers(family):
    name, _, hf, ours = family
    gen = GenerationConfig(max_tokens=10, stop_at_eos=False)
    assert alone(ours, Job(IDS[:12], gen=gen))[0] == hf_generate(hf, IDS[:12], 10), name


def test_window_is_bit_identical_to_canonical(family):
    name, _, _, ours = family
    canonical, window = canonical_and_window(ours, IDS)
    assert torch.equal(canonical, window), name


def grouped_and_alone(loaded, rows: int = 12):
    experts = loaded.model.layers[0].hot().experts
    h = torch.randn(rows, loaded.config.hidden_size, generator=torch.Generator().manual_seed(1))
    _, chosen = experts.route(h)
    assert torch.bincount(chosen.reshape(-1)).max() > 1  # some expert serves several rows at once
    return experts(h), torch.cat([experts(h[i:i + 1]) for i in range(rows)])


def test_rows_grouped_by_expert_equal_one_row_at_a_time(family):
    """Packed int8 / int4 experts: bit for bit (the integer kernels give a row the same numbers
    whatever rows run beside it). Float32: a group of more than 8 rows runs torch's GEMM, one row
    numba's GEMV, which round apart."""
    name, d, _, ours = family
    grouped, one = grouped_and_alone(ours)
    assert (grouped - one).abs().max().item() < 1e-5, name
    f32 = hf_logits_of(ours)
    for fmt in ("int8", "int4"):
        packed = load(d, device="cpu", weights=fmt)
        expert = packed.model.layers[0].experts[1]
        assert isinstance(expert.gate_proj, PackedPart) and isinstance(expert.down_proj, PackedWeight)
        assert not isinstance(packed.model.layers[0].router, (PackedPart, PackedWeight))  # routing stays float
        grouped, one = grouped_and_alone(packed)
        assert torch.equal(grouped, one), (name, fmt)
        if fmt == "int8":  # near float32 on the whole (a rare row routed apart moves more; int4's rounding, much)
            assert (hf_logits_of(packed) - f32).abs().mean().item() < 0.05, name


def hf_logits_of(loaded, ids=IDS):
    state = new_state(EngineSpec(), loaded.model.geometries(), loaded.device)
    return prefill(loaded.model, state, ids, 64, all_logits=True)


def test_batched_decode_of_several_sequences(family):
    """Three sequences decoding side by side, rows of a step grouped by expert across them: the ids
    each gives alone, with int8 experts the same logits bit for bit."""
    name, d, _, ours = family
    gen = GenerationConfig(max_tokens=6, stop_at_eos=False)
    jobs = [Job(IDS[i:i + n], gen=gen, key=i) for i, n in ((0, 9), (3, 20), (7, 4))]
    for loaded in (ours, load(d, device="cpu", weights="int8")):
        got = batched(loaded, jobs, parallel=3)
        for job in jobs:
            ids, logits = alone(loaded, job)
            assert got[job.key][0] == ids, (name, loaded.weights, job.key)
            if loaded.weights == "int8":
                assert all(torch.equal(a, b) for a, b in zip(got[job.key][1], logits)), (name, job.key)


# -- GGUF: llama.cpp's layout ----------------------------------------------------------------------

NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def moe_gguf(hf, path, arch: str, experts_as=None):
    """The tiny model as llama.cpp's converter writes it: experts stacked (experts, rows, inputs), the
    router ffn_gate_inp; `experts_as` a GGML type the experts are quantized to (gguf-py), else float32."""
    c, sd = hf.config, {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    header(w, c)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_tensor("token_embd.weight", sd.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", sd.pop("model.norm.weight"))
    head = sd.pop("lm_head.weight")
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", head)
    stacks = {}  # transformers 5 holds a layer's experts fused: gate_up_proj (E, 2I, H), down_proj (E, H, I)
    for name, a in sd.items():
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        if rest.endswith("experts.gate_up_proj"):
            half = a.shape[1] // 2
            stacks[f"blk.{layer}.ffn_gate_exps.weight"], stacks[f"blk.{layer}.ffn_up_exps.weight"] = \
                a[:, :half], a[:, half:]
        elif rest.endswith("experts.down_proj"):
            stacks[f"blk.{layer}.ffn_down_exps.weight"] = a
        elif rest == "mlp.gate.weight":
            w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", a)
        else:
            rest = rest.removesuffix(".weight")
            if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                a = permute(a, c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{NAMES[rest]}.weight", a)
    for name, a in stacks.items():
        a = np.ascontiguousarray(a)
        if experts_as is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, experts_as), raw_dtype=experts_as)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GIDS = [t % 256 for t in IDS[:30]]  # within the GGUF's 260 tokens


@pytest.fixture(scope="module")
def qwen3moe_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3moe")
    hf = make_tiny_family(d / "hf", "qwen3_moe", vocab_size=len(TOKENS), norm_topk_prob=True, mlp_only_layers=[])
    return hf, moe_gguf(hf, d / "tiny.gguf", "qwen3moe")


def test_qwen3moe_gguf_runs_as_transformers(qwen3moe_gguf):
    """Transformers' own GGUF loader reads qwen3moe (every layer sparse, as llama.cpp's are); both
    agree with the model the file was written from."""
    from transformers import AutoModelForCausalLM

    hf, path = qwen3moe_gguf
    loaded = load(path, device="cpu")
    assert loaded.config.model_type == "qwen3_moe" and loaded.config.moe.norm_topk_prob
    assert [loaded.config.is_sparse(i) for i in range(4)] == [True] * 4
    ours = hf_logits_of(loaded, GIDS)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                  config=hf.config).eval()
    assert (ours - hf_logits(theirs, GIDS)).abs().max().item() < 1e-3
    assert (ours - hf_logits(hf, GIDS)).abs().max().item() < 1e-3


def test_mixtral_gguf_runs_as_transformers(tmp_path):
    """llama with expert_count is Mixtral (q/k rows permuted as for llama). Transformers' GGUF loader
    reads such a file as a dense Llama, so the reference is the model the file was written from."""
    hf = make_tiny_family(tmp_path / "hf", "mixtral", vocab_size=len(TOKENS), sliding_window=None)
    loaded = load(moe_gguf(hf, tmp_path / "mixtral.gguf", "llama"), device="cpu")
    assert loaded.config.model_type == "mixtral" and loaded.config.moe.num_experts == 4
    assert (hf_logits_of(loaded, GIDS) - hf_logits(hf, GIDS)).abs().max().item() < 1e-3
    with pytest.raises(LarqlError, match="runs from the GGUF file itself; convert-gguf does not write experts"):
        convert_gguf(loaded.path, tmp_path / "converted")


def test_quantized_experts_run_as_their_own_codes(tmp_path):
    """Q8_0 experts: `native` runs them as 8-bit codes (each expert a view of the 3-D tensor's
    blocks), against the same file dequantized to float32 by gguf-py; grouping stays bit-exact. Layer
    1 has no router: a dense MLP (mlp_only_layers), which the float32 file runs as transformers does."""
    hf = make_tiny_family(tmp_path / "hf", "qwen3_moe", vocab_size=len(TOKENS), norm_topk_prob=True)
    plain = load(moe_gguf(hf, tmp_path / "f32.gguf", "qwen3moe"), device="cpu")
    assert [plain.config.is_sparse(i) for i in range(4)] == [True, False, True, True]
    shown = describe(plain.path)
    assert shown["experts"] == "8 of width 32, top 3 renormalized, on 3 of 4 layers"
    assert shown["parameters"] == sum(p.numel() for p in hf.parameters()) and not shown["unused_tensors"]
    assert (hf_logits_of(plain, GIDS) - hf_logits(hf, GIDS)).abs().max().item() < 1e-3
    path = moe_gguf(hf, tmp_path / "q8.gguf", "qwen3moe", experts_as=gguf.GGMLQuantizationType.Q8_0)
    native, f32 = load(path, device="cpu"), load(path, device="cpu", weights="f32")
    assert native.weights == "native"
    expert = native.model.layers[2].experts[5]
    assert expert.gate_proj.whole.kind == "u8" and expert.down_proj.kind == "u8"
    assert (hf_logits_of(native, GIDS) - hf_logits_of(f32, GIDS)).abs().max().item() < 0.05
    grouped, one = grouped_and_alone(native)
    assert torch.equal(grouped, one)


def test_expert_configs_are_read_and_refused_in_one_line():
    base = {"model_type": "qwen3_moe", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 1, "vocab_size": 8, "num_experts": 4, "moe_intermediate_size": 4}
    cfg = config_from_dict({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [cfg.is_sparse(i) for i in range(4)] == [False, True, False, False]
    assert config_from_dict({**base, "num_experts": 0}).moe is None  # every layer dense
    with pytest.raises(LarqlError, match="num_experts_per_tok is 5, above the 4 experts"):
        config_from_dict({**base, "num_experts_per_tok": 5})
    with pytest.raises(LarqlError, match="missing or invalid moe_intermediate_size"):
        config_from_dict({**base, "moe_intermediate_size": None})
    mixtral = {**base, "model_type": "mixtral", "num_local_experts": 8}
    assert config_from_dict(mixtral).moe.sparse == (True,) * 4 and config_from_dict(mixtral).windows == (None,) * 4
