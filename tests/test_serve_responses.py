"""OpenAI's Responses API (/v1/responses) through `larqlpy serve` and the official openai client, on
Qwen2.5-Coder-0.5B-Instruct: a ten-turn chain on kept KV state (each turn prefills only its new
input) whose answers are the chat completions of the whole conversation, token for token; the
chain across a restart with a state directory, and rebuilt from the stored items when its state is
lost; the streamed events; a function-call round trip; structured output; stored responses and
errors."""

from __future__ import annotations

import json

import openai
import pytest

from serving import Server

NAME = "qwen2.5-coder-0.5b-instruct"
INSTRUCTIONS = "You answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?",
             "Name a river in the first.", "And in the second?", "What language is spoken in both?",
             "Name a famous dish of the first.", "And of the second?", "Which is older?", "Thank you!"]
GREEDY = {"temperature": 0, "max_output_tokens": 10}
ARGS = ("--weights", "native", "--parallel", "2")


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def turn(client, text: str, previous: str | None = None, **kw):
    return client.responses.create(model=NAME, input=text, instructions=INSTRUCTIONS, previous_response_id=previous,
                                   **{**GREEDY, **kw})


def held(r) -> int:
    """What the state a response leaves holds: its prompt and its output, but the last token sampled."""
    return r.usage.input_tokens + r.usage.output_tokens - 1


def test_a_chain_on_kept_state_across_restarts_and_rebuilt_when_lost(qwen_dir, tmp_path):
    state = tmp_path / "states"
    with Server(qwen_dir, *ARGS, "--state-dir", str(state)) as s:
        client, chain = client_of(s), []
        for q in QUESTIONS:
            chain.append(turn(client, q, chain[-1].id if chain else None))
        assert chain[0].usage.input_tokens_details.cached_tokens == 0
        for before, r in zip(chain, chain[1:]):  # each turn prefilled only what it added
            assert r.usage.input_tokens_details.cached_tokens == held(before), (before.usage, r.usage)
            assert r.usage.input_tokens - held(before) < 30
        assert "Paris" in chain[0].output_text
        assert client.responses.retrieve(chain[4].id).output_text == chain[4].output_text
    with Server(qwen_dir, *ARGS, "--state-dir", str(state)) as s:  # a restart: the chain goes on from disk
        client = client_of(s)
        after = turn(client, "Goodbye.", chain[-1].id)
        assert after.usage.input_tokens_details.cached_tokens == held(chain[-1])
        # each answer is the chat completion of the whole conversation so far, token for token
        messages = [{"role": "system", "content": INSTRUCTIONS}]
        for q, r in zip(QUESTIONS, chain):
            messages.append({"role": "user", "content": q})
            done = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
            assert done.model_extra["larqlpy"]["tokens"] == r.model_extra["larqlpy"]["tokens"], q
            messages.append({"role": "assistant", "content": r.output_text})
    for f in state.glob("*.lqkv"):  # the states are lost; the stored conversation rebuilds the chain
        f.unlink()
    with Server(qwen_dir, *ARGS, "--state-dir", str(state)) as s:
        again = turn(client_of(s), "Goodbye.", chain[-1].id)
        assert again.usage.input_tokens_details.cached_tokens == 0
        assert again.model_extra["larqlpy"]["tokens"] == after.model_extra["larqlpy"]["tokens"]


@pytest.fixture(scope="module")
def server(qwen_dir):
    with Server(qwen_dir, *ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return client_of(server)


def test_streamed_events_in_order_and_their_text_is_the_whole_answer(client):
    whole = turn(client, QUESTIONS[0], store=False)
    events = list(turn(client, QUESTIONS[0], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    last = events[-1].response
    assert text == whole.output_text == last.output_text and last.status == "completed"
    assert last.output[0].id == events[2].item.id and client.responses.retrieve(last.id).output_text == text
    with pytest.raises(openai.NotFoundError):  # store: false keeps nothing
        client.responses.retrieve(whole.id)


WEATHER = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def test_a_function_call_round_trip_streamed_then_chained(client):
    ask = {"input": "What is the weather in Paris?", "tools": WEATHER, "tool_choice": "required",
           "temperature": 0, "max_output_tokens": 40}
    events = list(client.responses.create(model=NAME, stream=True, **ask))
    first = events[-1].response
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    kinds = [e.type for e in events[2:-1]]
    assert kinds == ["response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done"]
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}
    follow = {"role": "user", "content": "So, how warm is it there? Answer in words."}
    second = client.responses.create(model=NAME, input=[result, follow], previous_response_id=first.id,
                                     tools=WEATHER, temperature=0, max_output_tokens=24)
    assert "24" in second.output_text, second.output_text
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # the same conversation given whole, as items, is the same answer
    items = [{"role": "user", "content": ask["input"]},
             {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
              "arguments": calls[0].arguments}, result, follow]
    whole = client.responses.create(model=NAME, input=items, tools=WEATHER, temperature=0, max_output_tokens=24)
    assert whole.output_text == second.output_text


def test_a_json_schema_answer(client):
    fmt = {"type": "json_schema", "name": "city", "strict": True, "schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"], "additionalProperties": False}}
    r = client.responses.create(model=NAME, input="The capital of France, as JSON.", text={"format": fmt},
                                temperature=0, max_output_tokens=40)
    assert set(json.loads(r.output_text)) == {"city", "country"} and r.text.format.type == "json_schema"


BAD = [  # (what, body, status, text in the message)
    ("no input", {}, 400, "'input' must be a non-empty"),
    ("an image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "'input_image': this model reads text only"),
    ("a web search tool", {"input": "hi", "tools": [{"type": "web_search"}]}, 400, "function tools only"),
    ("no tokens", {"input": "hi", "max_output_tokens": 0}, 400, "'max_output_tokens' must be >= 1"),
    ("an unknown previous", {"input": "hi", "previous_response_id": "resp_" + "0" * 32}, 404, "is not stored here"),
    ("an output for no call", {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
     400, "no function_call before it"),
    ("background", {"input": "hi", "background": True}, 400, "'background' is not supported"),
    ("a bad format", {"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "'text'.format must be"),
    ("stream not boolean", {"input": "hi", "stream": 0}, 400, "'stream' must be a boolean"),
]


@pytest.mark.parametrize("what, body, status, text", BAD, ids=[b[0] for b in BAD])
def test_errors_in_openais_shape(server, what, body, status, text):
    r = server.post("/v1/responses", {"model": NAME, **body})
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"], r.json()


def test_a_stored_response_is_read_and_deleted(client, server):
    r = turn(client, "Say hi.")
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    for rid in (r.id, "../../etc/passwd", "resp_x"):
        assert server.post("/v1/responses", {"model": NAME, "input": "hi", "previous_response_id": rid}
                           ).status_code == 404
