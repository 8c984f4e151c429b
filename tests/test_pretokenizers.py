"""llama.cpp's pre-tokenizers (weights/gguf_pretok.py) on tricky strings.

Each test GGUF holds, under one tokenizer.ggml.pre name, a small byte-level BPE trained on the test
strings themselves with no split at all: its merges cross every boundary a pre-tokenizer may draw
(words, digits, case, spaces, scripts), so the ids show where each name splits. Against llama.cpp's own
tokenizer where llama-cpp-python is installed (`make bench` installs it; CI does not compile it);
everywhere, llama.cpp's adapted regexes against the tokenizer.json regexes they were adapted from, and
the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from conftest import smol_gguf
from test_cli import assert_refused
from test_hostile_gguf import tiny_spec, write_gguf
from larqlpy.errors import LarqlError
from larqlpy.weights.gguf_archs import Meta
from larqlpy.weights.gguf_check import Reader
from larqlpy.weights.gguf_pretok import GPT2, LLAMA3, NAMES, NOT_REGEX, QWEN2, TYPES, check_name, unknown
from larqlpy.weights.gguf_tokenizer import build_tokenizer
from larqlpy.weights.loader import load

TEXTS = [
    "def f(x):\n    return x**2  # square\r\n\tprint('ok')\n\n\n",
    "   leading and trailing   \n  ", "a  b   c    d\t\te\u00a0f\u3000g",
    "I'M here, DON'T you'll we'Ve she'd it's", "1234567 3.14159 1,000,000 2024-12-07 x86_64 0xFF",
    "日本語のテキスト、中文文本。한국어 텍스트", "Ünïcödé café naïve Straße İstanbul ǅemal",
    "emoji 👩‍👩‍👧‍👦 👍🏽 🇫🇷 ❤️", "<think>\nreasoning here\n</think>\n\nanswer",
    "Привет, мир! Γειά σου Κόσμε ΩΚ αβγ", "नमस्ते दुनिया مرحبا بالعالم", "!!!??? ... --- ***", "ＡＢＣ１２３ ｆｕｌｌ",
    "camelCaseWord HTTPServer getHTTPResponseCode XMLHttpRequest", "https://example.com/a?b=c&d=e#f",
    "\r\n\r\n \n \r ", "tab\tand\u2028line\u2029sep", "x = [1, 2, 3]; y = {'k': v}  // ok",
    "e\u0301 n\u0303 \u1100\u1161 ٣٤٥ ١٢ ABC'S it'S", "\u00a0!\u00a0a\u2003b\u3000。「引用」", "ά έ ή ί ό ύ ώ ΐ ΰ",
    "$100 + 20% = ~x^2 | y` `z`", "1.5e-10 0b1010 10_000 12345678901234567890",
]


@pytest.fixture(scope="module")
def small_vocab() -> tuple[list[str], list[str], dict]:
    """(tokens, merges, the other metadata): a BPE trained on TEXTS over GPT-2's byte alphabet, the
    hyperparameters SmolLM2's GGUF's (llama.cpp reads them even for the vocabulary alone)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    r = gguf.GGUFReader(smol_gguf())
    skip = ("GGUF.", "general.architecture", "tokenizer.")
    fields = {k: (f.contents(), f.types) for k, f in r.fields.items() if not k.startswith(skip)}
    return tokens, merges, fields


def write(path: Path, vocab, pre: str) -> Path:
    """A vocabulary-only GGUF (no tensors: llama.cpp's vocab_only reads none) with `pre`."""
    tokens, merges, fields = vocab
    w = gguf.GGUFWriter(str(path), "llama")
    for k, (v, types) in fields.items():
        w.add_key_value(k, v, types[0], sub_type=types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def ours(path: Path) -> list[list[int]]:
    tok, _ = build_tokenizer(Meta(Reader(path), "llama"))
    return [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]


def one_name_a_type() -> list[str]:
    """A name of each type llama.cpp 0.3.16 (llama-cpp-python's) knows, and a few more names of the
    common types."""
    old = ("default", "llama3", "deepseek-llm", "deepseek-coder", "deepseek-v3", "falcon", "starcoder", "gpt-2",
           "qwen2", "dbrx", "poro-chat", "chatglm-bpe", "viking", "tekken", "chameleon", "gpt-4o", "superbpe",
           "bailingmoe", "seed-coder", "smollm", "deepseek-r1-qwen", "command-r", "olmo", "exaone", "stablelm2")
    return list(old)


def test_the_names_split_apart_on_these_strings(tmp_path, small_vocab):
    """The vocabulary tells the types apart: a type's ids equal to llama.cpp's say its splits are."""
    ids = {pre: str(ours(write(tmp_path / f"{pre}.gguf", small_vocab, pre))) for pre in one_name_a_type()}
    kinds = {id(NAMES[pre]): pre for pre in ids}
    assert len(set(ids.values())) >= len(kinds) - 3  # default/falcon, qwen2/bailingmoe, poro/viking alike here


@pytest.mark.parametrize("pre", one_name_a_type())
def test_ids_equal_llama_cpp(tmp_path, small_vocab, pre):
    llama_cpp = pytest.importorskip("llama_cpp")
    path = write(tmp_path / f"{pre}.gguf", small_vocab, pre)
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    want = [theirs.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS]
    got = ours(path)
    wrong = [(t, g, w) for t, g, w in zip(TEXTS, got, want) if g != w]
    assert not wrong, f"{pre}: {len(wrong)} of {len(TEXTS)} texts differ, first {wrong[0]}"


# tokenizer.json regexes llama.cpp adapted for its own regex engine (llama-vocab.cpp's comments)
ORIGINAL = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
    "tekken": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
              r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def pieces(regexes, text: str) -> list[str]:
    seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), "isolated") for r in regexes])
    return [p for p, _ in seq.pre_tokenize_str(text)]


