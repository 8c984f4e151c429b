"""DeepSeek-V2 / V3 as `deepseek2` GGUF files, written here with gguf-py from test_deepseek.py's tiny
random checkpoints the way llama.cpp's converter writes them (from the saved safetensors: experts
stacked into 3-D tensors, the correction bias renamed exp_probs_b, no rows permuted, YaRN's mscale
as 0.1 x mscale_all_dim; kv_b_proj whole as older converters wrote it, or split per head into
attn_k_b / attn_v_b with the `_mla` sizes as newer ones do). Read by larqlpy they give transformers'
logits and greedy ids; Q8_0 matrices run on their own codes near the same file dequantized; bad
headers are refused in one line; and where llama-cpp-python is installed, llama.cpp's greedy ids on
the same file are transformers' too."""

from __future__ import annotations

from dataclasses import replace
from importlib.util import find_spec

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from larqlpy.errors import LarqlError
from larqlpy.model.families import read_config
from larqlpy.weights.loader import load
from hf_compare import greedy_ours, hf_generate, hf_logits, our_logits
from test_deepseek import make
from test_gguf_archs import TOKENS, finish, packed_kinds, vocabulary
from test_gguf_quants import llama_cpp_greedy

Q8 = gguf.GGMLQuantizationType.Q8_0
IDS = [257] + [(7 + 37 * i) % 256 for i in range(30)]  # within the file's 260 tokens
# v2 as older converters wrote it (attn_kv_b, per-head sizes under key_length); the others split
SPLIT = {"v2": False, "v2-lora": True, "v3": True}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
         "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
         "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp"}
KINDS = {int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32, bool: gguf.GGUFValueType.BOOL,
         str: gguf.GGUFValueType.STRING}


def header(c, split: bool) -> dict:
    """The deepseek2.* keys the converter writes for config `c`."""
    v3, rope, nope, r = c.model_type == "deepseek_v3", c.qk_rope_head_dim, c.qk_nope_head_dim, c.kv_lora_rank
    p = c.rope_parameters
    m = {"block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
         "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
         "attention.head_count": c.num_attention_heads, "attention.head_count_kv": 1,
         "rope.freq_base": float(p["rope_theta"]), "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
         "vocab_size": c.vocab_size, "leading_dense_block_count": c.first_k_dense_replace,
         "attention.kv_lora_rank": r, "expert_feed_forward_length": c.moe_intermediate_size,
         "expert_count": c.n_routed_experts, "expert_used_count": c.num_experts_per_tok,
         "expert_shared_count": c.n_shared_experts, "expert_weights_scale": float(c.routed_scaling_factor),
         "expert_gating_func": 2 if v3 else 1, "rope.dimension_count": rope}
    if c.q_lora_rank:
        m["attention.q_lora_rank"] = c.q_lora_rank
    if v3 and c.norm_topk_prob:
        m["expert_weights_norm"] = True
    if c.n_group:
        m.update({"expert_group_count": c.n_group, "expert_group_used_count": c.topk_group})
    if split:
        m.update({"attention.key_length": r + rope, "attention.value_length": r,
                  "attention.key_length_mla": nope + rope, "attention.value_length_mla": c.v_head_dim})
    else:
        m.update({"attention.key_length": nope + rope, "attention.value_length": c.v_head_dim})
    if p.get("rope_type") == "yarn":
        m.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(p["factor"]),
                  "rope.scaling.original_context_length": p["original_max_position_embeddings"],
                  "rope.scaling.yarn_log_multiplier": 0.1 * p["mscale_all_dim"]})
    return m


def gguf_tensors(weights: dict, c, split: bool):
    """(GGUF name, array) as the converter renames, stacks and splits the checkpoint's tensors."""
    experts: dict = {}
    heads, nope = c.num_attention_heads, c.qk_nope_head_dim
    for name, a in weights.items():
        a = a.astype(np.float32)
        if name in TOP:
            yield TOP[name], a
            continue
        parts = name.split(".")
        i, rest, what = parts[2], ".".join(parts[3:-1]), parts[-1]
        if ".experts." in name:  # model.layers.i.mlp.experts.j.gate_proj.weight
            experts.setdefault((i, parts[-2]), {})[int(parts[5])] = a
        elif what == "e_score_correction_bias":
            yield f"blk.{i}.exp_probs_b.bias", a
        elif rest == "self_attn.kv_b_proj" and split:  # per head: W_UK transposed, W_UV
            kv = a.reshape(heads, nope + c.v_head_dim, -1)
            yield f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(kv[:, :nope].transpose(0, 2, 1))
            yield f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv[:, nope:])
        else:
            yield f"blk.{i}.{BLOCK[rest]}.{what}", a
    for (i, which), by in experts.items():
        yield f"blk.{i}.ffn_{which.removesuffix('_proj')}_exps.weight", np.stack([by[j] for j in sorted(by)])


