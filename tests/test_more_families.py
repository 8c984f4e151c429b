"""Granite, Granite-MoE, StarCoder2 and GPT-2 against transformers' own classes on tiny random
checkpoints (logits in prefill and decode, greedy ids), window/v1 against canonical/v1, GPT-2 under
no-cache replay, and the same models written as GGUF files the way llama.cpp's converter lays them
out, read by larqlpy (and by transformers where its GGUF loader takes the architecture)."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from larqlpy.calibration import calibrate
from larqlpy.config import GenerationConfig
from larqlpy.convert.gguf import convert_gguf
from larqlpy.engines.registry import parse_engine_spec
from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.qweight import PackedWeight
from larqlpy.model.families import config_from_dict
from larqlpy.weights.info import describe
from larqlpy.weights.loader import load
from hf_compare import hf_generate, hf_logits, logit_gaps, our_logits
from test_batched import Job, alone
from test_families import canonical_and_window
from test_gguf_archs import TOKENS, finish, permute, vocabulary
from test_moe import GIDS, IDS
from tiny import write_tokenizer

SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, bos_token_id=2, eos_token_id=1, pad_token_id=0)
GRANITE = dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5)
# transformers' config class and extra fields, sized to run in milliseconds; StarCoder2's window
# short enough that a 40-token prompt crosses it
FAMILIES = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(SIZES, tie_word_embeddings=False, **GRANITE)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        SIZES, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True, **GRANITE)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(
        SIZES, sliding_window=8, use_bias=True, norm_epsilon=1e-5, tie_word_embeddings=False)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=3, n_head=4, n_positions=128, bos_token_id=2,
                                                   eos_token_id=1)),
}


def make(path, name: str, seed: int = 0, **overrides):
    """A random tiny model of `name` in the HF layout; returns the transformers model."""
    config_cls, model_cls, extra = FAMILIES[name]
    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    cfg = getattr(transformers, config_cls)(**{"vocab_size": vocab, **extra, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms and biases start at constants; give them values so they matter
        for n, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in n or "bias" in n or "ln_" in n else 0.08)
            if ("norm" in n or "ln_" in n) and n.endswith("weight"):
                p.add_(1.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return request.param, d, make(d, request.param), load(d, device="cpu")


def test_logits_match_transformers_in_prefill_and_decode(family):
    name, _, hf, ours = family
    assert max(logit_gaps(ours, hf, IDS)) < 1e-3, name


def test_greedy_ids_match_transformers(family):
    name, _, hf, ours = family
    want = hf_generate(hf, IDS[:12], 10)
    gen = GenerationConfig(max_tokens=10, stop_at_eos=False)
    assert alone(ours, Job(IDS[:12], gen=gen))[0] == want, name
    if name == "gpt2":  # replayed from position 0 every step: learned positions right each time
        assert alone(ours, Job(IDS[:12], spec=parse_engine_spec(engine="no-cache"), gen=gen))[0] == want


@pytest.mark.parametrize("family", ["starcoder2"], indirect=True)  # one family is enough: its window
def test_window_is_bit_identical_to_canonical(family):
    _, _, _, ours = family
    assert ours.config.windows == (8,) * 3
    canonical, window = canonical_and_window(ours, IDS)
    assert torch.equal(canonical, window)


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
def test_gpt2_as_openai_names_it(family, tmp_path):
    """OpenAI's GPT-2 files: no `transformer.` prefix, and each layer's causal mask buffer beside it."""
    _, d, _, ours = family
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(d / f, tmp_path / f)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        tensors = {k.removeprefix("transformer."): f.get_tensor(k) for k in f.keys()}
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 8, 8) for i in range(3)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert torch.equal(our_logits(load(tmp_path, device="cpu"), IDS), our_logits(ours, IDS))


@pytest.mark.parametrize("family", ["gpt2"], indirect=True)
def test_gpt2_refuses_positions_past_its_table(family):
    _, _, _, ours = family
    with pytest.raises(LarqlError, match="gpt2 has learned positions up to 128 tokens: position 163 is past them"):
        our_logits(ours, IDS * 4)  # 164 ids, in chunks of 64: the last one ends past them


@pytest.mark.parametrize("family", ["granitemoe", "gpt2"], indirect=True)
def test_views_packed_and_in_bfloat16(family):
    """The tensors read as views of the files' (GPT-2's transposed Conv1D, Granite-MoE's fused
    experts) packed as int8 and read through torch in bfloat16 stay near float32."""
    name, d, _, ours = family
    f32 = our_logits(ours, IDS)
    for kw in ({"weights": "int8"}, {"dtype": "bfloat16"}):
        assert (our_logits(load(d, device="cpu", **kw), IDS) - f32).abs().mean().item() < 0.05, (name, kw)


# -- GGUF: llama.cpp's layout --------------------------------------------------------------------

TOP = {"model.embed_tokens": "token_embd", "transformer.wte": "token_embd", "transformer.wpe": "position_embd",
       "model.norm": "output_norm", "transformer.ln_f": "output_norm", "lm_head": "output"}
BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down", "input_layernorm": "attn_norm",
         "post_attention_layernorm": "ffn_norm", "block_sparse_moe.router": "ffn_gate_inp", "ln_1": "attn_norm",
         "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output"}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def metadata(w: gguf.GGUFWriter, arch: str, c) -> None:
    """What llama.cpp's converter writes for the four: sizes, eps, Granite's scales, experts."""
    gpt2 = arch == "gpt2"
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.n_positions if gpt2 else c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(4 * c.hidden_size if gpt2 else c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    if not gpt2:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_freq_base(10000.0)
    if arch.startswith("granite"):
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    else:
        w.add_layer_norm_eps(c.layer_norm_epsilon if gpt2 else c.norm_epsilon)
    if arch == "granitemoe":
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    vocabulary(w)


def write_gguf(hf, path, arch: str, matrices_as=None):
    """The tiny model as llama.cpp's converter writes it: granite's q/k rows permuted, Granite-MoE's
    fused experts split into gate and up (3-D), GPT-2's Conv1D matrices transposed and its head
    written as a copy of the embeddings; `matrices_as`: the blocks' 2-D matrices quantized so."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    metadata(w, arch, c)
    for name, t in hf.state_dict().items():
        a = t.detach().float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings and arch != "gpt2":
            continue
        if arch == "gpt2" and name.endswith(CONV1D):
            a = a.T
        parts = name.split(".")
        if parts[-1] in ("gate_up_proj", "down_proj") and parts[-2] == "experts":  # (experts, rows, inputs)
            half = a.shape[1] // 2
            stacks = {"ffn_down_exps": a} if parts[-1] == "down_proj" else \
                {"ffn_gate_exps": a[:, :half], "ffn_up_exps": a[:, half:]}
            for kind, x in stacks.items():
                w.add_tensor(f"blk.{parts[-4]}.{kind}.weight", np.ascontiguousarray(x))
            continue
        owner, what = ".".join(parts[:-1]), parts[-1]
        if owner in TOP:
            w.add_tensor(f"{TOP[owner]}.{what}", np.ascontiguousarray(a))
            continue
        layer, rest = parts[2], ".".join(parts[3:-1])
        if arch.startswith("granite") and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            a = permute(a, c.num_attention_heads if "q_proj" in rest else c.num_key_value_heads)
        a, kind = np.ascontiguousarray(a), f"blk.{layer}.{BLOCK[rest]}.{what}"
        if matrices_as is not None and a.ndim == 2 and "router" not in rest:
            w.add_tensor(kind, gguf.quants.quantize(a, matrices_as), raw_dtype=matrices_as)
        else:
            w.add_tensor(kind, a)
    return finish(w, path)