@pytest.mark.parametrize("kind", ["llama3", "qwen2"])
def test_adapted_regexes_split_as_the_tokenizer_json_ones(kind):
    for text in TEXTS:
        assert pieces(TYPES[kind].regexes, text) == pieces([ORIGINAL[kind]], text), text


def test_tekken_adapted_regex_splits_ascii_as_the_original():
    """llama.cpp's tekken stand-in takes any letter outside a-z as upper case (é, ß): on ASCII text it
    is the original's split."""
    ascii_texts = [t for t in TEXTS if t.isascii()]
    for text in ascii_texts:
        assert pieces(TYPES["tekken"].regexes, text) == pieces([ORIGINAL["tekken"]], text), text


def test_every_regex_compiles_and_the_names_cover_llama_cpp_s_list():
    for kind, rules in TYPES.items():
        pieces(rules.regexes, TEXTS[0])  # Oniguruma compiles and runs each
    for name in ("deepseek-r1-qwen", "deepseek-llm", "deepseek-coder", "deepseek-v3", "qwen2", "qwen35", "llama3",
                 "smollm", "tekken", "gpt-4o", "command-r", "olmo", "falcon", "starcoder", "refact", "stablelm2",
                 "exaone", "llama-bpe", "default", "gpt-2"):
        assert unknown(name) is None, name
    assert NAMES["deepseek-r1-qwen"] is NAMES["qwen2"] and NAMES["gpt-2"].regexes == (GPT2,)
    assert NAMES["llama-bpe"].regexes == (LLAMA3,) and NAMES["llama-bpe"].ignore_merges
    assert NAMES["qwen2"].regexes == (QWEN2,)


def test_unknown_names_say_the_closest_and_the_override():
    why = unknown("deepseek-r1-qwen2")
    assert "closest: deepseek-r1-qwen" in why and "`pre_tokenizer` NAME" in why
    assert "hand-written" in unknown("kimi-k2") and set(NOT_REGEX).isdisjoint(NAMES)
    assert unknown(["qwen2"]) == "not a string"
    with pytest.raises(LarqlError, match="`pre_tokenizer` 'qwen9'.*closest: qwen2"):
        check_name("qwen9")


def tiny_file(tmp_path: Path, pre: str) -> Path:
    meta, tensors = tiny_spec()
    meta["tokenizer.ggml.pre"] = pre
    return write_gguf(tmp_path / f"{pre}.gguf", meta, tensors)


def test_run_refuses_an_unknown_name_naming_the_closest_and_the_flag(cli, tmp_path):
    path = tiny_file(tmp_path, "deepseek-r1-qwen-7b")
    result = cli("run", path, "Hello", "-n", "2")
    assert_refused(result, "tokenizer.ggml.pre is 'deepseek-r1-qwen-7b'", "closest: deepseek-r1-qwen",
                   "--pre-tokenizer NAME")
    assert "convert-gguf" not in result[2]
    assert_refused(cli("run", path, "Hello", "-n", "2", "--pre-tokenizer", "qwen9"), "--pre-tokenizer 'qwen9'",
                   "closest: qwen2")


def test_the_override_splits_as_its_name_and_only_while_given(cli, tmp_path):
    path = tiny_file(tmp_path, "mystery")
    rc, out, err = cli("run", path, "the 123", "-n", "2", "--pre-tokenizer", "qwen2", "--json")
    assert rc == 0, err
    assert json.loads(out)["prompt_tokens"] == len(build_tokenizer(
        Meta(Reader(tiny_file(tmp_path, "qwen2")), "qwen2"))[0].encode("the 123").ids)
    rc, out, _ = cli("info", path, "--json", "--pre-tokenizer", "qwen2")
    assert rc == 0 and json.loads(out)["pre_tokenizer"] == "qwen2 (given in place of the file's)"
    assert_refused(cli("info", path), "tokenizer.ggml.pre is 'mystery'")  # the file's own again
    assert load(path, pre_tokenizer="llama3").tokenizer.encode("2024") != []
    with pytest.raises(LarqlError, match="`pre_tokenizer` names how a GGUF file's text splits"):
        load(tmp_path, pre_tokenizer="qwen2")


def test_a_deepseek_r1_distill_name_runs_as_qwen2(cli, tmp_path):
    rc, out, _ = cli("info", tiny_file(tmp_path, "deepseek-r1-qwen"), "--json")
    assert rc == 0 and json.loads(out)["pre_tokenizer"] == "deepseek-r1-qwen"


def test_every_command_that_loads_a_model_takes_the_override(cli, tmp_path):
    path = tiny_file(tmp_path, "mystery")
    for command in (["kv-stats", path, "the 123 abc"], ["bench", "ladder", path, "--positions", "8", "--steps", "1"],
                    ["bench", "needle", path], ["calibrate", path], ["warmup", path]):
        assert_refused(cli(*command), "tokenizer.ggml.pre is 'mystery'", "--pre-tokenizer NAME")
    rc, out, err = cli("kv-stats", path, "the 123 abc", "--json", "--pre-tokenizer", "qwen2")
    assert rc == 0, err
    rc, out, err = cli("bench", "ladder", path, "--positions", "8", "--steps", "1", "--continuation", "canonical/v1",
                       "--json", "--pre-tokenizer", "qwen2")
    assert rc == 0 and json.loads(out)["rows"], err
