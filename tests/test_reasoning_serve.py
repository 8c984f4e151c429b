"""The reasoning split on a model that thinks, through `larqlpy serve`: a tiny random Qwen3 with
Qwen3's real chat template (tests/data) and a byte-level tokenizer holding <think> and </think> as
tokens, as Qwen3's does. A random model does not think by itself, so a regex (the body's "larqlpy"
object) makes it write a block, and a logit bias keeps it thinking; the answers' reasoning and
content are checked against the raw text, whole and streamed, on chat completions and on Anthropic's
Messages, and a thinking budget closes the block."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute
from serving import Server
from tiny import make_tiny_family

NAME = "thinker"
ASK = [{"role": "user", "content": "What is 2+2?"}]
SPECIAL, THINK = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ("<think>", "</think>")
MERGES = [("h", "m"), ("Ċ", "Ċ"), ("y", "e"), ("ye", "s")]
FREE = r"<think>\n[a-z][a-z ]{0,11}\n</think>\n\n[a-z]{1,8}"  # a block, then an answer
FOREVER = r"<think>\n(hm)*\n</think>\n\nyes"  # with "hm" biased up, a block that never closes by itself


def make_thinker(path: Path) -> dict[str, int]:
    """The tiny Qwen3 (transformers' own class) and its tokenizer; returns the ids of its tokens.
    <think> and </think> are one token each, as in Qwen3's, but merged pieces rather than added
    tokens: llguidance reads every added token as a special one, which a grammar cannot spell."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    merges = MERGES + [(word[:k], word[k]) for word in THINK for k in range(1, len(word))]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    ids = tok.get_vocab()
    assert [tok.encode(t).ids for t in THINK] == [[ids[t]] for t in THINK]
    make_tiny_family(path, "qwen3", vocab_size=len(ids), eos_token_id=ids["<|im_end|>"],
                     bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))  # in the place of the one make_tiny_family wrote
    template = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": template}))
    return ids


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / NAME  # the served name is the directory's
    ids = make_thinker(path)
    with Server(path, "--parallel", "2") as s:
        s.path = path
        yield s, ids


