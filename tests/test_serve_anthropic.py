"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) through `larqlpy serve` and the
official anthropic client, on Qwen2.5-Coder-0.5B-Instruct (whose template renders tools): the same
answers as chat completions, streamed events in order, a tool round trip shaped like Claude
Code's, stop reasons, token counts and errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from serving import Server

NAME = "qwen2.5-coder-0.5b-instruct"
KEY = "sk-test"
SYSTEM = "You answer in one short sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the current client has no sampling fields; the API still takes them


@pytest.fixture(scope="module")
def server(qwen_dir):
    with Server(qwen_dir, "--weights", "native", "--parallel", "2", "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def chat(server, messages: list[dict], **kw) -> dict:
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": messages, **kw},
                    headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def sse(server, body: dict, key: str = KEY) -> list[tuple[str, dict]]:
    """A streamed message's events as they came: (event, data)."""
    out, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": key}, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out


def test_a_message_is_the_chat_completion_of_the_same_conversation(server, client):
    # thinking asked of a model that does not think (no markers in its template): nothing changes
    m = client.messages.create(model=NAME, max_tokens=12, system=SYSTEM, messages=ASK, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    c = chat(server, [{"role": "system", "content": SYSTEM}, *ASK], max_tokens=12, reasoning_effort="high", **GREEDY)
    assert m.model_extra["larqlpy"]["tokens"] == c["larqlpy"]["tokens"]  # token for token
    assert "reasoning_content" not in c["choices"][0]["message"]
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c["choices"][0]["message"]["content"]
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == NAME
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c["choices"][0]["finish_reason"]]
    assert m.usage.output_tokens == c["usage"]["completion_tokens"]
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert prompt == c["usage"]["prompt_tokens"] and m.usage.cache_creation_input_tokens == 0
    # the second asked the same prompt: the first one's kept state served it, and it says so
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for system in (SYSTEM, [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]):
        count = client.messages.count_tokens(model=NAME, system=system, messages=ASK)
        assert count.input_tokens == prompt


def test_streamed_events_in_order_and_their_text_is_the_whole_answer(server, client):
    ask = [{"role": "user", "content": [{"type": "text", "text": "Name two oceans."}]}]
    whole = client.messages.create(model=NAME, max_tokens=10, messages=ask, extra_body=GREEDY)
    events = sse(server, {"model": NAME, "max_tokens": 10, "messages": ask, **GREEDY})
    names = [e for e, _ in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas > 1
    assert all(name == data["type"] for name, data in events)
    text = "".join(d["delta"]["text"] for e, d in events if e == "content_block_delta")
    assert text == whole.content[0].text
    end = events[-2][1]
    assert end["delta"]["stop_reason"] == whole.stop_reason
    assert end["usage"]["output_tokens"] == whole.usage.output_tokens
    with client.messages.stream(model=NAME, max_tokens=10, messages=ask, extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == text
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == whole.usage.output_tokens
    # what a kept state held is told at the end, and the client's message takes it
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == events[0][1]["message"]["usage"][
        "input_tokens"]


def test_stop_sequences_and_max_tokens(client):
    count = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    full = client.messages.create(model=NAME, max_tokens=16, messages=count, extra_body=GREEDY)
    text = full.content[0].text
    stop = text.split()[2]  # a word inside the answer
    cut = client.messages.create(model=NAME, max_tokens=16, messages=count, stop_sequences=["zzz", stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]
    short = client.messages.create(model=NAME, max_tokens=3, messages=count, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3 and short.stop_sequence is None
    assert text.startswith(short.content[0].text)


# -- a tool round trip shaped like Claude Code's: a long system prompt in blocks, tools with JSON
# schemas as it writes them, a reminder block beside the user's words, streamed --

RULES = [
    "You are an interactive command line tool that helps users with software engineering tasks.",
    "Use the instructions below and the tools available to you to assist the user.",
    "Be concise, direct, and to the point. Answer the user's question without preamble.",
    "When you run a non-trivial command, explain what it does and why you are running it.",
    "Never guess the contents of a file: read it with the Read tool before you describe it.",
    "To find files by name, use the Glob tool; to run shell commands, use the Bash tool.",
    "Prefer editing existing files to creating new ones, and never create documentation unasked.",
    "Follow the conventions of the code you work in: its style, its libraries, its naming.",
    "Do not add comments to code unless asked; keep changes small and focused on the task.",
    "When a task needs several steps, do them one at a time and check each result.",
    "If a command fails, read its error, fix the cause, and try again; do not repeat it unchanged.",
    "Never commit changes unless the user explicitly asks you to.",
]
SYSTEM_BLOCKS = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
    {"type": "text", "text": "\n\n".join(RULES * 3) + "\n\nWorking directory: /home/user/project\nPlatform: linux",
     "cache_control": {"type": "ephemeral"}},
]


def schema(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#"}


CODE_TOOLS = [
    {"name": "Bash", "description": "Executes a given bash command in a persistent shell session and returns its "
                                    "output. Use it for terminal operations like git, ls and running scripts.",
     "input_schema": schema({"command": {"type": "string", "description": "The command to execute"},
                             "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
                             "description": {"type": "string", "description": "What the command does, in 5-10 "
                                                                             "words"}}, ["command"])},
    {"name": "Read", "description": "Reads a file from the local filesystem. The file_path must be absolute.",
     "input_schema": schema({"file_path": {"type": "string", "description": "The absolute path of the file"},
                             "offset": {"type": "number"}, "limit": {"type": "number"}}, ["file_path"])},
    {"name": "Glob", "description": "Fast file pattern matching, e.g. \"**/*.py\"; returns matching paths.",
     "input_schema": schema({"pattern": {"type": "string"}, "path": {"type": "string"}}, ["pattern"])},
]
REMINDER = "<system-reminder>\nThe user's project is a small Python package.\n</system-reminder>"
TASK = {"role": "user", "content": [{"type": "text", "text": REMINDER},
                                    {"type": "text", "text": "Run the ls command to list the files here."}]}


def streamed_message(server, body: dict) -> tuple[list[tuple[str, dict]], list[dict], dict, dict]:
    """A streamed message put back together: its events, its blocks, message_start's and message_delta's data."""
    events = sse(server, {"model": NAME, "system": SYSTEM_BLOCKS, "tools": CODE_TOOLS, **body})
    blocks: dict[int, dict] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks[data["index"]] = {**data["content_block"], "json": ""}
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            else:
                block["json"] += delta["partial_json"]
    out = []
    for i in sorted(blocks):
        b = blocks[i].copy()
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("json"))
        else:
            b.pop("json")
        out.append(b)
    return events, out, events[0][1], [d for e, d in events if e == "message_delta"][0]


def test_a_claude_code_shaped_tool_round_trip_streamed(server, client):
    # a 0.5B model left to choose writes its call as a markdown block: `any` has it call (a grammar of
    # the tools' schemas), as a larger model would unasked
    first = {"max_tokens": 60, "messages": [TASK], "tool_choice": {"type": "any"}, **GREEDY}
    events, blocks, start, end = streamed_message(server, first)
    assert end["delta"]["stop_reason"] == "tool_use" and [b["type"] for b in blocks] == ["tool_use"], blocks
    call = blocks[0]
    assert call["name"] == "Bash" and call["id"].startswith("toolu_") and call["input"]["command"].startswith("ls")
    # the call goes out once it is whole: its block opens with an empty input, then the input in one delta
    # (keep-alive pings may come between any two events while a slow machine prefills)
    events = [events[0], *[(e, d) for e, d in events[1:] if e != "ping"]]
    assert [e for e, _ in events[1:]] == ["content_block_start", "content_block_delta", "content_block_stop",
                                          "message_delta", "message_stop"]
    assert events[1][1]["content_block"]["input"] == {} and events[2][1]["delta"]["type"] == "input_json_delta"
    whole = client.messages.create(model=NAME, max_tokens=60, system=SYSTEM_BLOCKS, tools=CODE_TOOLS,
                                   messages=[TASK], tool_choice={"type": "any"}, extra_body=GREEDY)
    assert whole.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in whole.content if b.type == "tool_use"] == [("Bash", call["input"])]
    first_prompt = start["message"]["usage"]["input_tokens"]
    assert client.messages.count_tokens(model=NAME, system=SYSTEM_BLOCKS, tools=CODE_TOOLS,
                                        messages=[TASK]).input_tokens == first_prompt > 600
    turn = [TASK, {"role": "assistant", "content": blocks},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                          "content": "README.md\nlarql\npyproject.toml\ntests"},
                                         {"type": "text", "text": "Which of these is the tests folder?"}]}]
    events, blocks, start, end = streamed_message(server, {"max_tokens": 24, "messages": turn, **GREEDY})
    assert end["delta"]["stop_reason"] in ("end_turn", "max_tokens") and [b["type"] for b in blocks] == ["text"]
    assert "tests" in blocks[0]["text"], blocks
    # the first turn's kept state served the second: its prompt was not prefilled again
    assert end["usage"]["cache_read_input_tokens"] >= first_prompt
    assert end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"] == start["message"]["usage"][
        "input_tokens"]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
