"""Qwen2.5-Coder-0.5B-Instruct (Qwen2: q/k/v biases, a 32K context, an untied Q8_0 head over a Q5_0
embedding), converted from its GGUF, against transformers loading the same GGUF: config, tokenizer
on digits, code whitespace, CJK and emoji, greedy ids on plain prompts and chats; and the weights
and engines on it."""

from __future__ import annotations

import pytest
import torch

from conftest import QWEN_DIR
from larqlpy.convert.parts import QWEN_CODER_05B, assemble
from larqlpy.model.decoder import prefill
from larqlpy.engines import EngineSpec, new_state, parse_engine_spec
from hf_compare import assert_chats_match, assert_prompts_match

CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What does `git stash` do?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Name a sorting algorithm."}],
]
TEXTS = ["in 2024 there were 365 days, 12345678 of them", "def f(x):\n    if x:\n\t\treturn  x  \n\n\n",
         "中文分词测试，日本語のテキスト、한국어", "emoji 🤖🚀 and 👩‍💻 done", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def gguf_file():
    return assemble(QWEN_CODER_05B, QWEN_DIR.parent / "gguf")


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def test_config_is_qwen2_with_biases_and_a_32k_context(qwen):
    c = qwen.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == \
        ("qwen2", 24, 896, 14, 2)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (64, 4864, 151936, 32768)
    assert c.rope_global.theta == 1_000_000.0 and all(w is None for w in c.windows)
    assert c.qkv_bias and not c.o_bias and qwen.model.layers[0].q_proj_bias.abs().max() > 0


def test_tokenizer_equals_transformers(qwen, hf_tokenizer, long_text):
    tok = qwen.tokenizer
    for text in [*TEXTS, long_text[:3000]]:
        ids = tok.encode(text, add_bos=False)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text


@pytest.mark.heavy  # transformers dequantizes the 0.5B in a minute; CI keeps Gemma's and SmolLM2's comparisons
def test_greedy_ids_equal_transformers_on_plain_prompts(qwen, hf_model):
    assert_prompts_match(qwen, hf_model, ("def fibonacci(n):", "The capital of France is", "# quicksort in C\n"), 24)


@pytest.mark.heavy
def test_chat_answers_equal_transformers(qwen, hf_model, hf_tokenizer):
    answer = qwen.tokenizer.decode(assert_chats_match(qwen, hf_model, hf_tokenizer, CONVERSATIONS, 20))
    assert answer.strip(), answer


def test_native_weights_hold_the_files_quality_and_window_equals_canonical(qwen_dir, qwen, long_text):
    """The GGUF's own codes (int8 activations) against the float32 checkpoint over 300 positions,
    and window/v1 bit-identical to canonical/v1 (no sliding layers: it keeps every row)."""
    from larqlpy.weights.loader import load

    ids = qwen.tokenizer.encode(long_text)[:300]
    native = load(qwen_dir, device="cpu", weights="native")
    out = {}
    for name, loaded, spec in (("f32", qwen, EngineSpec()), ("native", native, EngineSpec()),
                               ("window", native, parse_engine_spec(continuation="window/v1"))):
        state = new_state(spec, loaded.model.geometries(), loaded.device)
        out[name] = prefill(loaded.model, state, ids, 128, all_logits=True)
    assert torch.equal(out["native"], out["window"])
    kl = torch.nn.functional.kl_div(torch.log_softmax(out["native"], -1), torch.log_softmax(out["f32"], -1),
                                    log_target=True, reduction="none").sum(-1)
    top1 = (out["native"].argmax(-1) == out["f32"].argmax(-1)).float().mean().item()
    assert kl.mean().item() < 0.01 and top1 > 0.95, (kl.mean().item(), top1)