def chat(server: Server, **kw) -> dict:
    r = server.post("/v1/chat/completions", {"model": NAME, "messages": ASK, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def events(server: Server, path: str, body: dict) -> list[tuple[str | None, dict]]:
    """A stream's (event, data) pairs, [DONE] left out."""
    out, name = [], None
    with server.stream(path, {"model": NAME, "messages": ASK, "temperature": 0, "stream": True, **body}) as lines:
        for line in lines:
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                out.append((name, json.loads(line[6:])))
    return out


def raw(ids: dict[str, int], tokens: list[int]) -> str:
    """The text the tokens are, markers included."""
    by_id = {i: t for t, i in ids.items()}
    from tokenizers import decoders

    return decoders.ByteLevel().decode([by_id[t] for t in tokens])


def exact(text: str, thought: str, content: str) -> bool:
    """`text` is the block's markers with the blank beside them, the reasoning and the content."""
    return bool(re.fullmatch(r"<think>\s*" + re.escape(thought) + r"\s*</think>\s*" + re.escape(content), text))


def test_reasoning_and_content_split_exactly_whole_and_streamed_on_both_apis(thinker):
    server, ids = thinker
    body = {"max_tokens": 40, "logit_bias": {str(ids[t]): 100 for t in THINK}, "larqlpy": {"regex": FREE}}
    c = chat(server, **body)
    message = c["choices"][0]["message"]
    thought, content = message["reasoning_content"], message["content"]
    assert thought and content and exact(raw(ids, c["larqlpy"]["tokens"]), thought, content)
    assert {ids[t] for t in THINK} <= set(c["larqlpy"]["tokens"])  # the markers as Qwen3 writes them: a token each
    deltas = [e["choices"][0]["delta"] for _, e in events(server, "/v1/chat/completions", body) if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == content
    first = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert not any("reasoning_content" in d for d in deltas[first:])  # the reasoning, then the answer

    body = {"max_tokens": 40, "larqlpy": {"regex": FREE}}  # Anthropic's API has no logit_bias
    c = chat(server, **body)
    thought, content = c["choices"][0]["message"]["reasoning_content"], c["choices"][0]["message"]["content"]
    m = server.post("/v1/messages", {"model": NAME, "messages": ASK, "temperature": 0, **body}).json()
    assert m["larqlpy"]["tokens"] == c["larqlpy"]["tokens"]
    assert [b["type"] for b in m["content"]] == ["thinking", "text"]
    assert m["content"][0]["thinking"] == thought and m["content"][1]["text"] == content
    streamed = events(server, "/v1/messages", body)
    names = [n for n, _ in streamed]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert streamed[2][1]["content_block"]["type"] == "thinking"
    kinds = [d["delta"]["type"] for n, d in streamed if n == "content_block_delta"]
    assert kinds[:kinds.index("signature_delta") + 1] == ["thinking_delta"] * kinds.index("signature_delta") + \
        ["signature_delta"] and set(kinds[kinds.index("signature_delta") + 1:]) == {"text_delta"}
    said = {k: "".join(d["delta"].get(k, "") for n, d in streamed if n == "content_block_delta")
            for k in ("thinking", "signature", "text")}
    assert said == {"thinking": thought, "signature": m["content"][0]["signature"], "text": content}


def test_a_thinking_budget_closes_the_block_and_the_answer_follows(thinker):
    server, ids = thinker
    keep = {str(ids["hm"]): 100}  # the model would think forever
    c = chat(server, max_tokens=10, logit_bias=keep, larqlpy={"regex": FOREVER})
    assert c["choices"][0]["finish_reason"] == "length" and c["choices"][0]["message"]["content"] == ""
    assert set(c["choices"][0]["message"]["reasoning_content"].split("hm")) == {""}
    budget = 5  # "\n" and four "hm": then the sequence writes "\n</think>\n\n" and the grammar's answer
    c = chat(server, max_tokens=30, logit_bias=keep, larqlpy={"regex": FOREVER, "thinking_budget": budget})
    message, tokens = c["choices"][0]["message"], c["larqlpy"]["tokens"]
    assert message == {"role": "assistant", "reasoning_content": "hm" * (budget - 1), "content": "yes"}
    opened, closed = tokens.index(ids["<think>"]), tokens.index(ids["</think>"])
    assert closed - opened - 1 == budget + 1  # the budget's tokens, then the forced newline
    assert c["choices"][0]["finish_reason"] == "stop"
    # Anthropic's budget_tokens is the same budget (its API has no logit_bias: the "larqlpy" object's)
    body = {"max_tokens": 30, "larqlpy": {"regex": FOREVER, "logit_bias": keep},
            "thinking": {"type": "enabled", "budget_tokens": budget}}
    m = server.post("/v1/messages", {"model": NAME, "messages": ASK, "temperature": 0, **body}).json()
    assert m["larqlpy"]["tokens"] == tokens and m["stop_reason"] == "end_turn"
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in m["content"]] == [
        ("thinking", "hm" * (budget - 1)), ("text", "yes")]


def test_thinking_off_renders_qwen3s_empty_block(thinker):
    server, ids = thinker
    count = {}
    for kind in ("enabled", "disabled"):
        thinking = {"type": kind, "budget_tokens": 8} if kind == "enabled" else {"type": kind}
        r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": NAME, "messages": ASK,
                                                                       "thinking": thinking})
        count[kind] = r.json()["input_tokens"]
    assert count["disabled"] - count["enabled"] == 4  # <think> ĊĊ </think> ĊĊ: "<think>\n\n</think>\n\n"
    off = chat(server, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert off["usage"]["prompt_tokens"] == count["disabled"]
    assert chat(server, max_tokens=1, reasoning_effort="none")["usage"]["prompt_tokens"] == count["disabled"]


def test_thinking_off_without_a_switch_closes_an_opened_block_at_once(thinker, tmp_path):
    """A template that opens the block and has no enable_thinking (DeepSeek-R1's distills): thinking
    off is a budget of nothing, the block closed by the sequence as it starts (the Python API here)."""
    import larqlpy

    server, ids = thinker
    r1 = tmp_path / "r1.jinja"
    r1.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    model = larqlpy.load(server.path, device="cpu")
    record = execute(model.loaded, Request.from_dict({"messages": ASK, "chat_template": str(r1), "thinking": False,
                                                      "max_tokens": 4}))
    assert record["tokens"][:3] == [ids["Ċ"], ids["</think>"], ids["ĊĊ"]]  # forced: "\n</think>\n\n"
    assert record["reasoning"] is None and record["text"] == "\n</think>\n\n" + record["content"]
    on = model.respond(ASK, chat_template=str(r1), max_tokens=4)  # the block left open: all of it reasoning
    assert on["content"] == "" and on["reasoning_content"] and on["finish_reason"] == "length"


def test_the_responses_api_gives_a_reasoning_item_whole_and_streamed(thinker):
    server, ids = thinker
    body = {"max_tokens": 40, "larqlpy": {"regex": FREE}}
    c = chat(server, **body)["choices"][0]["message"]
    ask = {"model": NAME, "input": ASK[0]["content"], "temperature": 0, "max_output_tokens": 40,
           "larqlpy": {"regex": FREE}}
    r = server.post("/v1/responses", ask).json()
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == c["reasoning_content"]
    assert r["output"][1]["content"][0]["text"] == c["content"]
    tokens = r["larqlpy"]["tokens"]
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == tokens.index(ids["</think>"])
    streamed = [d for _, d in events(server, "/v1/responses", {**ask, "messages": None})]
    kinds = [d["type"] for d in streamed]
    assert kinds[2:4] == ["response.output_item.added", "response.reasoning_text.delta"]
    assert "".join(d["delta"] for d in streamed if d["type"] == "response.reasoning_text.delta") == \
        c["reasoning_content"]
    assert "".join(d["delta"] for d in streamed if d["type"] == "response.output_text.delta") == c["content"]
    last = streamed[-1]["response"]
    assert [o["type"] for o in last["output"]] == ["reasoning", "message"] and last["status"] == "completed"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
