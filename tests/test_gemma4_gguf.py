"""Gemma 4 as GGUF files (`gemma4`) laid out as llama.cpp's converter writes them -- gains as
themselves, K/V shared by the last layers with the MLP widths one a layer, one KV head count a
layer, K as V, the proportional RoPE as rope_freqs, the per-layer inputs' tensors, experts with a
fused gate|up, Gemma 4's BPE with the tokenizer's merges -- from tests/test_gemma4.py's tiny random
checkpoints: transformers' logits and greedy ids from float32 files, from a Q8_0 file on its own codes;
headers that break the layout refused in one line. And the per-layer inputs packed under int8 / int4."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import tokenizers
import torch

from larqlpy.config import GenerationConfig
from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.qweight import PackedWeight
from larqlpy.tools.quality import score_text
from larqlpy.weights.loader import load
from hf_compare import hf_generate, logit_gaps
from test_batched import Job, alone
from test_gemma4 import VARIANTS, make
from test_gguf_archs import finish
from test_moe import IDS

Q8 = gguf.GGMLQuantizationType.Q8_0
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "pre_feedforward_layernorm_2": "pre_ffw_norm_2", "post_feedforward_layernorm_1": "post_ffw_norm_1",
         "post_feedforward_layernorm_2": "post_ffw_norm_2", "post_per_layer_input_norm": "post_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj", "router.proj": "ffn_gate_inp",
         "experts.gate_up_proj": "ffn_gate_up_exps", "experts.down_proj": "ffn_down_exps",
         "layer_scalar": "layer_output_scale", "router.scale": "ffn_gate_inp.scale",
         "router.per_expert_scale": "ffn_down_exps.scale"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
       "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
       "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}


def width(c, kind: str = "full_attention") -> int:
    """A layer kind's head width (transformers keeps it in the per-layer config only)."""
    return next(c.per_layer_config[i].head_dim for i, t in enumerate(c.layer_types) if t == kind)


def header(w: gguf.GGUFWriter, c) -> None:
    """The metadata llama.cpp's Gemma4Model writes for transformers config `c`."""
    n, shared, wide = c.num_hidden_layers, c.num_kv_shared_layers, width(c)
    swa = [t == "sliding_attention" for t in c.layer_types]
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length([c.intermediate_size * (2 if i >= n - shared else 1) for i in range(n)]
                              if c.use_double_wide_mlp else c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.per_layer_config[i].num_key_value_heads for i in range(n)])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(wide)
    w.add_value_length(wide)
    w.add_key_length_swa(width(c, "sliding_attention"))
    w.add_value_length_swa(width(c, "sliding_attention"))
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(wide)
    w.add_rope_dimension_count_swa(width(c, "sliding_attention"))
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(c.hidden_size_per_layer_input or 0)
    w.add_sliding_window_pattern(swa)
    if c.enable_moe_block:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k_experts)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)


def vocabulary(w: gguf.GGUFWriter, tokenizer_json) -> None:
    """The checkpoint's tokenizer as the converter writes it (tokenizer.ggml.model gemma4): tokens in id
    order, specials as control tokens, <0xXX> as byte tokens, the merges."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in data["added_tokens"]}
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([3 if t in specials else 6 if t.startswith("<0x") else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]])
    for add, i in ((w.add_bos_token_id, 2), (w.add_eos_token_id, 1), (w.add_pad_token_id, 0), (w.add_unk_token_id, 3)):
        add(i)
    w.add_add_bos_token(True)


def stored(t: torch.Tensor, quantized: bool) -> dict:
    """add_tensor's arguments: float32, or Q8_0 where `quantized` and its rows split into blocks of 32 (the
    model then holds the values Q8_0 keeps, as transformers' reference)."""
    a = t.detach().float().numpy()
    if not quantized or a.ndim < 2 or a.shape[-1] % 32:
        return {"tensor": a}
    q = gguf.quants.quantize(a, Q8)
    t.copy_(torch.from_numpy(gguf.quants.dequantize(q, Q8).reshape(a.shape)))
    return {"tensor": q, "raw_dtype": Q8}


