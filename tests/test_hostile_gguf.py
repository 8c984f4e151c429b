"""Hostile GGUF headers (weights/gguf_check.py): each inconsistency a probe found is refused in one
line naming its key and value -- by `run`, `info` and `convert-gguf` (exit 2, no traceback) and by
the Python API (LarqlError) -- before anything is built from the header. Each file is a one-layer
Qwen2 of float32 tensors written with gguf-py's own writer, which loads and runs as it is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from larqlpy.convert.gguf import convert_gguf
from larqlpy.errors import LarqlError
from larqlpy.weights.gguf_tokenizer import byte_spelling
from larqlpy.weights.info import describe
from larqlpy.weights.loader import load
from test_cli import assert_refused

HIDDEN, HEADS, KV_HEADS, FFN = 32, 4, 2, 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def tiny_spec(arch: str = "qwen2") -> tuple[dict, dict]:
    """(metadata, tensors) of a one-layer model: a byte-level vocabulary of GPT-2's 256 bytes, three
    merges and three control tokens; q/k/v biases, as Qwen2 has."""
    tokens = list(byte_spelling().values()) + ["Ġt", "he", "Ġthe"] + SPECIALS
    a = arch + "."
    meta = {a + "block_count": 1, a + "context_length": 256, a + "embedding_length": HIDDEN,
            a + "feed_forward_length": FFN, a + "attention.head_count": HEADS,
            a + "attention.head_count_kv": KV_HEADS, a + "rope.freq_base": 10000.0,
            a + "attention.layer_norm_rms_epsilon": 1e-6,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1] * (len(tokens) - 3) + [3] * 3, "tokenizer.ggml.merges": MERGES,
            "tokenizer.ggml.bos_token_id": len(tokens) - 3, "tokenizer.ggml.eos_token_id": len(tokens) - 1,
            "tokenizer.ggml.padding_token_id": len(tokens) - 3, "tokenizer.ggml.add_bos_token": False}
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    head = HIDDEN // HEADS
    tensors = {"token_embd.weight": w(len(tokens), HIDDEN), "output_norm.weight": 1 + w(HIDDEN),
               "blk.0.attn_norm.weight": 1 + w(HIDDEN), "blk.0.ffn_norm.weight": 1 + w(HIDDEN),
               "blk.0.attn_q.weight": w(HIDDEN, HIDDEN), "blk.0.attn_q.bias": w(HIDDEN),
               "blk.0.attn_k.weight": w(KV_HEADS * head, HIDDEN), "blk.0.attn_k.bias": w(KV_HEADS * head),
               "blk.0.attn_v.weight": w(KV_HEADS * head, HIDDEN), "blk.0.attn_v.bias": w(KV_HEADS * head),
               "blk.0.attn_output.weight": w(HIDDEN, HIDDEN), "blk.0.ffn_gate.weight": w(FFN, HIDDEN),
               "blk.0.ffn_up.weight": w(FFN, HIDDEN), "blk.0.ffn_down.weight": w(HIDDEN, FFN)}
    return meta, tensors


def write_gguf(path: Path, meta: dict, tensors: dict, arch: str = "qwen2") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, v in meta.items():
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, v)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


OFFSET, TYPE = 5, 4  # a tensor's entry in the table: name length, name, dims count, dims, type, data offset


def patch_tensor(path: Path, name: str, part: int, to) -> None:
    """Rewrite a part of a tensor's entry in the file's tensor table (to: old value -> new)."""
    reader = gguf.GGUFReader(str(path), "r+")
    value = next(t.field.parts[part] for t in reader.tensors if t.name == name)
    value[0] = to(int(value[0]))
    reader.data.flush()


def edit(**changes):
    """A change of the tiny spec's metadata: key=value sets (dots spelled __), key=None removes."""
    def apply(meta: dict, tensors: dict) -> None:
        for key, v in changes.items():
            key = key.replace("__", ".")
            if v is None:
                meta.pop(key)
            else:
                meta[key] = v(meta[key]) if callable(v) else v
    return apply