BAD = [  # (what, path, body, headers, status, error type, text in the message)
    ("no max_tokens", "", {"messages": ASK}, {}, 400, "invalid_request_error", "'max_tokens' is required"),
    ("stream not boolean", "", {"max_tokens": 4, "messages": ASK, "stream": "yes"}, {}, 400, "invalid_request_error",
     "'stream' must be a boolean"),
    ("a system message", "", {"max_tokens": 4, "messages": [{"role": "system", "content": "Be brief."}, *ASK]}, {},
     400, "invalid_request_error", "top-level 'system'"),
    ("a bad role", "", {"max_tokens": 4, "messages": [{"role": "tool", "content": "hi"}]}, {}, 400,
     "invalid_request_error", "has the role 'tool'"),
    ("an image", "", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        IMAGE, {"type": "text", "text": "What is this?"}]}]}, {}, 400, "invalid_request_error",
     "'messages'[0].content[0]: image blocks are not supported"),
    ("an image counted", "/count_tokens", {"messages": [{"role": "user", "content": [IMAGE]}]}, {}, 400,
     "invalid_request_error", "image blocks are not supported"),
    ("a server tool", "", {"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305",
                                                                         "name": "web_search"}]}, {}, 400,
     "invalid_request_error", "server tool"),
    ("tool_choice naming no tool", "", {"max_tokens": 4, "messages": ASK, "tools": CODE_TOOLS,
                                         "tool_choice": {"type": "tool", "name": "Write"}}, {}, 400,
     "invalid_request_error", "'Write'"),
    ("an answer to continue", "", {"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "It"}]},
     {}, 400, "invalid_request_error", "prefilled"),
    ("temperature past 1", "", {"max_tokens": 4, "messages": ASK, "temperature": 1.5}, {}, 400,
     "invalid_request_error", "'temperature' must be in"),
    ("unknown model", "", {"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": ASK}, {}, 404,
     "not_found_error", "does not exist"),
    ("wrong key", "", {"max_tokens": 4, "messages": ASK}, {"x-api-key": "sk-wrong"}, 401, "authentication_error",
     "API key"),
    ("no key", "", {"max_tokens": 4, "messages": ASK}, {"x-api-key": None}, 401, "authentication_error", "API key"),
    ("unknown route", "/batches", {"max_tokens": 4, "messages": ASK}, {}, 404, "not_found_error", ""),
]