def write_gguf(hf, home, path, quantized: bool = False, keys: dict | None = None, freqs=None):
    """The model as a gemma4 GGUF; keys: metadata written over the converter's (the hostile headers);
    freqs: rope_freqs.weight in place of the converter's."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "gemma4")
    header(w, c)
    vocabulary(w, home / "tokenizer.json")
    for key, v in (keys or {}).items():
        w.add_array(key, v) if isinstance(v, list) else w.add_uint32(key, v)
    with torch.no_grad():
        for name, t in hf.state_dict().items():
            if name == "lm_head.weight":  # tied: the converter skips it
                continue
            parts = name.split(".")
            rest = ".".join(parts[3:]).removesuffix(".weight")
            out = TOP.get(name) or f"blk.{parts[2]}.{BLOCK[rest]}" + ("" if "." in BLOCK[rest] else ".weight")
            w.add_tensor(out, **stored(t, quantized))
    wide = width(c)
    turned = int(wide * c.rope_parameters["full_attention"]["partial_rotary_factor"]) // 2
    w.add_tensor("rope_freqs.weight", freqs if freqs is not None else
                 np.array([1.0] * turned + [1e30] * (wide // 2 - turned), np.float32))
    return finish(w, path)


@pytest.fixture(scope="module", params=list(VARIANTS))
def f32_file(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"g4gguf-{request.param}")
    hf = make(d / "hf", *VARIANTS[request.param])
    return request.param, hf, write_gguf(hf, d / "hf", d / "tiny.gguf")


def test_a_float32_file_gives_transformers_logits_and_greedy_ids(f32_file):
    name, hf, path = f32_file
    ours = load(path, device="cpu", weights="f32")
    assert ours.config.model_type == "gemma4_text"
    assert max(logit_gaps(ours, hf, IDS)) < 1e-3, name
    gen = GenerationConfig(max_tokens=10, stop_at_eos=False)
    assert alone(ours, Job(IDS[:12], gen=gen))[0] == hf_generate(hf, IDS[:12], 10), name


@pytest.mark.parametrize("f32_file", ["plain"], indirect=True)
def test_the_files_bpe_splits_text_as_the_checkpoints_tokenizer(f32_file):
    _, _, path = f32_file
    theirs = tokenizers.Tokenizer.from_file(str(path.parent / "hf" / "tokenizer.json"))
    tok = load(path, device="cpu").tokenizer
    for text in ("the cat sat on the mat", "then there, inner", "zebra<end_of_turn>héé"):
        assert tok.encode(text) == theirs.encode(text).ids, text


def test_a_q8_0_file_runs_on_its_own_codes_per_layer_inputs_included(tmp_path):
    hf = make(tmp_path / "hf", *VARIANTS["shared"])
    path = write_gguf(hf, tmp_path / "hf", tmp_path / "q8.gguf", quantized=True)
    f32 = load(path, device="cpu", weights="f32")  # dequantized by gguf-py
    assert max(logit_gaps(f32, hf, IDS)) < 1e-3
    native = load(path, device="cpu")
    m = native.model
    assert native.weights == "native" and not isinstance(m.embed_tokens_per_layer, torch.Tensor)
    assert all(isinstance(w, PackedWeight) for w in (m.per_layer_model_projection, m.layers[0].per_layer_input_gate,
                                                     m.layers[0].per_layer_projection))
    # int8 activations on Q8_0 codes: as near as `int8` packing comes (this tiny model's KL, below)
    assert score_text(f32.model, native.model, IDS, chunk=25).mean_kl < 0.03


BAD = [({"gemma4.attention.sliding_window_pattern": [True, False]}, "sliding_window_pattern"),
       ({"gemma4.attention.head_count_kv": [2, 2, 2]}, "head_count_kv holds 3 values for 6 layers"),
       ({"gemma4.feed_forward_length": [96, 192, 96, 96, 96, 96]}, "feed_forward_length"),
       ({"gemma4.attention.value_length_swa": 4}, "value_length_swa is 4"),
       ({"gemma4.rope.dimension_count_swa": 4}, "dimension_count_swa is 4"),
       ({"gemma4.attention.shared_kv_layers": 6}, "shared_kv_layers is 6"),
       ({"tokenizer.ggml.merges": ["a zz"]}, "tokenizer.ggml.merges[0]")]


@pytest.mark.parametrize("keys, needle", BAD + [(None, "rope_freqs.weight")])
def test_a_header_that_breaks_the_layout_is_refused_in_one_line(tmp_path, keys, needle):
    hf = make(tmp_path / "hf", *VARIANTS["plain"])
    freqs = np.full(4, 2.0, np.float32) if keys is None else None
    path = write_gguf(hf, tmp_path / "hf", tmp_path / "bad.gguf", keys=keys, freqs=freqs)
    with pytest.raises(LarqlError) as e:
        load(path, device="cpu")
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("g4-shared")
    make(d, *VARIANTS["shared"])
    return d


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_per_layer_inputs_pack_under_int8_and_int4(shared_dir, fmt):
    """The table (read by rows from its codes, as the embedding is) and the three projections pack with
    the other matrices: held at their packed size, counted so in weight_bytes; logits near float's. (This
    tiny random model's KL is high whatever packs: 0.0105 int8 and 0.190 int4 with the per-layer inputs
    float, 0.0112 and 0.191 with them packed.)"""
    ref, low = load(shared_dir, device="cpu"), load(shared_dir, device="cpu", weights=fmt)
    m = low.model
    ple = [m.embed_tokens_per_layer, m.per_layer_model_projection] + \
        [getattr(b, n) for b in m.layers for n in ("per_layer_input_gate", "per_layer_projection")]
    assert all(isinstance(w, PackedWeight) for w in ple)
    held = {id(w) for w in low.held_weights()}
    assert all(id(w) in held for w in ple)
    rows, cols = ref.model.embed_tokens_per_layer.shape  # codes and a scale (int4: and a minimum) a group of 32
    assert m.embed_tokens_per_layer.nbytes <= rows * cols * {"int8": 1 + 2 / 32, "int4": 0.5 + 4 / 32}[fmt] * 1.1
    ids = [2] + [7 + (i * 37) % 280 for i in range(60)]
    assert score_text(ref.model, low.model, ids, chunk=25).mean_kl < {"int8": 0.03, "int4": 0.4}[fmt]
