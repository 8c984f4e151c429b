"""kernels/weights/qmany.py: several packed matrices, or row ranges of one, in one kernel call, bit for
bit what one call per matrix gives -- a mixture's decode step (model/moe.py: Mixtral and Qwen3-MoE at
int8 / int4, a DeepSeek GGUF's Q8_0 experts beside its shared ones) and DeepSeek's per-head W_UK /
W_UV run on a GGUF's own codes (model/mla.py), near the same file dequantized."""

from __future__ import annotations

import gguf
import pytest
import torch

from larqlpy.kernels.weights.qweight import PackedWeight
from larqlpy.weights.loader import load
from hf_compare import our_logits
from test_deepseek import make
from test_deepseek_gguf import write_gguf
from test_gguf_archs import TOKENS, packed_kinds
from tiny import make_tiny_family

IDS = [257] + [(7 + 37 * i) % 256 for i in range(30)]
# v2-lora's shape with latent sizes whose per-head rows are whole tiles (64) and inputs fit Q8_0's blocks
HEADS = dict(vocab_size=len(TOKENS), hidden_size=64, kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=64,
             moe_intermediate_size=32)


def fused_and_loop(loaded, layer: int, rows: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode steps (one row each) through a sparse layer's experts: fused (two kernel calls), and one
    call per matrix."""
    experts = loaded.model.layers[layer].hot().experts
    assert experts.fused is not None
    hs = torch.randn(rows, loaded.config.hidden_size, generator=torch.Generator().manual_seed(3))
    fused = torch.cat([experts(hs[i:i + 1]) for i in range(rows)])
    kept, experts.fused = experts.fused, None
    try:
        loop = torch.cat([experts(hs[i:i + 1]) for i in range(rows)])
    finally:
        experts.fused = kept
    return fused, loop


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_decode_step_equals_one_call_per_matrix(tmp_path, family):
    make_tiny_family(tmp_path, family)
    for fmt in ("int8", "int4"):
        fused, loop = fused_and_loop(load(tmp_path, device="cpu", weights=fmt), 0)
        assert torch.equal(fused, loop), (family, fmt)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A DeepSeek-V2 GGUF (split attn_k_b / attn_v_b) in Q8_0, loaded native and as float32."""
    d = tmp_path_factory.mktemp("heads")
    path = write_gguf((d, make(d, "v2-lora", seed=2, **HEADS), True), d / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    return load(path, device="cpu"), load(path, device="cpu", weights="f32")


def test_deepseek_experts_and_heads_run_on_their_codes(deepseek):
    """Experts (the shared ones' gate|up in the same call where of their kind) bit for bit against one
    call per matrix; W_UK / W_UV on their Q8_0 codes; the logits near the file dequantized (int8
    activations against float32, as test_deepseek_gguf's Q8_0 file: wrong codes would miss by the
    logits' size)."""
    native, f32 = deepseek
    assert packed_kinds(native.model) == {"u8"}
    block = native.model.layers[1].hot()
    assert block.heads is not None and block.experts.fused is not None
    assert f32.model.layers[1].hot().heads is None
    fused, loop = fused_and_loop(native, 1)
    assert torch.equal(fused, loop)
    gap = (our_logits(native, IDS) - our_logits(f32, IDS)).abs()
    assert 0 < gap.max().item() < 0.15 and gap.mean().item() < 0.02


def head_rows(w: PackedWeight, h: int, heads: int) -> PackedWeight:
    """Head h's rows of a per-head matrix as a PackedWeight of its own (its tiles, shared codes)."""
    tiles = w.codes.shape[0] // heads

    def cut(a):
        return None if a is None else a[h * tiles:(h + 1) * tiles]

    return PackedWeight(w.kind, (w.shape[0] // heads, w.shape[1]), cut(w.codes), cut(w.scale), cut(w.minimum),
                        w.zero, w.group, w.lowest, w.highest, cut(w.outer))


@pytest.mark.parametrize("rows", [1, 5, 11])
def test_heads_in_one_call_equal_each_head_alone(deepseek, rows):
    """Every head's rows times its own queries in one call: each head's numbers those its own matrix
    gives, for one row (decode) and several (within one intrinsic call's 8 rows, and past them)."""
    layer = deepseek[0].model.layers[0]
    heads = deepseek[0].config.num_attention_heads
    for which, w in enumerate(layer.hot().heads):
        x = torch.randn(heads, rows, w.shape[1], generator=torch.Generator().manual_seed(rows + which))
        got = layer.absorbed(x, which)
        assert got.shape == (heads, rows, w.shape[0] // heads)
        for h in range(heads):
            assert torch.equal(got[h], head_rows(w, h, heads).matmul(x[h])), (which, h)
