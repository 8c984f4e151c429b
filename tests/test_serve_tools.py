"""Tool calls through `larqlpy serve` and the official openai client, on Qwen2.5-Coder-0.5B-Instruct
(whose template renders tools): auto, required and named, streamed and whole, and a round trip
with a `tool` message that reuses the first request's kept state."""

from __future__ import annotations

import json

import openai
import pytest

from serving import Server
from test_tools import ASK, TOOLS, check_call

NAME = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def client(qwen_dir):
    with Server(qwen_dir, "--weights", "native", "--parallel", "2") as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)


def streamed(client, **kw) -> tuple[str, list[dict], str]:
    """A streamed answer put back together: its content, its calls (OpenAI's shape) and its finish."""
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(model=NAME, stream=True, **kw):
        delta = ch.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "type": "function", "function": {"name": "",
                                                                                          "arguments": ""}})
            call["id"] = tc.id or call["id"]
            call["function"]["name"] += (tc.function.name or "") if tc.function else ""
            call["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def as_dicts(message) -> list[dict]:
    return [c.model_dump() for c in message.tool_calls or []]


@pytest.mark.parametrize("choice, name", [("required", None), ({"type": "function", "function": {
    "name": "get_time"}}, "get_time")])
def test_a_required_call_parses_every_time_streamed_or_not(client, choice, name):
    for seed in (0, 1, 2):
        c = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0,
                                           seed=seed, max_tokens=80)
        assert c.choices[0].finish_reason == "tool_calls" and c.choices[0].message.content is None
        for call in as_dicts(c.choices[0].message):
            check_call(call, name)
        content, calls, finish = streamed(client, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0,
                                          seed=seed, max_tokens=80)
        assert finish == "tool_calls" and content == "" and calls
        for call in calls:
            check_call(call, name)
        assert [x["function"] for x in calls] == [x["function"] for x in as_dicts(c.choices[0].message)]


def test_auto_round_trip_reuses_the_kept_state(client):
    first = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert check_call(as_dicts(msg)[0], "get_weather")["city"] == "Paris"
    content, calls, finish = streamed(client, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60)
    assert finish == "tool_calls" and [c["function"] for c in calls] == [c["function"] for c in as_dicts(msg)]
    turn = [*ASK, msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": json.dumps({"temperature_c": 18})}]
    second = client.chat.completions.create(model=NAME, messages=turn, tools=TOOLS, temperature=0, max_tokens=40)
    assert second.choices[0].finish_reason == "stop" and "18" in second.choices[0].message.content
    assert not second.choices[0].message.tool_calls
    # the conversation so far was held: at least the first request's prompt is not prefilled again
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    none = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="none", temperature=0,
                                          max_tokens=16)
    assert none.choices[0].finish_reason != "tool_calls" and not none.choices[0].message.tool_calls