FROM_GGUF = ("starcoder2", "gpt2")  # the archs transformers' GGUF loader reads of the four


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gguf_runs_as_transformers(name, tmp_path):
    """The file larqlpy reads gives the logits of the model it was written from (and of transformers
    reading the same file, where it can)."""
    # llama.cpp's starcoder2 has no window; transformers' GGUF loader takes GPT-2's default 1,024 positions
    extra = {"starcoder2": {"sliding_window": None}, "gpt2": {"n_positions": 1024}}.get(name, {})
    hf = make(tmp_path / "hf", name, vocab_size=len(TOKENS), **extra)
    path = write_gguf(hf, tmp_path / f"{name}.gguf", name)
    loaded = load(path, device="cpu")
    assert loaded.config.model_type == name
    shown = describe(path)
    copy = hf.config.vocab_size * hf.config.hidden_size if name == "gpt2" else 0  # gpt2's head: the embeddings'
    assert shown["parameters"] == sum(p.numel() for p in hf.parameters()) + copy
    assert shown["rope"] == ("none (learned positions)" if name == "gpt2" else "10000")
    ours = our_logits(loaded, GIDS)
    assert (ours - hf_logits(hf, GIDS)).abs().max().item() < 1e-3
    if name == "gpt2":  # its directory layout (Conv1D transposed) is not what a conversion writes
        with pytest.raises(LarqlError, match="runs from the GGUF file itself"):
            convert_gguf(path, tmp_path / "converted")
    elif name != "granitemoe":  # converted to a directory: the same model (its K/V rows float32, the file's f16)
        converted = load(convert_gguf(path, tmp_path / "converted", dtype="float32"), device="cpu")
        assert (our_logits(converted, GIDS) - hf_logits(hf, GIDS)).abs().max().item() < 1e-3
    if name in FROM_GGUF:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
        assert (ours - hf_logits(theirs, GIDS)).abs().max().item() < 1e-3


