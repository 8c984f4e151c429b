"""`weights` native: a GGUF's quantized matrices run as their own integer codes (convert/native.py,
weights/native_file.py), reproducing gguf-py's dequantized values exactly."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from larqlpy.cli.common import error_line
from larqlpy.weights.gguf_archs import ARCHS
from larqlpy.convert.native import SUPPORTED, decompose, dequantize
from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.qweight import PackedPart, PackedWeight
from larqlpy.weights.loader import load
from larqlpy.tools.quality import score_text
from conftest import smol_gguf
from tiny import make_tiny

Q = gguf.GGMLQuantizationType


def random_blocks(qtype, n_blocks: int, seed: int) -> np.ndarray:
    """Any bytes are codes; the float16 scales are set to finite values (and some sub-scales to 0)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    halves = {Q.Q6_K: (208,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
              Q.Q3_K: (108,), Q.MXFP4: ()}.get(qtype, (0,))  # MXFP4's scale is an exponent byte: any is finite
    for at in halves:
        b[:, at:at + 2] = (rng.standard_normal(n_blocks) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype == Q.Q6_K:
        b[::3, 192:196] = 0  # sub-blocks with scale 0: their codes are undefined and must not matter
    return b


@pytest.mark.parametrize("name", SUPPORTED)
def test_every_supported_block_type_comes_back_bit_for_bit(name):
    qtype = Q[name]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    n, k = 6, 2 * 256 if block == 256 else 4 * 32
    data = random_blocks(qtype, n * k // block, seed=len(name)).reshape(n, -1)
    want = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(n, k)
    u, scale, minimum, zero, bits = decompose(data, qtype, (n, k))
    # equal as numbers: a sub-block whose scale is 0 holds zeros whose sign gguf-py takes from d and q
    assert np.array_equal(dequantize(u, scale, minimum, zero), want)
    assert u.max() < 2 ** bits
    packed = PackedWeight.from_codes(u, scale, minimum, zero, bits)
    assert np.array_equal(packed.rows(torch.arange(n)).numpy(), want)
    assert np.array_equal(packed._rows_torch(torch.arange(n)).numpy(), want)


def test_types_native_does_not_hold_are_left_to_float():
    assert decompose(np.zeros((1, 110), np.uint8), Q.Q3_K, (1, 256)) is None


def native_matrices(loaded):
    """HF-style name -> the packed matrix (a stacked part's own rows) of a model loaded native."""
    out = {}
    for i, block in enumerate(loaded.model.layers):
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            w = getattr(block, n)
            if isinstance(w, (PackedWeight, PackedPart)):
                out[f"layers.{i}.{n}"] = w
    out["embed_tokens"] = loaded.model.embed_tokens
    return out


# the 270M's is heavy: CI keeps SmolLM2's, and test_gguf_file's block types against gguf-py's probes
@pytest.mark.parametrize("which", [pytest.param("gemma", marks=pytest.mark.heavy), "smol"])
def test_native_reproduces_the_ggufs_dequantized_values_tensor_by_tensor(which, real_dir, smol_dir, gemma_gguf):
    """Every matrix of both reference models, as packed for `weights` native, against gguf-py's own
    dequantization of the GGUF tensor (q/k rows permuted back as the converter does)."""
    src, model_dir = (gemma_gguf, real_dir) if which == "gemma" else (smol_gguf(), smol_dir)
    loaded = load(model_dir, device="cpu", weights="native")
    mine = native_matrices(loaded)
    reader = gguf.GGUFReader(str(src))
    arch = ARCHS[reader.fields["general.architecture"].contents()]
    config = {"num_attention_heads": loaded.config.num_attention_heads,
              "num_key_value_heads": loaded.config.num_key_value_heads}
    names = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
             "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
    seen = set()
    for t in reader.tensors:
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            ours = "embed_tokens"
        elif parts[0] == "blk" and parts[2] in names:
            ours = f"layers.{parts[1]}.{names[parts[2]]}"
        else:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        want = arch.restore(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape),
                            config)
        w = mine[ours]
        for lo in range(0, shape[0], 32768):
            got = w.rows(torch.arange(lo, min(shape[0], lo + 32768))).numpy()
            assert np.array_equal(got.view(np.uint32), want[lo:lo + 32768].view(np.uint32)), ours
        seen.add(ours)
    assert seen == set(mine)


@pytest.fixture(scope="module")
def native(real_dir):
    return load(real_dir, device="cpu", weights="native", kv_dtype="f32")  # the weights' precision alone


def test_native_holds_each_tensor_at_the_ggufs_precision(native):
    """270M Q4_K_M: o_proj and half of down_proj 4-bit (Q4_K), Q6_K at 6 bits in groups of 16, the
    rest 8-bit."""
    blocks = native.model.layers
    assert {b.o_proj.kind for b in blocks} == {"u4"}
    assert {(b.down_proj.kind, b.down_proj.group) for b in blocks} == {("u4", 32), ("u6", 16)}
    assert native.model.embed_tokens.kind == "u8" and native.model.embed_tokens.zero == 128
    assert 8 * native.weight_bytes / sum(p.numel() for p in load(native.path, device="cpu").model.parameters()) < 9.0


# Measured over these 383 positions with int8 activations (teacher-forced, chunks of 16 and 192 alike):
# native KL 0.0026, top-1 98%; on an AVX-512 Zen 4 (its float kernels round otherwise) KL 0.0023,
# top-1 97.4%, loss +0.57% over the dequantized weights' (it was +0.5% or less where this was first set).
def test_native_quality_against_the_dequantized_weights(real, native, long_text):
    ids = real.tokenizer.encode(long_text)[:384]
    s = score_text(real.model, native.model, ids, chunk=192)
    assert s.mean_kl < 0.005
    assert s.test_loss < 1.01 * s.ref_loss
    assert s.top1 > 0.95


def test_a_directory_without_native_weights_is_refused_in_one_line(tmp_path):
    make_tiny(tmp_path / "tiny")
    with pytest.raises(LarqlError) as e:
        load(tmp_path / "tiny", device="cpu", weights="native")
    assert error_line(e.value) == (f"{tmp_path / 'tiny'}: no native weights (native.safetensors); "
                                   "convert the GGUF again (`larqlpy convert-gguf GGUF MODEL_DIR --force`) "
                                   "to write them beside the checkpoint")
