"""Tool calls: the request's tools and choice, the convention per template family, the prompt as
transformers renders it, the grammar that forces a call, the parsers (whole and streamed), and
calls made by the real models through run, batch lines and the Python API (the server's, through
the official openai client, are in test_serve_tools.py)."""

from __future__ import annotations

import dataclasses
import json
import random

import jsonschema
import pytest

from larqlpy.config import Grammar
from larqlpy.decode.constraint import Constraint, Vocabulary, compile_grammar
from larqlpy.errors import LarqlError
from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute, execute_many
from larqlpy.text.chat_template import ChatTemplate
from larqlpy.text.tools import (CallStream, call_grammar, convention, read_reply, tag_tokens, template_messages,
                                 tool_use)
from test_chat import GEMMA_STYLE
from test_cli import assert_refused

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now in a time zone.",
                                          "parameters": {"type": "object", "properties": {
                                              "zone": {"type": "string", "maxLength": 32}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_call(call: dict, name: str | None = None) -> dict:
    """An OpenAI tool call whose arguments parse and validate against its function's parameters."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    fn = call["function"]
    assert fn["name"] in PARAMS and (name is None or fn["name"] == name)
    args = json.loads(fn["arguments"])
    jsonschema.validate(args, PARAMS[fn["name"]])
    return args


# -- the request -------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, needle", [
    ({"tools": []}, "`tools` must be a non-empty list"),
    ({"tools": [{"type": "function"}]}, "`tools`[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "`tools`[0].function.name must be"),
    ({"tools": [WEATHER, WEATHER]}, "names the function 'get_weather' twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "parameters must be a JSON"),
    ({"tools": TOOLS, "tool_choice": "always"}, "`tool_choice` is \"auto\""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "which `tools` does not"),
    ({"tool_choice": "required"}, "`tool_choice` needs `tools`"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "`parallel_tool_calls` must be a boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "json_schema": {}}, "a required tool call is a grammar of its own"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "thing"}}}],
      "tool_choice": "required"}, "`tools` cannot be compiled"),
    ({"messages": [*ASK, {"role": "assistant", "content": None}]}, "`messages`[1] must be an object"),
    ({"messages": [*ASK, {"role": "user", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
     "`messages`[1].tool_calls must be a non-empty list, on an assistant's message"),
])
def test_bad_tools_are_refused_in_one_line_before_any_weights(raw, needle):
    with pytest.raises(LarqlError) as e:
        Request.from_dict({"messages": ASK, **raw})
    assert needle in e.value.message and "\n" not in e.value.message


def test_tools_need_a_chat():
    with pytest.raises(LarqlError, match="`tools` need `messages`"):
        Request.from_dict({"prompt": "hi", "tools": TOOLS})


def test_each_template_family_has_its_convention(smol, qwen):
    assert ChatTemplate.for_tokenizer(qwen.tokenizer).convention == "hermes"
    assert ChatTemplate.for_tokenizer(smol.tokenizer).convention == "generic"
    assert convention(GEMMA_STYLE) == "generic"
    llama31 = ('{%- if tools is not none %}{{- "Given the following functions, please respond with a JSON for a '
               'function call" }}{%- endif %}{{- "<|python_tag|>" + tool_call.name }}{{- "<|eom_id|>" }}')
    assert convention(llama31) == "llama3"


# -- the prompt ----------------------------------------------------------------------------------------

ROUND_TRIP = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'}]


@pytest.fixture(scope="module")
def qwen_hf_tokenizer(qwen_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir))


@pytest.mark.parametrize("messages", [ASK, [{"role": "system", "content": "Be brief."}, *ASK], ROUND_TRIP])
def test_qwen_renders_tools_as_transformers_does(qwen, qwen_hf_tokenizer, messages):
    use = tool_use(TOOLS, "auto")
    ours = ChatTemplate.for_tokenizer(qwen.tokenizer).render(messages, tools=use)
    theirs_messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    theirs = qwen_hf_tokenizer.apply_chat_template(theirs_messages, tools=TOOLS, tokenize=False,
                                                   add_generation_prompt=True)
    assert ours == theirs
    assert '"name": "get_weather"' in ours and "<tools>" in ours
    if messages is ROUND_TRIP:
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in ours
        assert "<tool_response>\n{\"temperature\": 18" in ours


def test_a_template_without_tools_gets_them_in_its_system_message(smol):
    text = ChatTemplate.for_tokenizer(smol.tokenizer).render(ROUND_TRIP, tools=tool_use(TOOLS, "auto"))
    call = '<tool_call>\n{"name": "get_weather"'
    assert text.index("<tools>") < text.index("What is the weather") < text.index(call)
    assert "<tool_response>\n{\"temperature\": 18" in text and "<|im_start|>user\n<tool_response>" in text
    shaped = template_messages([*ROUND_TRIP, {"role": "tool", "content": "second"}], "generic", None)
    assert [m["role"] for m in shaped] == ["user", "assistant", "user"]  # the tool results are one turn
    assert shaped[2]["content"].count("<tool_response>") == 2
    none = ChatTemplate.for_tokenizer(smol.tokenizer).render(ASK, tools=tool_use(TOOLS, "none"))
    assert "<tools>" not in none


# -- the parsers ---------------------------------------------------------------------------------------

HERMES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, ["get_weather"]),
    ('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "Let me look.",
     ["get_time", "get_weather"]),
    ('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>', None,
     ["get_weather"]),  # arguments as a JSON string
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, ["get_weather"]),  # unclosed
    ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": "launch", '
     '"arguments": {}}\n</tool_call>', []),  # not one of the tools: content
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', '<tool_call>\n{"name": '
     '"get_weather", "arguments": {"city": }\n</tool_call>', []),  # not JSON: content
    ("It is sunny. <tool_ca", "It is sunny. <tool_ca", []),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None, ["get_weather"]),  # the tags left out
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
]
LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, ["get_weather"]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": '
     '{"city": "Lima"}}', None, ["get_time", "get_weather"]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"city": ', '{"name": "get_weather", "parameters": {"city": ', []),
]


def in_pieces(text: str, use, rng: random.Random, most: int = 7) -> list:
    """`text` fed to a CallStream in pieces of random size: the content and calls it gives out."""
    stream, parts, at = CallStream(use), [], 0
    while at < len(text):
        step = rng.randint(1, most)
        parts += stream.feed(text[at:at + step])
        at += step
    return parts + stream.close()


@pytest.mark.parametrize("conv, text, content, names", [("hermes", *c) for c in HERMES] +
                         [("llama3", *c) for c in LLAMA3])
def test_calls_are_read_back_per_family_whole_and_streamed(conv, text, content, names):
    use = dataclasses.replace(tool_use(TOOLS, "auto"), convention=conv)
    reply = read_reply(text, use)
    assert reply.content == content and [c["function"]["name"] for c in reply.calls] == names
    for c in reply.calls:
        check_call(c)
    rng = random.Random(len(text))
    for _ in range(5):  # the text in pieces of random size: the same content and calls
        parts = in_pieces(text, use, rng)
        assert [p["function"]["name"] for p in parts if isinstance(p, dict)] == names
        streamed = "".join(p for p in parts if isinstance(p, str))
        assert (streamed.strip() or None if names else streamed) == content
    assert read_reply(text, dataclasses.replace(use, choice="none")).content == text
    if len(names) > 1:
        assert len(read_reply(text, dataclasses.replace(use, parallel=False)).calls) == 1


# -- the grammar of a forced call ----------------------------------------------------------------------

def accepts(constraint: Constraint, ids: list[int]) -> bool:
    for t in ids:
        if not constraint.allowed()[t]:
            return False
        constraint.accept(t)
    return True


def test_a_forced_call_masks_all_but_a_valid_call(qwen):
    tok, vocab = qwen.tokenizer, Vocabulary.of(qwen.tokenizer, qwen.config.vocab_size)
    required = tool_use(TOOLS, "required")
    named = tool_use(TOOLS, {"type": "function", "function": {"name": "get_time"}})

    def fresh(use):
        return Constraint(vocab, compile_grammar(Grammar("grammar", call_grammar(use, tag_tokens(tok.ids_of)))))

    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    c = fresh(required)
    assert accepts(c, tok.encode(good, add_bos=False)) and c.matcher.is_accepting() and not c.done  # more may come
    two = good + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert accepts(fresh(required), tok.encode(two, add_bos=False))
    for bad in ('<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}',  # city is required
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "wind": 3}}',  # no such key
                '<tool_call>\n{"name": "get_weather",  "arguments"',  # another layout
                '<tool_call>\n{"name": "rm_rf"',
                'Sure! <tool_call>'):
        assert not accepts(fresh(required), tok.encode(bad, add_bos=False)), bad
    assert not accepts(fresh(named), tok.encode(good, add_bos=False))  # another function than the named one
    once = dataclasses.replace(required, parallel=False)
    c = fresh(once)
    assert accepts(c, tok.encode(good, add_bos=False)) and c.done  # one call, and only the end may follow


# -- the real models ------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice, name", [("required", None), pytest.param({"type": "function", "function": {
    "name": "get_time"}}, "get_time", marks=pytest.mark.heavy)])  # a named choice: test_serve_tools' too
def test_qwen_makes_a_forced_call_that_validates_sampled_or_greedy(qwen, choice, name):
    for seed in (None, 0):  # the server's test samples more (test_serve_tools.py)
        sampling = {"temperature": 1.0, "seed": seed} if seed is not None else {}
        r = execute(qwen, Request.from_dict({"messages": ASK, "tools": TOOLS, "tool_choice": choice,
                                             "max_tokens": 80, **sampling}))
        assert r["finish_reason"] == "tool_calls" and r["tool_calls"], r["text"]
        for call in r["tool_calls"]:
            check_call(call, name)
        assert r["content"] is None


def test_qwen_calls_the_tool_on_its_own_and_answers_from_the_result(qwen):
    first = execute(qwen, Request.from_dict({"messages": ASK, "tools": TOOLS, "max_tokens": 60}))
    assert first["finish_reason"] == "tool_calls"  # auto: the model's own choice, greedy
    assert check_call(first["tool_calls"][0], "get_weather")["city"] == "Paris"
    turn = [*ASK, {"role": "assistant", "content": first["content"], "tool_calls": first["tool_calls"]},
            {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": '{"temperature_c": 18}'}]
    second = execute(qwen, Request.from_dict({"messages": turn, "tools": TOOLS, "max_tokens": 40}))
    assert second["finish_reason"] == "stop" and not second["tool_calls"] and "18" in second["content"]
    none = execute(qwen, Request.from_dict({"messages": ASK, "tools": TOOLS, "tool_choice": "none",
                                            "max_tokens": 20}))
    assert "tool_calls" not in none["text"] and none["tool_calls"] == [] and none["finish_reason"] != "tool_calls"


@pytest.mark.parametrize("engine, options", [("canonical/v1", []),
                                             pytest.param("codec/v1", ["bits=4"], marks=pytest.mark.heavy)])
def test_a_template_without_tools_still_makes_a_valid_forced_call(smol, engine, options):
    r = execute(smol, Request.from_dict({"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                         "max_tokens": 80, "continuation": engine, "options": options}))
    assert r["finish_reason"] == "tool_calls", r["text"]
    check_call(r["tool_calls"][0])


def test_batch_lines_and_the_python_api_make_calls(smol, smol_dir):
    import larqlpy

    lines = [(i, Request.from_dict({"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80,
                                    "temperature": 1.0, "seed": i})) for i in range(4)]
    for _, r in execute_many(smol, lines, parallel=4):
        assert r["error"] is None and r["finish_reason"] == "tool_calls"
        check_call(r["tool_calls"][0])
    m = larqlpy.load(smol_dir, device="cpu")
    reply = m.respond(ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      max_tokens=80)
    assert reply["finish_reason"] == "tool_calls" and reply["content"] is None
    check_call(reply["tool_calls"][0], "get_weather")


def test_run_tools_from_the_command_line(cli, smol_dir, tmp_path):  # noqa: F811
    f = tmp_path / "tools.json"
    f.write_text(json.dumps(TOOLS))
    r = cli("run", str(smol_dir), "What time is it in Tokyo?", "--chat", "--tools", str(f), "--tool-choice",
            "get_time", "-n", "60", "--json")
    rc, out, err = r
    assert rc == 0, err
    out = json.loads(out)
    assert out["finish_reason"] == "tool_calls" and check_call(out["tool_calls"][0], "get_time")
    (tmp_path / "bad.json").write_text("[{")
    assert_refused(cli("run", str(smol_dir), "hi", "--chat", "--tools", str(tmp_path / "bad.json")), "--tools")
    assert_refused(cli("run", str(smol_dir), "hi", "--tools", str(f)), "--chat")
    assert_refused(cli("run", str(smol_dir), "hi", "--chat", "--tool-choice", "required"), "--tools")