def write_gguf(model, path, qtype=None, **changes):
    """`model` (the fixture's dir, transformers model, split) as a deepseek2 GGUF at `path`; qtype:
    matrices whose rows fit its blocks written as it (the router stays F32, as the converter keeps
    it); changes: header keys set, or dropped where None."""
    src, hf, split = model
    meta = {**header(hf.config, split), **changes}
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, v in meta.items():
        if v is not None:
            w.add_key_value(f"deepseek2.{key}", v, KINDS[type(v)])
    vocabulary(w)
    for name, a in gguf_tensors(load_file(src / "model.safetensors"), hf.config, split):
        if qtype is not None and a.ndim > 1 and a.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)
    return finish(w, path)


@pytest.fixture(scope="module", params=list(SPLIT))
def model(request, tmp_path_factory):
    """(name, (its dir, the transformers model, whether its file splits kv_b)): a vocabulary of the
    file's 260 tokens; V3 with DeepSeek's interleaved RoPE, which llama.cpp runs on every deepseek2 file."""
    d = tmp_path_factory.mktemp(request.param)
    changes = {"vocab_size": len(TOKENS)} | ({"rope_interleave": True} if request.param == "v3" else {})
    return request.param, (d, make(d, request.param, seed=len(request.param), **changes), SPLIT[request.param])


def test_f32_file_runs_as_transformers(model, tmp_path):
    """The config read from the header is the checkpoint's (routing, groups, scale, renormalization,
    YaRN and its mscale, the latent sizes); logits within 1e-3 of transformers', greedy ids equal."""
    name, m = model
    path = write_gguf(m, tmp_path / f"{name}.gguf")
    src, hf, split = m
    loaded, ref = load(path, device="cpu", kv_dtype="f32"), read_config(src)  # native, rows exact
    c = loaded.config
    assert (c.model_type, c.moe, c.rope_global) == (ref.model_type, ref.moe, ref.rope_global), name
    assert c.mla == replace(ref.mla, kv_b_split=split) and c.attention_scale == pytest.approx(ref.attention_scale)
    assert (our_logits(loaded, IDS, 16) - hf_logits(hf, IDS)).abs().max().item() < 1e-3, name
    want = hf_generate(hf, IDS[:12], 8)
    assert greedy_ours(loaded, IDS[:12], 8) == want, name
    # llama.cpp 0.3.16 predates expert groups and reads q_lora_rank on any V2 but the Lite: v2-lora alone
    if name == "v2-lora" and find_spec("llama_cpp") is not None:
        from llama_cpp import Llama

        llm = Llama(model_path=str(path), n_ctx=64, n_threads=2, n_threads_batch=2, verbose=False)
        assert llama_cpp_greedy(llm, IDS[:12], 8) == want


def test_q8_0_matrices_run_on_their_own_codes(model, tmp_path):
    """Q8_0 matrices (where rows fit 32-value blocks) run as 8-bit codes near the file dequantized."""
    name, m = model
    if name != "v2":
        pytest.skip("one model is enough: v2's 64-wide rows fit Q8_0's blocks")
    path = write_gguf(m, tmp_path / "q8.gguf", Q8)
    native, f32 = load(path, device="cpu"), load(path, device="cpu", weights="f32")
    assert native.weights == "native" and packed_kinds(native.model) == {"u8"}
    # int8 activations against float32 (measured max 0.048, mean 0.0085, logits ~0.5 on average), and Q8_0's
    # own rounding against the float model (0.070, 0.010): wrong codes would miss by the logits' size
    want, f32_logits = hf_logits(m[1], IDS), our_logits(f32, IDS)
    for gap in ((our_logits(native, IDS) - f32_logits).abs(), (f32_logits - want).abs()):
        assert 0 < gap.max().item() < 0.15 and gap.mean().item() < 0.02


@pytest.mark.parametrize("changes, words", [
    ({"attention.kv_lora_rank": None}, "kv_lora_rank is missing"),
    ({"rope.dimension_count": 7}, "rope.dimension_count is 7: expected an even number"),
    ({"expert_group_count": 3}, "expert_group_count is 3: it must divide"),
    ({"expert_gating_func": 5}, "expert_gating_func is 5: expected 1 to 2"),
    ({"expert_weights_norm": True}, "expert_weights_norm is true with softmax gating"),
    ({"rope.scaling.original_context_length": None}, "original_context_length is missing"),
    ({"nextn_predict_layers": 1}, "nextn_predict_layers is 1: expected 0 to 0"),
])
def test_bad_headers_are_refused_in_one_line(model, tmp_path, changes, words):
    name, m = model
    if name != "v2":
        pytest.skip("v2's header (YaRN, groups) is enough")
    with pytest.raises(LarqlError, match=words) as e:
        load(write_gguf(m, tmp_path / "bad.gguf", **changes), device="cpu")
    assert "\n" not in str(e.value)

