"""Chat: templates rendered as transformers' apply_chat_template renders them, chat in run / batch /
the Python API, and the `larqlpy chat` REPL whose turns prefill only their own tokens and whose
conversations continue in another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import smol_gguf
from larqlpy.api.chat import ChatSession
from larqlpy.errors import LarqlError
from larqlpy.text.chat_template import ChatTemplate

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
EXE = [sys.executable, "-m", "larqlpy.cli.main"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6"}],
    [{"role": "user", "content": "Ünïcödé and emoji 🙂, and a \"quote\" and {braces}"}],
    [{"role": "user", "content": "line one\nline two\n\nline four"}, {"role": "assistant", "content": "ok"}],
]
# A Gemma-style template with what templates use: raise_exception, namespace, loop controls, bos_token.
GEMMA_STYLE = """{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'tool' %}\
{{ raise_exception('tools are not supported') }}{% endif %}{% if m['role'] == 'system' %}{% continue %}{% endif %}\
{% set ns.n = ns.n + 1 %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}
{% if loop.first and messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}

{% endif %}{{ m['content'] | trim }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    g = smol_gguf()
    return AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_model_template_renders_as_transformers(smol, hf_tokenizer, messages, generation_prompt):
    ours = ChatTemplate.for_tokenizer(smol.tokenizer).render(messages, add_generation_prompt=generation_prompt)
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_a_template_file_renders_as_transformers(smol, hf_tokenizer, tmp_path, messages):
    f = tmp_path / "t.jinja"
    f.write_text(GEMMA_STYLE)
    ours = ChatTemplate.for_tokenizer(smol.tokenizer, f).render(messages)
    assert ours == hf_tokenizer.apply_chat_template(messages, chat_template=GEMMA_STYLE, tokenize=False,
                                                    add_generation_prompt=True)
    assert ours.startswith("<|im_start|>")  # bos_token is SmolLM2's


def test_template_refusals_are_one_line(smol, real, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(GEMMA_STYLE)
    t = ChatTemplate.for_tokenizer(smol.tokenizer, f)
    with pytest.raises(LarqlError, match="the role 'robot'"):  # refused before the template
        t.render([{"role": "robot", "content": "x"}])
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('system messages are not supported') }}")
    with pytest.raises(LarqlError, match="system messages are not supported"):
        ChatTemplate.for_tokenizer(smol.tokenizer, raising).render([{"role": "system", "content": "x"}])
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": 3}], "hi"):
        with pytest.raises(LarqlError, match="messages"):
            t.render(bad)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(LarqlError, match="not a valid chat template"):
        ChatTemplate.for_tokenizer(smol.tokenizer, broken)
    with pytest.raises(LarqlError, match="has no chat template") as e:  # the 270M's GGUF carries none
        ChatTemplate.for_tokenizer(real.tokenizer)
    assert "\n" not in str(e.value)


def cli(*args, stdin=None, timeout=600):
    return subprocess.run([*EXE, *map(str, args)], input=stdin, capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def test_run_chat_batch_and_the_api_give_the_same_reply(smol, smol_dir, tmp_path):
    import larqlpy

    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]
    api = larqlpy.Model(smol)
    want = [t.id for t in api.chat(msgs, max_tokens=16)]
    assert want[-1] == 2 or len(want) == 16  # it stops at <|im_end|>
    r = cli("run", smol_dir, msgs[1]["content"], "--chat", "--system", msgs[0]["content"], "-n", "16", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == want and "Paris" in json.loads(r.stdout)["text"]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": msgs, "max_tokens": 16}) + "\n"
                   + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    r = cli("batch", smol_dir, src, "--quiet")
    recs = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.returncode == 1 and recs[0]["tokens"] == want and "`messages`[0]" in recs[1]["error"]


def test_chat_on_a_model_without_a_template_is_refused_or_takes_one(real_dir, tmp_path):
    r = cli("run", real_dir, "Hello", "--chat", "-n", "2")
    assert r.returncode == 2 and "no chat template" in r.stderr and "--chat-template" in r.stderr
    f = tmp_path / "t.jinja"
    f.write_text(GEMMA_STYLE)
    r = cli("run", real_dir, "Hello", "--chat", "--chat-template", f, "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    r = cli("run", real_dir, "Hello", "--system", "x", "-n", "2")
    assert r.returncode == 2 and "--system and --chat-template need --chat" in r.stderr


def test_session_turns_prefill_only_their_own_tokens(smol):
    s = ChatSession(smol, gen=smol_gen())
    for text in ("What is the capital of France?", "And of Italy?", "Which of the two is larger?"):
        s.reply(text)
    first, second, third = s.turns
    assert first.prefilled_tokens == first.prompt_tokens
    for before, t in ((first, second), (second, third)):
        # the state held the whole previous conversation but its last sampled token (the end of turn)
        assert t.prefilled_tokens == t.prompt_tokens - (before.prompt_tokens + before.generated_tokens - 1)
        assert 0 < t.prefilled_tokens < 30
    assert [m["role"] for m in s.messages] == ["user", "assistant"] * 3
    assert "Paris" in s.messages[1]["content"] and "Rome" in s.messages[3]["content"]


def smol_gen():
    from larqlpy.config import GenerationConfig

    return GenerationConfig(max_tokens=24)


def test_the_repl_through_a_pipe_and_resume_in_another_process(smol_dir, tmp_path):
    saved = tmp_path / "c.kv"
    script = "\n".join(["What is the capital of France?", "And of Italy?", "/stats", f"/save {saved}",
                        "Which of the two is larger?", "/stats", "/quit"]) + "\n"
    r = cli("chat", smol_dir, "-n", "24", "--json", stdin=script)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    turns = [x for x in lines if "turn" in x]
    stats = [x for x in lines if "turns" in x]
    assert len(turns) == 3 and [len(s["turns"]) for s in stats] == [2, 3]
    assert turns[0]["prefilled_tokens"] == turns[0]["prompt_tokens"]
    assert all(t["prefilled_tokens"] < 30 for t in turns[1:]) and stats[-1]["turns"][2]["prefilled_tokens"] < 30
    assert "Paris" in turns[0]["text"] and "Rome" in turns[1]["text"]
    # a new process continues the saved conversation: the third turn as if it had never stopped
    r2 = cli("chat", smol_dir, "-n", "24", "--json", "--resume", saved, stdin="Which of the two is larger?\n")
    assert r2.returncode == 0, r2.stderr
    resumed = [json.loads(line) for line in r2.stdout.splitlines()]
    assert resumed[0]["tokens"] == turns[2]["tokens"] and resumed[0]["prefilled_tokens"] == turns[2]["prefilled_tokens"]


def test_repl_commands_and_errors_keep_the_session(smol_dir, tmp_path):
    script = "/stats\n/load " + str(tmp_path / "none.kv") + "\n/bogus\nHi\n/reset\n/stats\n"
    r = cli("chat", smol_dir, "-n", "4", "--json", stdin=script)
    errors = [line for line in r.stderr.splitlines() if line.startswith("larqlpy: error:")]
    assert len(errors) == 2 and "no such state file" in errors[0] and "unknown command '/bogus'" in errors[1]
    assert "Traceback" not in r.stderr and r.returncode == 1  # a pipe is told something failed
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert out[0]["turns"] == [] and any("turn" in x for x in out) and out[-1]["turns"] == []