@pytest.mark.parametrize("what, path, body, headers, status, kind, text", BAD, ids=[b[0] for b in BAD])
def test_errors_in_anthropics_shape(server, what, path, body, headers, status, kind, text):
    headers = {k: v for k, v in {"x-api-key": KEY, **headers}.items() if v is not None}
    r = server.post("/v1/messages" + path, {"model": NAME, **body}, headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    assert r.json()["error"]["type"] == kind and text in r.json()["error"]["message"], r.text


def test_the_client_reads_the_errors_and_a_bearer_token_is_a_key(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [IMAGE]}])
    assert "image blocks are not supported" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=NAME, max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)  # Claude Code's AUTH_TOKEN
    assert bearer.messages.count_tokens(model=NAME, messages=ASK).input_tokens > 0


# -- without a model: the body as the pipeline's request, and the events a text makes --

def test_a_body_reads_into_the_chat_pipelines_request():
    from larqlpy.server.anthropic import read_request

    body = {"max_tokens": 8, "system": [{"type": "text", "text": "A."}, {"type": "text", "text": "B."}],
            "stop_sequences": ["\n\n"], "top_k": 5, "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"},
            "tools": CODE_TOOLS[:1], "tool_choice": {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
            "messages": [
                {"role": "user", "content": "ls?"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"},
                                                  {"type": "text", "text": "Listing."},
                                                  {"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                   "input": {"command": "ls"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                              "content": [{"type": "text", "text": "no such dir"}]},
                                             {"type": "text", "text": "Try again."}]}]}
    req = read_request(body)
    assert list(req.messages) == [
        {"role": "system", "content": "A.\n\nB."}, {"role": "user", "content": "ls?"},
        {"role": "assistant", "content": "Listing.", "reasoning_content": "...", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "content": "Error: no such dir", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "Try again."}]
    assert req.thinking is False and req.gen.thinking_budget is None  # thinking disabled
    assert req.gen.stop == ("\n\n",) and req.gen.max_tokens == 8 and req.gen.sampling.top_k == 5
    assert req.gen.sampling.temperature == 1.0  # Anthropic's default
    assert req.tools.name == "Bash" and req.tools.forced and not req.tools.parallel
    assert req.tools.tools[0]["function"]["parameters"] == CODE_TOOLS[0]["input_schema"]
    assert read_request({"messages": ASK}, counting=True).gen.max_tokens == 0  # count_tokens gives none
    fmt = {"max_tokens": 8, "messages": ASK, "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}}}, "effort": "low"}}
    assert read_request(fmt).gen.grammar.kind == "json_schema"


class FakeSeq:
    """What anthropic.Events reads of a finished sequence."""

    def __init__(self, tools=None, stop_string=None, finish="stop"):
        from types import SimpleNamespace

        self.request = SimpleNamespace(tools=tools, reasoning=None)
        self.prompt_ids, self.output, self.state, self.finish_reason = [1] * 7, [2] * 3, None, finish
        self.out = SimpleNamespace(stop_string=stop_string)


def test_events_hold_blank_text_before_a_call_and_close_each_block():
    from larqlpy.server.anthropic import error_event, read_request
    from larqlpy.server.anthropic_events import Events

    tools = read_request({"max_tokens": 8, "messages": ASK, "tools": CODE_TOOLS}).tools
    seq = FakeSeq(tools)
    ev = Events("msg_x", NAME, seq)
    out = ev.start()
    for part in ["Let me look.", "\n", "<tool_call>\n", '{"name": "Glob", "arguments": {"pattern": "*"}}',
                 "\n</tool_call>", "\n"]:
        out += ev.feed(part)
    out += ev.finish(seq)
    assert [(e, d.get("index")) for e, d in out] == [
        ("message_start", None), ("ping", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_delta", 0), ("content_block_stop", 0), ("content_block_start", 1),
        ("content_block_delta", 1), ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert out[6][1]["content_block"]["name"] == "Glob" and out[7][1]["delta"]["partial_json"] == '{"pattern": "*"}'
    assert out[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2][1]["usage"] == {"input_tokens": 7, "output_tokens": 3, "cache_read_input_tokens": 0,
                                   "cache_creation_input_tokens": 0}
    plain = FakeSeq(stop_string="END")
    ev = Events("msg_y", NAME, plain)
    out = ev.feed("  ") + ev.finish(plain)  # blank text alone is the answer's text
    assert out[0][1]["content_block"] == {"type": "text", "text": ""} and out[1][1]["delta"]["text"] == "  "
    assert out[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert error_event("boom") == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})
