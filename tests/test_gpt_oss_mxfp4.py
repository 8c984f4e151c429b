"""GPT-OSS as OpenAI publishes it: a safetensors directory whose experts are MXFP4 `_blocks` / `_scales`
pairs (config.json's quantization_config), the rest bf16. larqlpy reads it on the experts' own codes
(`native`) and converted (f32, int8) and gives the logits and greedy ids of transformers loading the
same directory (Mxfp4Config(dequantize=True)); broken pairs are refused in one line."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.qweight import TILE, PackedPart, PackedWeight
from larqlpy.weights.info import describe
from larqlpy.weights.loader import load
from hf_compare import greedy_hf, greedy_ours, hf_logits, our_logits
from test_gpt_oss import CASES, make
from test_moe import IDS

QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}


def openai_mxfp4(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(experts, rows, inputs) float quantized by gguf-py's MXFP4, laid out as OpenAI's files hold it:
    blocks (experts, rows, inputs / 32, 16), input 2i in a byte's low nibble and 2i + 1 in its high,
    and the exponents (experts, rows, inputs / 32). (A GGUF block: the exponent byte, then input j in
    the low nibble of byte j and input j + 16 in its high.)"""
    q = gguf.quants.quantize(np.ascontiguousarray(a, np.float32), gguf.GGMLQuantizationType.MXFP4)
    q = q.reshape(*a.shape[:2], -1, 17)
    inputs = np.concatenate([q[..., 1:] & 15, q[..., 1:] >> 4], axis=-1)  # the block's 32 inputs in order
    return inputs[..., 0::2] | (inputs[..., 1::2] << 4), np.ascontiguousarray(q[..., 0])


def write_mxfp4(path) -> None:
    """The tiny f32 GPT-OSS of test_gpt_oss rewritten as OpenAI's files: experts as MXFP4 pairs, the
    rest bf16, quantization_config in config.json."""
    _, seed, sizes = CASES["f32"]
    hf = make(path, torch.float32, seed, sizes)
    tensors = {}
    for name, t in hf.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # (experts, inputs, outputs)
            blocks, scales = openai_mxfp4(t.transpose(1, 2).numpy())
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))


@pytest.fixture(scope="module")
def openai_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    return path, ref


def positions_within(loaded, want: torch.Tensor, tol: float) -> float:
    """The share of positions whose every logit is within tol of transformers'."""
    return ((our_logits(loaded, IDS) - want).abs().amax(1) < tol).float().mean().item()


def test_mxfp4_directory_runs_as_transformers(openai_dir):
    path, ref = openai_dir
    want = hf_logits(ref, IDS)
    f32 = load(path, device="cpu", weights="f32")
    assert (our_logits(f32, IDS) - want).abs().max().item() < 1e-3
    assert greedy_ours(f32, IDS[:12], 12) == greedy_hf(ref, IDS[:12], 12)
    native = load(path, device="cpu")  # the default: the experts on their MXFP4 codes, bf16 matrices as bf16
    assert native.weights == "native" and native.packed_from == "file"
    block, experts = native.model.layers[1], ref.model.layers[1].mlp.experts
    assert block.q_proj.whole.kind == "bf16"
    for j in range(experts.num_experts):  # the codes stand for transformers' dequantized values, exactly
        gate = block.experts[j].gate_proj
        assert isinstance(gate, PackedPart) and gate.whole.kind == "fp4"
        got = gate.whole.rows(torch.arange(2 * experts.intermediate_size))
        assert torch.equal(got, torch.cat([experts.gate_up_proj[j][:, 0::2].T, experts.gate_up_proj[j][:, 1::2].T]))
        assert torch.equal(block.experts[j].down_proj.rows(torch.arange(experts.hidden_size)), experts.down_proj[j].T)
        assert 8 * gate.whole.nbytes / (gate.whole.codes.shape[0] * TILE * gate.whole.shape[1]) == 4.25  # the file's
    # int8 activations (this CPU's integer path) now and then flip a near tie of the router's top k,
    # which moves a whole position: most positions are held, not all
    assert positions_within(native, want, 0.05) >= 0.9
    for w in native.held_weights():  # float activations over the same codes
        if isinstance(w, PackedWeight):
            w.path = "float"
    assert (our_logits(native, IDS) - want).abs().max().item() < 1e-3
    int8 = load(path, device="cpu", weights="int8")  # converted from the codes' values
    assert positions_within(int8, want, 0.1) >= 0.9
    bf16 = load(path, device="cpu", weights="bf16")  # every MXFP4 value is a bfloat16: nothing rounds
    assert (our_logits(bf16, IDS) - want).abs().max().item() < 1e-3


def test_info_counts_the_experts_as_the_weights_they_stand_for(openai_dir):
    path, ref = openai_dir
    info = describe(path)
    assert info["dtypes"] == "BF16,MXFP4" and info["unused_tensors"] == 0
    assert info["parameters"] == sum(p.numel() for p in ref.parameters())


E = "model.layers.{}.mlp.experts."


def cut(t: dict, layer: int, names: tuple[str, ...], rows: tuple) -> None:
    for name in names:
        t[E.format(layer) + name] = t[E.format(layer) + name][rows].contiguous()


@pytest.mark.parametrize("change, says", [
    (lambda t: t.pop(E.format(2) + "down_proj_scales"), "down_proj_blocks has no .*down_proj_scales"),
    (lambda t: t.pop(E.format(0) + "gate_up_proj_blocks"), "gate_up_proj_scales has no .*_blocks"),
    (lambda t: t.update({E.format(1) + "down_proj_scales": t[E.format(1) + "down_proj_scales"].to(torch.int16)}),
     "are U8 and I16"),
    (lambda t: cut(t, 3, ("gate_up_proj_scales",), np.s_[:, :, :1]),
     r"gate_up_proj_blocks has shape \[4, 64, 2, 16\] and .* \[4, 64, 1\]"),
    (lambda t: cut(t, 0, ("down_proj_blocks", "down_proj_scales"), np.s_[:3]), "down_proj holds 3 experts, expected 4"),
], ids=["no scales", "no blocks", "not uint8", "shapes apart", "experts missing"])
def test_broken_pairs_are_refused_in_one_line(openai_dir, tmp_path, change, says):
    path, _ = openai_dir
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((path / f).read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LarqlError, match=says) as e:
        load(tmp_path, device="cpu")
    assert "\n" not in str(e.value)
