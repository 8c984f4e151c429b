"""GGUF architectures beside the reference three: Qwen3 (qwen3: q/k head norms) and Llama 3.1/3.2's RoPE
scaling carried as the tensor rope_freqs.weight. Each file is written here with gguf-py from a tiny
random transformers model, as llama.cpp's converter lays it out (llama's q/k rows permuted, rope_freqs
from the llama3 parameters), and runs to transformers' logits on that model."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from larqlpy.engines import build_provider, parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.qweight import PackedWeight
from larqlpy.model.decoder import prefill
from larqlpy.weights.gguf_archs import llama3_rope
from larqlpy.weights.gguf_tokenizer import byte_spelling
from larqlpy.weights.loader import load
from test_cli import assert_refused
from tiny import make_tiny_family

TOKENS = list(byte_spelling().values()) + ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for its RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_freqs(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter writes for a llama3 rope_scaling."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def header(w: gguf.GGUFWriter, c) -> None:
    """A tiny model's sizes (transformers config `c`) and the small byte-level vocabulary."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    vocabulary(w)


def finish(w: gguf.GGUFWriter, path: Path) -> Path:
    """Write out what `w` holds to its file, `path`."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def vocabulary(w: gguf.GGUFWriter) -> None:
    """The small byte-level vocabulary, TOKENS, with its merge and ids."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * 257 + [3] * 3)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(259)


def as_type(a: np.ndarray, matrices: str) -> dict:
    """add_tensor's arguments for a tensor written as F32, or (a matrix) as F16 or BF16."""
    if a.ndim != 2 or matrices == "F32":
        return {"tensor": a}
    qtype = gguf.GGMLQuantizationType[matrices]
    return {"tensor": gguf.quants.quantize(a, qtype), "raw_dtype": qtype}


def to_gguf(hf, path: Path, arch: str, freqs: np.ndarray | None = None, matrices: str = "F32") -> Path:
    """matrices: the type 2-D tensors are written as (F32, F16, BF16); norms stay F32, as llama.cpp's."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    header(w, c)
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if a.ndim == 2 and matrices != "F32":
            a = gguf.quants.dequantize(gguf.quants.quantize(a, gguf.GGMLQuantizationType[matrices]),
                                       gguf.GGMLQuantizationType[matrices]).reshape(a.shape)
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", **as_type(a, matrices))
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        elif name == "lm_head.weight":
            if not c.tie_word_embeddings:
                w.add_tensor("output.weight", **as_type(a, matrices))
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            if arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
                a = permute(a, c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{NAMES[rest]}.weight", **as_type(a, matrices))
    if freqs is not None:
        w.add_tensor("rope_freqs.weight", freqs)
    return finish(w, path)


def same_logits(path: Path, hf) -> None:
    ids = list(np.random.default_rng(0).integers(0, 256, 40))
    loaded = load(path, device="cpu", weights="f32")
    state = build_provider(parse_engine_spec()).new_state(loaded.model.geometries(), loaded.device)
    ours = prefill(loaded.model, state, ids, 64)[-1]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(ours.float(), theirs, atol=2e-4, rtol=2e-4)


def packed_kinds(model) -> set[str]:
    """The kinds of the packed matrices a loaded model runs on."""
    found = set()
    for m in model.modules():
        for v in vars(m).values():
            whole = getattr(v, "whole", v)
            if isinstance(whole, PackedWeight):
                found.add(whole.kind)
    return found


@pytest.mark.parametrize("matrices,kind", [("F16", "f16"), ("BF16", "bf16")])
def test_f16_and_bf16_matrices_run_on_their_own_bits(tmp_path, matrices, kind):
    """A GGUF whose matrices are F16 or BF16 runs them at 16 bits (no float32 copy, no fallback):
    embedding rows are the file's values bit for bit; a BF16 file's logits are `weights="bf16"`'s to
    the bit (the same kernels on the same values); both stay within what the packed float kernels
    differ from torch's float32 by on this tiny model (9e-4), llama's permuted q/k included."""
    hf = make_tiny_family(tmp_path / "hf", "llama", vocab_size=len(TOKENS), tie_word_embeddings=False)
    path = to_gguf(hf, tmp_path / f"{kind}.gguf", "llama", matrices=matrices)
    formats = ("native", "f32", "bf16") if kind == "bf16" else ("native", "f32")
    models = {f: load(path, device="cpu", weights=f) for f in formats}
    assert models["native"].float_fallback is None and packed_kinds(models["native"].model) == {kind}
    ids = list(np.random.default_rng(1).integers(0, 256, 24))
    rows = models["native"].model.embed_tokens.rows(torch.tensor(ids))
    assert torch.equal(rows.view(torch.int32), models["f32"].model.embed_tokens[ids].view(torch.int32))
    logits = {}
    for f, loaded in models.items():
        state = build_provider(parse_engine_spec()).new_state(loaded.model.geometries(), loaded.device)
        logits[f] = prefill(loaded.model, state, ids, 64, all_logits=True)
    torch.testing.assert_close(logits["native"], logits["f32"], atol=2e-3, rtol=0)
    assert torch.equal(logits["native"].argmax(-1), logits["f32"].argmax(-1))
    assert kind == "f16" or torch.equal(logits["native"], logits["bf16"])


def test_qwen3_gguf_runs_as_transformers(tmp_path):
    hf = make_tiny_family(tmp_path / "hf", "qwen3", vocab_size=len(TOKENS))
    same_logits(to_gguf(hf, tmp_path / "qwen3.gguf", "qwen3"), hf)


LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_llama3_rope_scaling_from_rope_freqs_runs_as_transformers(tmp_path):
    hf = make_tiny_family(tmp_path / "hf", "llama-llama3-rope", vocab_size=len(TOKENS), rope_parameters=LLAMA31)
    freqs = rope_freqs(LLAMA31, LLAMA31["rope_theta"], hf.config.head_dim)
    assert freqs[0] == 1 and 1 < freqs[1] < 8 and freqs[-1] == 8  # kept, ramped and divided frequencies
    same_logits(to_gguf(hf, tmp_path / "llama31.gguf", "llama", freqs), hf)


def test_rope_freqs_of_another_form_are_refused(tmp_path, cli, capsys):
    hf = make_tiny_family(tmp_path / "hf", "llama-llama3-rope", vocab_size=len(TOKENS))
    freqs = rope_freqs(hf.config.rope_parameters, hf.config.rope_parameters["rope_theta"], hf.config.head_dim)
    bad = to_gguf(hf, tmp_path / "bad.gguf", "llama", freqs[::-1].copy())
    capsys.readouterr()  # transformers' progress bar as it saved the model
    assert_refused(cli("run", bad, "Hi", "-n", "1"), "rope_freqs.weight", "not Llama 3's RoPE scaling")
    with pytest.raises(LarqlError, match="rope_freqs"):
        load(bad, device="cpu")
    got = llama3_rope(freqs, 500000.0, 16)
    assert got["factor"] == 8.0 and got["high_freq_factor"] == 4.0
    assert llama3_rope(np.ones(3), 500000.0, 16) is None
