"""`larqlpy serve` against a live server on 127.0.0.1: the official openai client, concurrency,
prefix reuse, budgets, restarts and bad requests."""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from larqlpy.weights.loader import load
from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute
from serving import ENV, EXE, Server

NAME = "smollm2-135m-instruct"
CHAT = [{"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol8(smol_dir):
    return load(smol_dir, device="cpu", weights="int8")


@pytest.fixture(scope="module")
def server(smol_dir, tmp_path_factory):
    with Server(smol_dir, "--weights", "int8", "--parallel", "4", "--api-key", "sk-test") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)


def alone(smol8, **req) -> dict:
    return execute(smol8, Request.from_dict(req))


def test_completions_and_chat_through_the_openai_client_equal_larqlpy_run(client, smol_dir, smol8):
    c = client.completions.create(model=NAME, prompt="The three primary colors are", max_tokens=12, temperature=0)
    run = subprocess.run([*EXE, "run", str(smol_dir), "The three primary colors are", "-n", "12", "--weights", "int8",
                          "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    want = json.loads(run.stdout)
    assert c.choices[0].text == want["text"] and c.model_extra["larqlpy"]["tokens"] == want["tokens"]
    assert c.model_extra["larqlpy"]["compile_seconds"] >= 0  # kernels compiled inside it, apart from its time
    assert c.usage.completion_tokens == 12 and c.choices[0].finish_reason == "length"
    parts = client.completions.create(model=NAME, prompt="The three primary colors are", max_tokens=12,
                                      temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in parts) == want["text"]

    chat = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=20, temperature=0)
    ref = alone(smol8, messages=CHAT, max_tokens=20)
    assert chat.choices[0].message.content == ref["text"] and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == ref["finish_reason"]
    other = [{"role": "user", "content": "Name two oceans."}]  # shares too little with CHAT to reuse its state
    ref = alone(smol8, messages=other, max_tokens=20)
    streamed = client.chat.completions.create(model=NAME, messages=other, max_tokens=20, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref["text"]
    assert chunks[-1].usage.completion_tokens == len(ref["tokens"])


def test_stop_and_seed(client, smol8):
    full = client.completions.create(model=NAME, prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert "," in text
    stopped = client.completions.create(model=NAME, prompt="Count: one, two, three,", max_tokens=16, temperature=0,
                                        stop=[","])
    assert stopped.choices[0].text == text[:text.index(",")] and stopped.choices[0].finish_reason == "stop"
    a, b = (client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, temperature=0.9,
                                      seed=11) for _ in range(2))
    ref = alone(smol8, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=11)
    assert a.choices[0].text == b.choices[0].text == ref["text"]


def test_eight_concurrent_clients_each_get_what_they_get_alone(server, smol8):
    prompts = [f"Question {i}: name a {w}. Answer:" for i, w in
               enumerate(["fruit", "river", "planet", "metal", "bird", "city", "color", "tree"])]
    want = [alone(smol8, prompt=p, max_tokens=10 + i)["tokens"] for i, p in enumerate(prompts)]

    def ask(i):
        r = server.post("/v1/completions", {"model": NAME, "prompt": prompts[i], "max_tokens": 10 + i,
                                            "temperature": 0},
                        headers={"Authorization": "Bearer sk-test"})
        return r.json()["larqlpy"]["tokens"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == want


def test_a_second_turn_reuses_the_first_turns_state(client):
    first = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, temperature=0)
    turn = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model=NAME, messages=turn, max_tokens=16, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0.6 * second.usage.prompt_tokens and second.model_extra["larqlpy"]["cached_tokens"] == cached


BAD = [  # (what, body or raw bytes, headers, status, text in the message)
    ("not JSON", b"{nope", {}, 400, "not valid JSON"),
    ("not an object", b"[1, 2]", {}, 400, "must be a JSON object"),
    ("not UTF-8", b'{"model": "\xff"}', {}, 400, "not UTF-8"),
    ("no model", {"prompt": "hi"}, {}, 400, "'model' is required"),
    ("unknown model", {"model": "gpt-9", "prompt": "hi"}, {}, 404, "does not exist"),
    ("no prompt", {"model": NAME}, {}, 400, "'prompt' must be"),
    ("prompt a number", {"model": NAME, "prompt": 3}, {}, 400, "'prompt' must be"),
    ("negative max_tokens", {"model": NAME, "prompt": "hi", "max_tokens": -1}, {}, 400, "must be >= 0"),
    ("huge max_tokens", {"model": NAME, "prompt": "hi", "max_tokens": 10**9}, {}, 400, "at most"),
    ("max_tokens a string", {"model": NAME, "prompt": "hi", "max_tokens": "5"}, {}, 400, "must be an integer"),
    ("temperature out of range", {"model": NAME, "prompt": "hi", "temperature": 7}, {}, 400,
     "'temperature' must be in"),
    ("top_p zero", {"model": NAME, "prompt": "hi", "top_p": 0}, {}, 400, "'top_p' must be in"),
    ("n of 17", {"model": NAME, "prompt": "hi", "n": 17}, {}, 400, "'n' must be in 1..16"),
    ("stop a number", {"model": NAME, "prompt": "hi", "stop": 5}, {}, 400, "'stop' must be"),
    ("logprobs past 20", {"model": NAME, "prompt": "hi", "logprobs": 21}, {}, 400, "'logprobs' must be in 0..20"),
    ("top_logprobs without logprobs", {"model": NAME, "messages": CHAT, "top_logprobs": 2}, {"chat": True}, 400,
     "'top_logprobs' needs 'logprobs'"),
    ("a schema that is no schema", {"model": NAME, "messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "thing"}}}}, {"chat": True}, 400,
     "'response_format' cannot be compiled"),
    ("a regex that does not compile", {"model": NAME, "prompt": "hi", "larqlpy": {"regex": "[a-"}}, {}, 400,
     "'regex' cannot be compiled"),
    ("two grammars", {"model": NAME, "prompt": "hi", "response_format": {"type": "json_object"},
                      "larqlpy": {"regex": "a+"}}, {}, 400, "give one of"),
    ("logit_bias id past the vocabulary", {"model": NAME, "prompt": "hi", "logit_bias": {"99999999": 1}}, {}, 400,
     "'logit_bias' names token id"),
    ("frequency_penalty past 2", {"model": NAME, "prompt": "hi", "frequency_penalty": 3}, {}, 400,
     "'frequency_penalty' must be in"),
    ("a tool with no function", {"model": NAME, "messages": CHAT, "tools": [{"type": "function"}]}, {"chat": True},
     400, "'tools'[0] must be"),
    ("tool_choice naming no tool", {"model": NAME, "messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, {"chat": True}, 400,
     "'tool_choice' names the function 'g'"),
    ("tools on completions", {"model": NAME, "prompt": "hi", "tools": [{"type": "function", "function": {
        "name": "f"}}]}, {}, 400, "'tools' need /v1/chat/completions"),
    ("a call's arguments not JSON", {"model": NAME, "messages": [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, {"chat": True}, 400,
     "'messages'[2].tool_calls[0].function.arguments must be a JSON object"),
    ("stream not boolean", {"model": NAME, "prompt": "hi", "stream": "yes"}, {}, 400, "'stream' must be a boolean"),
    ("bad engine option", {"model": NAME, "prompt": "hi", "larqlpy": {"continuation": "codec/v1",
                                                                     "options": {"bits": 11}}}, {}, 400, "bits"),
    ("unknown engine", {"model": NAME, "prompt": "hi", "larqlpy": {"continuation": "magic/v9"}}, {}, 400, "magic/v9"),
    ("token id past the vocabulary", {"model": NAME, "prompt": [1, 10**7]}, {}, 400, "token ids must be in"),
    ("prompt past the context", {"model": NAME, "prompt": "word " * 9000, "max_tokens": 1}, {}, 400, "context"),
    ("bad messages", {"model": NAME, "messages": [{"role": "user"}]}, {"chat": True}, 400, "'messages'[0]"),
    ("body over the limit", {"model": NAME, "prompt": "x" * (2 << 20)}, {}, 413, "over the limit"),
    ("no API key", {"model": NAME, "prompt": "hi"}, {"auth": None}, 401, "API key"),
    ("wrong API key", {"model": NAME, "prompt": "hi"}, {"auth": "Bearer sk-wrong"}, 401, "API key"),
    ("wrong method", None, {"get": True}, 405, ""),
    ("unknown route", {}, {"path": "/v1/audio/speech"}, 404, ""),
]


@pytest.mark.parametrize("what, body, opts, status, text", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_their_4xx_json_and_the_server_stays_up(server, what, body, opts, status, text):
    path = opts.get("path", "/v1/chat/completions" if opts.get("chat") else "/v1/completions")
    headers = {"Authorization": opts.get("auth", "Bearer sk-test")} if opts.get("auth", "x") is not None else {}
    if opts.get("get"):
        r = httpx.get(server.url + path, headers=headers, timeout=30)
    elif isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={**headers, "content-type": "application/json"},
                       timeout=30)
    else:
        r = server.post(path, body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and set(err) == {"message", "type", "param", "code"}
    ok = server.post("/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 2},
                     headers={"Authorization": "Bearer sk-test"})
    assert ok.status_code == 200


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog", "fish"]}, "name": {"type": "string", "maxLength": 16}},
        "required": ["kind", "name"], "additionalProperties": False}}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Invent a person with pets. Reply with JSON."}]


def test_response_format_and_logprobs_through_the_openai_client(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(3):
        c = client.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, temperature=1.0, seed=seed,
                                           max_tokens=200, logprobs=True, top_logprobs=3)
        text = c.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
        content = c.choices[0].logprobs.content
        assert len(content) == c.usage.completion_tokens and c.choices[0].finish_reason == "stop"
        assert b"".join(bytes(e.bytes) for e in content) == text.encode()
        assert all(e.logprob <= 0 and len(e.top_logprobs) <= 3 for e in content)
    chunks = list(client.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, temperature=0,
                                                 max_tokens=200, logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    jsonschema.validate(json.loads(streamed), PERSON)
    entries = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    whole = client.chat.completions.create(model=NAME, messages=ASK, response_format=fmt, temperature=0,
                                           max_tokens=200, logprobs=True)
    assert whole.choices[0].message.content == streamed
    assert [e.logprob for e in whole.choices[0].logprobs.content] == [e.logprob for e in entries]
    legacy = client.completions.create(model=NAME, prompt="The three primary colors are", max_tokens=8,
                                       temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert "".join(lp.tokens) == legacy.choices[0].text and len(lp.token_logprobs) == 8
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy


def test_json_object_and_penalties_through_the_server(client):
    # its own system message: no kept state of another test serves it (a prefix prefilled in other
    # chunks differs in the last bits, and greedy picks under penalties follow those)
    own = [{"role": "system", "content": "You reply with one short JSON object."}, *ASK]
    # json_object bounds nothing, so it is asked a question whose greedy answer is short on every CPU:
    # the closest pick is 0.76 nats clear (ASK's free invention has a near-tie, 0.004 nats, whose
    # rounding decides between a closed object and 160 tokens of one key)
    capital = [own[0], {"role": "user", "content": 'Give the capital of France as JSON with the key "capital".'}]
    c = client.chat.completions.create(model=NAME, messages=capital, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=160)
    assert c.choices[0].finish_reason == "stop" and json.loads(c.choices[0].message.content) == {"capital": "Paris"}
    # Penalties push a 135M model off its answer (into 160 tokens of one key on some CPUs' rounding),
    # so under them the grammar bounds the object: every output closes, and the penalties apply.
    bounded = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "pets": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["name", "pets"], "additionalProperties": False}
    kw = dict(model=NAME, messages=own, temperature=0, max_tokens=160,
              response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": bounded}})
    plain = client.chat.completions.create(**kw)
    c = client.chat.completions.create(**kw, frequency_penalty=1.5, presence_penalty=1.5,
                                       extra_body={"larqlpy": {"repetition_penalty": 1.3}})
    for got in (plain, c):
        assert got.choices[0].finish_reason == "stop"
        assert set(json.loads(got.choices[0].message.content)) == {"name", "pets"}
    r = client.completions.create(model=NAME, prompt="A phone number: ", max_tokens=20, temperature=0,
                                  extra_body={"larqlpy": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", r.choices[0].text)


def test_n_choices_from_one_prefill_streamed_or_not(client):
    kw = {"model": NAME, "messages": CHAT, "n": 3, "temperature": 0.9, "seed": 4, "max_tokens": 12}
    c = client.chat.completions.create(**kw, logprobs=True)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    assert len({ch.message.content for ch in c.choices}) > 1  # three seeds, three answers
    # the prompt counted once, every choice's tokens counted
    assert c.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in c.choices)
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert one.usage.prompt_tokens == c.usage.prompt_tokens  # (each choice's ids against its seed: test_fork.py)
    texts = {}
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        if chunk.usage is not None:
            assert chunk.usage.prompt_tokens == c.usage.prompt_tokens
            assert chunk.usage.completion_tokens == c.usage.completion_tokens
    assert [texts[i] for i in range(3)] == [ch.message.content for ch in c.choices]
    legacy = client.completions.create(model=NAME, prompt="Once upon a time", n=2, max_tokens=6, temperature=0)
    assert len(legacy.choices) == 2 and legacy.choices[0].text == legacy.choices[1].text  # greedy: the same


def test_routes_health_models_metrics(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # no key needed
    models = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer sk-test"}).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer sk-test"}).text
    for name in ("larqlpy_requests_total", "larqlpy_tokens_total", "larqlpy_live_sequences", "larqlpy_kept_bytes",
                 "larqlpy_kept_transitions_total", "larqlpy_prefix_cache_total", "larqlpy_compile_seconds_total",
                 "larqlpy_compiled_kernels_total"):
        assert name in text


def chat_turns(server, turns: list[str], history: list[dict] | None = None, **extra) -> tuple[list[dict], list[dict]]:
    """Each user turn in order after `history`, the assistant's greedy replies fed back; (the
    conversation, the responses)."""
    messages, out = list(history or [{"role": "system", "content": "You are brief."}]), []
    for t in turns:
        messages.append({"role": "user", "content": t})
        r = server.post("/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 12,
                                                 "temperature": 0, **extra}).json()
        out.append(r)
        messages.append({"role": "assistant", "content": r["choices"][0]["message"]["content"]})
    return messages, out


def ids(responses: list[dict]) -> list[list[int]]:
    return [r["larqlpy"]["tokens"] for r in responses]


TURNS = ["Name a large animal.", "Where does it live?", "What does it eat?"]
OTHERS = ["Tell me about the moon.", "Tell me about rivers.", "Tell me about snow."]


def test_memory_pressure_persists_states_and_they_come_back_the_same(smol_dir):
    # the budget holds the live sequence (a few MiB at these lengths) and the kept states beside it
    # (f16 rows, the default beside int8 weights)
    with Server(smol_dir, "--weights", "int8", "--kv-budget", "3MiB") as small, \
            Server(smol_dir, "--weights", "int8", "--kv-budget", "1GiB") as big:
        runs = []
        for s in (small, big):
            history, first = chat_turns(s, TURNS[:2])
            for o in OTHERS:  # other conversations push the first one out of memory on the small server
                chat_turns(s, [o])
            runs.append(first + chat_turns(s, TURNS[2:], history)[1])
        m = small.metrics()
        assert m['larqlpy_kept_transitions_total{from="ACTIVE",to="PERSISTED"}'] >= 1
        assert m['larqlpy_kept_transitions_total{from="PERSISTED",to="RECOVERING"}'] >= 1
        assert big.metrics().get('larqlpy_kept_transitions_total{from="ACTIVE",to="PERSISTED"}', 0) == 0
    assert ids(runs[0]) == ids(runs[1]) and runs[0][-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_past_the_disk_budget_the_least_recently_used_are_evicted(smol_dir, tmp_path):
    d = tmp_path / "kept"
    with Server(smol_dir, "--weights", "int8", "--kv-budget", "1536KiB", "--disk-budget", "3MiB",
                "--state-dir", str(d)) as s:
        for t in TURNS + OTHERS:
            chat_turns(s, [t])
        m = s.metrics()
        files = sum(f.stat().st_size for f in d.glob("*.lqkv"))
    assert m['larqlpy_kept_transitions_total{from="PERSISTED",to="EVICTED"}'] >= 1
    assert m['larqlpy_kept_bytes{state="PERSISTED"}'] == files <= 3 << 20


def test_cells_states_are_quantized_under_pressure(smol_dir):
    with Server(smol_dir, "--weights", "int8", "--kv-dtype", "f32", "--continuation", "cells/v1",
                "--kv-budget", "24MiB") as s:
        for t in TURNS + OTHERS:
            chat_turns(s, [t * 30])
        m = s.metrics()
    assert m['larqlpy_kept_transitions_total{from="ACTIVE",to="QUANTIZED"}'] >= 1


def test_a_restart_with_a_state_dir_continues_with_the_same_ids(smol_dir, tmp_path):
    with Server(smol_dir, "--weights", "int8") as s:
        straight = chat_turns(s, TURNS)[1]
    d = tmp_path / "states"
    with Server(smol_dir, "--weights", "int8", "--state-dir", str(d)) as s:
        history, before = chat_turns(s, TURNS[:2])
    assert list(d.glob("*.lqkv"))  # saved at shutdown
    with Server(smol_dir, "--weights", "int8", "--state-dir", str(d)) as s:
        after = chat_turns(s, TURNS[2:], history)[1]
    assert ids(before + after) == ids(straight)
    assert after[0]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with Server(smol_dir, "--weights", "int4", "--state-dir", str(d)) as s:  # states made with other weights
        other = chat_turns(s, TURNS[2:], history)[1][0]
    assert "int8" in other["larqlpy"]["continuation_refused"]
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_queue_full_disconnect_and_graceful_shutdown(smol_dir):
    import threading
    import time

    s = Server(smol_dir, "--weights", "int8", "--parallel", "1", "--queue-size", "0")
    try:
        long = {"model": NAME, "prompt": "Count to a thousand: 1, 2, 3, 4, 5, 6,", "max_tokens": 120, "temperature": 0}
        done = {}
        t = threading.Thread(target=lambda: done.update(r=s.post("/v1/completions", long)))
        t.start()
        for _ in range(200):  # until the first request holds the only slot
            if httpx.get(s.url + "/health").json()["live"] == 1:
                break
            time.sleep(0.05)
        busy = s.post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 2})
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
        t.join()
        assert len(done["r"].json()["larqlpy"]["tokens"]) == 120

        with httpx.stream("POST", s.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    break  # the client goes away mid-stream
        for _ in range(200):
            if httpx.get(s.url + "/health").json()["live"] == 0:
                break
            time.sleep(0.05)
        assert httpx.get(s.url + "/health").json()["live"] == 0  # its slot was freed

        t = threading.Thread(target=lambda: done.update(r=s.post("/v1/completions", {**long, "max_tokens": 40})))
        t.start()
        while httpx.get(s.url + "/health").json()["live"] == 0:
            time.sleep(0.05)
    finally:
        s.stop()  # SIGTERM while a request is in flight: it finishes first
    t.join()
    assert done["r"].status_code == 200 and len(done["r"].json()["larqlpy"]["tokens"]) == 40
