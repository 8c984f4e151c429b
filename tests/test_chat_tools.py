"""Tools, a JSON Schema and several answers a turn in a conversation: `larqlpy.load(...).session(...)`
(ChatSession) and `larqlpy chat --tools/--tool-choice/--json-schema/--choices`, on the reference
models (Qwen2.5-Coder-0.5B calls tools on its own; SmolLM2-135M under a grammar)."""

from __future__ import annotations

import json

import jsonschema
import pytest

import larqlpy
from larqlpy.errors import LarqlError
from test_chat import cli as subprocess_cli
from test_cli import assert_refused
from test_tools import ASK, TOOLS, check_call

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}


def test_a_session_calls_a_tool_takes_its_result_and_answers_on_the_same_state(qwen):
    s = larqlpy.Model(qwen).session(tools=TOOLS, max_tokens=60)
    first = s.respond(ASK[0]["content"])
    assert first["finish_reason"] == "tool_calls" and first["content"] is None
    call = first["tool_calls"][0]
    assert check_call(call, "get_weather")["city"] == "Paris"
    with pytest.raises(LarqlError, match="no tool call 'nope'"):
        s.tool_result("nope", "x")
    s.tool_result(call["id"], '{"temperature_c": 18}')
    second = s.respond()  # the answer to the result
    assert second["finish_reason"] == "stop" and "tool_calls" not in second and "18" in second["content"]
    assert [m["role"] for m in s.messages] == ["user", "assistant", "tool", "assistant"]
    assert s.messages[1]["tool_calls"] == first["tool_calls"]
    assert s.turns[1].prefilled_tokens < s.turns[1].prompt_tokens - s.turns[0].prompt_tokens + 10  # the state held
    with pytest.raises(LarqlError, match="needs a message, or tool results"):
        s.respond()
    forced = larqlpy.Model(qwen).session(tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "get_time"}}, max_tokens=60)
    check_call(forced.respond("Hello!")["tool_calls"][0], "get_time")


def test_session_and_respond_refuse_bad_tools_before_any_work(smol):
    m = larqlpy.Model(smol)
    with pytest.raises(LarqlError, match="`tools`\\[0\\] must be"):
        m.session(tools=[{"type": "function"}])
    with pytest.raises(LarqlError, match="a required tool call is a grammar of its own"):
        m.session(tools=TOOLS, tool_choice="required", json_schema=CITY)
    with pytest.raises(LarqlError, match="`n` must be in 1..16"):
        m.session(n=17)


def test_n_answers_under_a_json_schema_from_respond_and_a_session(smol):
    m = larqlpy.Model(smol)
    ask = [{"role": "user", "content": "Name a city in France, as JSON."}]
    reply = m.respond(ask, n=3, json_schema=CITY, temperature=1.0, seed=1, max_tokens=30)
    assert len(reply["choices"]) == 3 and reply["content"] == reply["choices"][0]["content"]
    for c in reply["choices"]:
        jsonschema.validate(json.loads(c["content"]), CITY)
    s = m.session(n=2, json_schema=CITY, temperature=1.0, seed=3, max_tokens=30)
    answers = s.respond(ask[0]["content"])["choices"]
    assert len(answers) == 2 and s.messages[-1]["content"] == answers[0]["content"]
    picked = s.pick(1)
    assert s.messages[-1]["content"] == answers[1]["content"] == picked["content"]
    jsonschema.validate(json.loads(s.respond("And one in Italy?")["content"]), CITY)  # the conversation goes on
    with pytest.raises(LarqlError, match="pick 0..1"):
        s.pick(2)
    with pytest.raises(LarqlError, match="ask `respond`"):
        next(s.send("streamed?"))


def test_chat_refuses_bad_files_in_one_line_before_the_model_loads(cli, tmp_path):  # noqa: F811
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    good = tmp_path / "tools.json"
    good.write_text(json.dumps(TOOLS))
    nowhere = tmp_path / "no-model"  # refused before it is looked for
    assert_refused(cli("chat", nowhere, "--tools", bad), "--tools", "not JSON")
    assert_refused(cli("chat", nowhere, "--tools", tmp_path / "missing.json"), "--tools")
    assert_refused(cli("chat", nowhere, "--tool-choice", "required"), "--tool-choice needs --tools")
    assert_refused(cli("chat", nowhere, "--tools", good, "--tool-choice", "nope"), "names the function 'nope'")
    assert_refused(cli("chat", nowhere, "--json-schema", bad), "--json-schema")
    assert_refused(cli("chat", nowhere, "--choices", "0"), "--n must be in 1..16")


def test_chat_through_a_pipe_calls_a_tool_and_answers_its_result(qwen_dir, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    script = ASK[0]["content"] + '\n{"temperature_c": 18}\n/stats\n'
    r = subprocess_cli("chat", qwen_dir, "--tools", tools, "-n", "60", "--json", stdin=script)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    first, second, stats = lines
    assert first["finish_reason"] == "tool_calls" and check_call(first["tool_calls"][0], "get_weather")
    assert second["turn"] == 2 and "tool_calls" not in second and "18" in second["text"]
    assert second["prefilled_tokens"] < second["prompt_tokens"] - first["prompt_tokens"] + 10
    assert stats["messages"] == 4


def test_chat_choices_under_a_json_schema(smol_dir, tmp_path):
    schema = tmp_path / "city.json"
    schema.write_text(json.dumps(CITY))
    r = subprocess_cli("chat", smol_dir, "--json-schema", schema, "--choices", "2", "--temperature", "1", "--seed",
                       "0", "-n", "30", "--json", stdin="Name a city in France, as JSON.\n")
    assert r.returncode == 0, r.stderr
    (turn,) = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(turn["choices"]) == 2
    for c in turn["choices"]:
        jsonschema.validate(json.loads(c["content"]), CITY)
    r = subprocess_cli("chat", smol_dir, "--n", "2", "-n", "8", stdin="Hi\n")  # as text: each numbered
    assert r.returncode == 0 and r.stdout.startswith("[1] ") and "\n[2] " in r.stdout, r.stdout + r.stderr
