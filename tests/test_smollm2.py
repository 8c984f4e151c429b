"""SmolLM2-135M-Instruct (Llama architecture), converted from its GGUF, against transformers loading
the same GGUF: weights (the q/k permutation undone), tokenizer, logits over 1,100 positions, greedy
ids, chat answers; and the engines on it."""

from __future__ import annotations

import pytest
import torch

from conftest import smol_gguf
from hf_compare import assert_chats_match, assert_prompts_match
from larqlpy.engines import EngineSpec, new_state, parse_engine_spec
from larqlpy.model.decoder import prefill

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name a primary colour."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fact about the Moon."}],
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    g = smol_gguf()
    return AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    g = smol_gguf()
    return AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


def test_config_and_weights_equal_transformers_gguf_loader(smol, hf_model):
    c = smol.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == \
        ("llama", 30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.rope_global.theta, c.tie_word_embeddings) == \
        (64, 1536, 49152, 100000.0, True)
    assert all(w is None for w in c.windows) and not c.norm_offset
    sd = hf_model.state_dict()
    for i in (0, 17, 29):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            ours = getattr(smol.model.layers[i], name)
            assert torch.equal(ours, sd[f"model.layers.{i}.self_attn.{name}.weight"]), (i, name)
        assert torch.equal(smol.model.layers[i].post_attention_layernorm,
                           sd[f"model.layers.{i}.post_attention_layernorm.weight"])
    assert torch.equal(smol.model.embed_tokens, sd["model.embed_tokens.weight"])


def test_tokenizer_equals_transformers_and_splits_digits_as_llama_cpp(smol, hf_tokenizer, long_text):
    tok = smol.tokenizer
    assert tok.add_bos is False and tok.bos_id == 1 and 2 in tok.stop_ids
    text = long_text[:4000].translate(str.maketrans("", "", "0123456789"))
    assert tok.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert tok.encode(f"a{special}b") == hf_tokenizer.encode(f"a{special}b", add_special_tokens=False)
    ids = tok.encode("in 2024 there were 365 days")
    digits = [tok.decode([i]) for i in ids if tok.decode([i]).strip().isdigit()]
    assert digits == list("2024365")  # llama.cpp's smollm pre-tokenizer: every digit on its own


def test_logits_match_transformers_over_1100_positions(smol, hf_model, long_text):
    ids = smol.tokenizer.encode(long_text)[:1100]
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0]
    state = new_state(EngineSpec(), smol.model.geometries(), smol.device)
    got = prefill(smol.model, state, ids, 512, all_logits=True)
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-3


def test_greedy_ids_equal_transformers_on_plain_prompts(smol, hf_model):
    assert_prompts_match(smol, hf_model, ("The history of the printing press begins", "def fibonacci(n):",
                                          "Water boils at"), 32)


def test_chat_answers_equal_transformers(smol, hf_model, hf_tokenizer):
    answer = smol.tokenizer.decode(assert_chats_match(smol, hf_model, hf_tokenizer, CONVERSATIONS, 24))
    assert "Moon" in answer or "moon" in answer, answer


def test_window_is_bit_identical_and_codec_runs_on_smollm2(smol, long_text):
    """No sliding layers: window/v1 keeps every row and equals canonical/v1 bit for bit; codec/v1
    runs on head_dim 64 with 3 KV heads."""
    ids = smol.tokenizer.encode(long_text)[:300]
    out = {}
    for name, spec in (("canonical", EngineSpec()), ("window", parse_engine_spec(continuation="window/v1")),
                       ("codec", parse_engine_spec(continuation="codec/v1", options=["bits=4", "calib=on",
                                                                                       "recent=16", "sink=1"]))):
        state = new_state(spec, smol.model.geometries(), smol.device)
        logits = [prefill(smol.model, state, ids[:200], 64, all_logits=True)]
        logits += [smol.model(torch.tensor([t]), state) for t in ids[200:230]]
        out[name] = torch.cat(logits)
        if name == "window":
            assert state.retained_rows() == 30 * 230  # every row of every layer
    assert torch.equal(out["canonical"], out["window"])
    kl = torch.nn.functional.kl_div(torch.log_softmax(out["codec"][200:], -1),
                                    torch.log_softmax(out["canonical"][200:], -1),
                                    log_target=True, reduction="none").sum(-1)
    assert kl.mean().item() < 0.05


@pytest.mark.heavy  # 46 s of CLI runs: the 270M and tiny models hold these paths in CI; make test runs it
def test_everything_that_runs_on_gemma3_runs_on_smollm2(smol_dir, tmp_path):
    """Low-bit weights, cells/v1 under a budget, save and resume in a new process (bit-identical),
    kv-stats, the ladder and residency, through the real CLI."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    exe = [sys.executable, "-m", "larqlpy.cli.main"]

    def cli(*args):
        r = subprocess.run([*exe, *map(str, args)], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, (args, r.stderr)
        return r.stdout

    prompt = "The history of the printing press begins in"
    for w in ("int8", "int4"):
        assert len(json.loads(cli("run", smol_dir, prompt, "-n", "6", "--weights", w, "--json"))["tokens"]) == 6
    cells = json.loads(cli("run", smol_dir, prompt * 40, "-n", "8", "--kv-budget", "8MiB", "--json"))
    # cold cells left memory
    assert cells["stats"]["resident_kv_bytes"] <= 9 * 2**20 and cells["cells"].get("PERSISTED", 0) > 0
    rec = ["--continuation", "codec/v1", *sum((["--continuation-option", o] for o in
                                                ("bits=4", "calib=on", "recent=16", "sink=1")), [])]
    whole = json.loads(cli("run", smol_dir, prompt, "-n", "12", *rec, "--json"))["tokens"]
    cli("run", smol_dir, prompt, "-n", "5", *rec, "--save-state", tmp_path / "s.kv")
    rest = json.loads(cli("run", smol_dir, "", "--resume", tmp_path / "s.kv", "-n", "7", "--json"))["tokens"]
    assert whole == json.loads(cli("run", smol_dir, prompt, "-n", "5", *rec, "--json"))["tokens"] + rest
    stats = json.loads(cli("kv-stats", smol_dir, prompt * 10, "--max-positions", "200", "--json"))
    assert len(stats["layers"]) == 30 and stats["calibrated"]
    ladder = json.loads(cli("bench", "ladder", smol_dir, "--positions", "96", "--steps", "2", "--json"))
    window = next(r for r in ladder["rows"] if r["engine"] == "window/v1")
    assert window["next_token_kl"] == 0.0 and window["row_cosine"] == 1.0
    assert "no sliding layers" in cli("residency", smol_dir, "--positions", "2048")