VOCAB = 256 + 3 + 3
CASES = {  # name: (change, what the one line must name)
    "token_type short": (edit(tokenizer__ggml__token_type=lambda t: t[:-1]), ["tokenizer.ggml.token_type", "261"]),
    "token_type long": (edit(tokenizer__ggml__token_type=lambda t: t + [1]), ["tokenizer.ggml.token_type", "263"]),
    "scores short": (edit(tokenizer__ggml__scores=[0.0] * (VOCAB - 1)), ["tokenizer.ggml.scores", "261"]),
    "bos outside": (edit(tokenizer__ggml__bos_token_id=VOCAB), ["tokenizer.ggml.bos_token_id", str(VOCAB)]),
    "eos outside": (edit(tokenizer__ggml__eos_token_id=10**6), ["tokenizer.ggml.eos_token_id", "1000000"]),
    "unknown outside": (edit(tokenizer__ggml__unknown_token_id=VOCAB + 5),
                        ["tokenizer.ggml.unknown_token_id", str(VOCAB + 5)]),
    "padding outside": (edit(tokenizer__ggml__padding_token_id=VOCAB), ["tokenizer.ggml.padding_token_id"]),
    "no heads": (edit(qwen2__attention__head_count=0), ["qwen2.attention.head_count is 0"]),
    "kv heads do not divide": (edit(qwen2__attention__head_count_kv=3), ["qwen2.attention.head_count_kv is 3"]),
    "heads do not divide the width": (edit(qwen2__attention__head_count=3, qwen2__attention__head_count_kv=1),
                                      ["qwen2.attention.head_count is 3", "qwen2.embedding_length"]),
    "no width": (edit(qwen2__embedding_length=None), ["qwen2.embedding_length is missing"]),
    "no FFN": (edit(qwen2__feed_forward_length=None), ["qwen2.feed_forward_length is missing"]),
    "width as text": (edit(qwen2__embedding_length="32"), ["qwen2.embedding_length is '32'"]),
    "no blocks": (edit(qwen2__block_count=0), ["qwen2.block_count is 0"]),
    "4e9 blocks": (edit(qwen2__block_count=4_000_000_000), ["qwen2.block_count is 4000000000", "14 tensors"]),
    "absurd width": (edit(qwen2__embedding_length=1 << 20), ["qwen2.embedding_length is 1048576"]),
    "no FFN width": (edit(qwen2__feed_forward_length=0), ["qwen2.feed_forward_length is 0"]),
    "no context": (edit(qwen2__context_length=0), ["qwen2.context_length is 0"]),
    "absurd context": (edit(qwen2__context_length=1 << 30), ["qwen2.context_length is 1073741824"]),
    "vocab below the tokens": (edit(qwen2__vocab_size=100), ["qwen2.vocab_size is 100"]),
    "absurd vocab": (edit(qwen2__vocab_size=1 << 30), ["qwen2.vocab_size is 1073741824"]),
    "negative RoPE base": (edit(qwen2__rope__freq_base=-1.0), ["qwen2.rope.freq_base is -1.0"]),
    "merge outside the vocabulary": (edit(tokenizer__ggml__merges=MERGES + ["Ġ zz"]),
                                     ["tokenizer.ggml.merges[3]", "'zz'"]),
    "merge without a space": (edit(tokenizer__ggml__merges=MERGES + ["Ġt"]), ["tokenizer.ggml.merges[3]", "'Ġt'"]),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    out = {"good": write_gguf(d / "good.gguf", *tiny_spec())}
    for name, (change, _) in CASES.items():
        meta, tensors = tiny_spec()
        change(meta, tensors)
        out[name] = write_gguf(d / f"{name.replace(' ', '-')}.gguf", meta, tensors)
    out["misaligned"] = write_gguf(d / "misaligned.gguf", *tiny_spec())
    patch_tensor(out["misaligned"], "output_norm.weight", OFFSET, lambda at: at + 4)  # 4-byte aligned, not 32
    out["past the end"] = write_gguf(d / "past-the-end.gguf", *tiny_spec())
    patch_tensor(out["past the end"], "blk.0.ffn_down.weight", OFFSET, lambda at: at + (1 << 20))
    out["unknown type"] = write_gguf(d / "unknown-type.gguf", *tiny_spec())
    patch_tensor(out["unknown type"], "blk.0.ffn_up.weight", TYPE, lambda t: 200)
    meta, tensors = tiny_spec("llama")  # a Qwen2 relabelled: its q/k/v biases would be ignored
    out["relabelled"] = write_gguf(d / "relabelled.gguf", meta, tensors, arch="llama")
    return out


NEEDLES = {**{name: needles for name, (_, needles) in CASES.items()},
           "misaligned": ["tensor output_norm.weight", "general.alignment (32)"],
           "past the end": ["tensor blk.0.ffn_down.weight", "past the end of the file"],
           "unknown type": ["tensor blk.0.ffn_up.weight", "type 200"],
           "relabelled": ["3 tensors", "blk.0.attn_k.bias", "'llama'", "--allow-unused-tensors"]}


def test_the_tiny_file_loads_and_runs_as_it_is(files, cli, tmp_path):
    """What each hostile file changes is all that is wrong with it: unchanged, it runs, and its
    control tokens are special (what a token_type list zipped short would lose)."""
    m = load(files["good"], device="cpu")
    assert m.config.num_hidden_layers == 1 and m.config.vocab_size == VOCAB
    assert m.tokenizer.encode("<|im_start|> the", add_bos=False) == [VOCAB - 2, VOCAB - 4]
    rc, out, err = cli("run", files["good"], "the", "-n", "2", "--json")
    assert rc == 0, err
    rc, out, err = cli("convert-gguf", files["good"], tmp_path / "converted")
    assert rc == 0 and (tmp_path / "converted" / "model.safetensors").is_file(), err


@pytest.mark.parametrize("name", list(NEEDLES))
def test_a_hostile_header_is_refused_in_one_line(files, name):
    with pytest.raises(LarqlError) as e:
        load(files[name], device="cpu")
    assert "\n" not in str(e.value)
    for needle in NEEDLES[name]:
        assert needle.replace("--allow-unused-tensors", "`allow_unused_tensors`") in str(e.value), str(e.value)
    assert not (files[name].parent / (files[name].name + ".larqlpy")).exists() or name == "relabelled"


@pytest.mark.parametrize("command", ["run", "info", "convert-gguf"])
@pytest.mark.parametrize("name", [n for n in NEEDLES if n != "relabelled"])
def test_every_command_refuses_it_alike(files, cli, tmp_path, name, command):
    args = {"run": ["run", files[name], "the", "-n", "1"], "info": ["info", files[name]],
            "convert-gguf": ["convert-gguf", files[name], tmp_path / "out"]}[command]
    assert_refused(cli(*args), *NEEDLES[name])
    assert not (tmp_path / "out").exists()


def test_a_relabelled_file_is_refused_unless_allowed_and_info_shows_it(files, cli, tmp_path):
    """A Qwen2 relabelled llama would run without its biases: refused as a directory over another
    family's weights is, loaded when allowed; `info` shows the unused tensors and refuses nothing."""
    f = files["relabelled"]
    for args in (["run", f, "the", "-n", "1"], ["convert-gguf", f, tmp_path / "out"]):
        assert_refused(cli(*args), *NEEDLES["relabelled"])
    with pytest.raises(LarqlError, match="allow_unused_tensors"):
        convert_gguf(f, tmp_path / "out")
    assert load(f, device="cpu", allow_unused_tensors=True).config.model_type == "llama"
    rc, out, err = cli("run", f, "the", "-n", "2", "--allow-unused-tensors")
    assert rc == 0, err
    assert describe(f)["unused_tensors"] == 3
    rc, out, err = cli("info", f, "--json")
    assert rc == 0 and json.loads(out)["unused_tensors"] == 3, err
    rc, out, err = cli("convert-gguf", f, tmp_path / "out", "--allow-unused-tensors")
    assert rc == 0, err
    load(tmp_path / "out", device="cpu")  # the biases left out: the directory needs no flag


def test_the_console_script_refuses_it_in_one_line_too(files):
    """The same refusal from a fresh process, through the entry point a user runs."""
    done = subprocess.run([sys.executable, "-m", "larqlpy.cli.main", "run", str(files["token_type short"]), "hi"],
                          capture_output=True, text=True, timeout=300)
    assert_refused((done.returncode, done.stdout, done.stderr), *NEEDLES["token_type short"])


def test_the_checked_reader_reads_every_field_and_tensor_as_gguf_py_does():
    """gguf_check.Reader slices a plain array where gguf-py slices its memmap (3x faster on a large
    vocabulary): the same keys, types, parts and tensor table, on a file we ship."""
    from conftest import smol_gguf
    from larqlpy.weights.gguf_check import Reader

    ours, theirs = Reader(smol_gguf()), gguf.GGUFReader(smol_gguf())
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.parts, field.parts)), name
    assert [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.shape.tolist()) for t in theirs.tensors]
    assert all(np.array_equal(a.data[:64], b.data[:64]) for a, b in zip(ours.tensors, theirs.tensors))