@pytest.mark.parametrize("name", ["starcoder2", "gpt2"])
def test_q8_0_gguf_runs_as_its_own_codes(name, tmp_path):
    """Q8_0 matrices (GPT-2's fused attn_qkv one of them) run as 8-bit codes beside their float
    biases and LayerNorms, against the same file dequantized to float32."""
    hf = make(tmp_path / "hf", name, vocab_size=len(TOKENS))
    path = write_gguf(hf, tmp_path / "q8.gguf", name, matrices_as=gguf.GGMLQuantizationType.Q8_0)
    native, f32 = load(path, device="cpu"), load(path, device="cpu", weights="f32")
    assert native.weights == "native" and isinstance(native.model.layers[0].o_proj, PackedWeight)
    assert (our_logits(native, GIDS) - our_logits(f32, GIDS)).abs().max().item() < 0.05


def test_header_check_refuses_a_bad_granite_scale(tmp_path):
    hf = make(tmp_path / "hf", "granite", vocab_size=len(TOKENS))
    hf.config.logits_scaling = -2.0  # written as granite.logit_scale
    with pytest.raises(LarqlError, match=r"granite\.logit_scale is -2\.0: expected a number above 0"):
        load(write_gguf(hf, tmp_path / "bad.gguf", "granite"), device="cpu")


def test_gpt2_key_calibration_stays_within_its_positions(tmp_path):
    make(tmp_path, "gpt2", n_positions=256)
    cals, meta = calibrate(load(tmp_path, device="cpu"))
    assert meta["tokens"] == "256" and len(cals) == 3


def test_bad_configs_are_refused_in_one_line():
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 4, "vocab_size": 10}
    for raw, why in (({**gpt2, "n_embd": None, "n_positions": "x"}, "missing or invalid n_embd, n_positions"),
                     ({**gpt2, "scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
                     ({"model_type": "granite", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                       "num_attention_heads": 1, "vocab_size": 8, "logits_scaling": 0},
                      "logits_scaling must be a positive number, got 0")):
        with pytest.raises(LarqlError, match=why):
            config_from_dict(raw)
