"""Structured outputs (grammars through llguidance), log-probabilities, penalties and logit bias: in
the one decode loop, so in run, batch lines, the Python API and the server alike (the server's own
cases are in test_serve.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from larqlpy.config import GenerationConfig, Grammar
from larqlpy.decode.constraint import Constraint, Vocabulary, compile_grammar
from larqlpy.decode.logits import Shaper, logprob
from larqlpy.errors import LarqlError
from larqlpy.pipeline.request import Request
from larqlpy.pipeline.runner import execute, execute_many
from larqlpy.server.openai import read_request
from test_cli import assert_refused

# Nested, and bounded everywhere (lengths, counts, numbers), so that every sample can end well
# inside its max_tokens: a sample cut short would not parse, and that would be max_tokens' doing.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                             "name": {"type": "string", "maxLength": 16}},
            "required": ["kind", "name"], "additionalProperties": False}},
    },
    "required": ["name", "age", "address", "pets"],
    "additionalProperties": False,
}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
ASK = [{"role": "user", "content": "Invent a person. Reply with JSON only."}]


def ask(**kw) -> Request:
    return Request.from_dict({"messages": ASK, "max_tokens": 200, **kw})


# -- the request: every spelling, every refusal ------------------------------------------------------

@pytest.mark.parametrize("raw, needle", [
    ({"regex": "[a-"}, "`regex` cannot be compiled"),
    ({"grammar": "start: nothing_defined"}, "`grammar` cannot be compiled"),
    ({"grammar": "root ::= ("}, "`grammar` cannot be compiled"),
    ({"json_schema": "{not json"}, "`json_schema` is not valid JSON"),
    ({"json_schema": [1]}, "`json_schema` must be a JSON object"),
    ({"json_schema": {"type": "thing"}}, "`json_schema` cannot be compiled"),
    ({"regex": "a", "json_schema": {}}, "give one of `json_schema`, `regex`"),
    ({"response_format": {"type": "xml"}}, "`response_format` must be an object whose type"),
    ({"response_format": {"type": "json_schema"}}, "`response_format` json_schema must be an object"),
    ({"logprobs": 21}, "`logprobs` must be in 0..20"),
    ({"logprobs": "3"}, "`logprobs` must be an integer"),
    ({"logit_bias": {"x": 1}}, "`logit_bias` maps token ids to numbers"),
    ({"logit_bias": {"5": 101}}, "`logit_bias` maps token ids >= 0 to biases in [-100, 100]"),
    ({"logit_bias": [5]}, "`logit_bias` must be an object"),
    ({"frequency_penalty": 2.5}, "`frequency_penalty` must be in [-2, 2]"),
    ({"presence_penalty": "a"}, "`presence_penalty` must be a number"),
    ({"repetition_penalty": 0}, "`repetition_penalty` must be a positive number"),
    ({"repeat_last_n": -2}, "`repeat_last_n` must be >= -1"),
])
def test_bad_settings_are_refused_in_one_line_before_any_weights(raw, needle):
    with pytest.raises(LarqlError) as e:
        Request.from_dict({"prompt": "hi", **raw})
    assert needle in e.value.message and "\n" not in e.value.message


def test_every_spelling_gives_the_same_settings():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    flat = Request.from_dict({"prompt": "hi", "json_schema": schema, "logprobs": 2, "logit_bias": {"7": -3},
                              "frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.2}).gen
    openai = read_request({"messages": ASK, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                                  "logit_bias": {"7": -3}, "frequency_penalty": 0.5, "presence_penalty": 0.25,
                                  "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
                                  "larqlpy": {"repetition_penalty": 1.2}}, chat=True).gen
    api = Request.from_api("hi", response_format={"type": "json_schema", "json_schema": {"schema": schema}},
                           logprobs=2, logit_bias={7: -3}, frequency_penalty=0.5, presence_penalty=0.25,
                           repetition_penalty=1.2).gen
    for g in (openai, api):
        assert (g.grammar, g.logprobs, g.logit_bias, g.frequency_penalty, g.presence_penalty,
                g.repetition_penalty) == (flat.grammar, 2, ((7, -3.0),), 0.5, 0.25, 1.2)
    assert read_request({"prompt": "hi", "logprobs": 0}, chat=False).gen.logprobs == 0
    assert read_request({"prompt": "hi", "response_format": {"type": "text"}}, chat=False).gen.grammar is None
    assert read_request({"prompt": "hi", "larqlpy": {"grammar": 'root ::= "a"'}}, chat=False).gen.grammar \
        == Grammar("grammar", 'root ::= "a"')


# -- what the settings do to a row of logits ---------------------------------------------------------

def test_penalties_bias_and_mask_follow_openai_and_llama_cpp():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0])
    rep = Shaper(GenerationConfig(repetition_penalty=2.0, repeat_last_n=2), 5)
    # llama.cpp: ids among the last 2 of the history (1 and 0; not 4): positive / 2, negative x 2
    assert torch.equal(rep(logits, [4, 1, 0]), torch.tensor([1.0, -4.0, 1.0, 0.5, 3.0]))
    assert torch.equal(Shaper(GenerationConfig(repetition_penalty=2.0, repeat_last_n=0), 5)(logits, [0]), logits)
    assert torch.equal(Shaper(GenerationConfig(repetition_penalty=2.0, repeat_last_n=-1), 5)(logits, [4, 1, 0]),
                       torch.tensor([1.0, -4.0, 1.0, 0.5, 1.5]))
    pen = Shaper(GenerationConfig(frequency_penalty=0.5, presence_penalty=0.25), 5)
    for tok in (2, 2, 3):  # OpenAI: minus count x frequency, minus presence once
        pen.accept(tok)
    assert torch.allclose(pen(logits, []), torch.tensor([2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 3.0]))
    bias = Shaper(GenerationConfig(logit_bias=((0, -100.0), (3, 5.0))), 5)
    assert torch.equal(bias(logits, []), torch.tensor([-98.0, -2.0, 1.0, 5.5, 3.0]))
    assert torch.equal(logits, torch.tensor([2.0, -2.0, 1.0, 0.5, 3.0]))  # the model's own row untouched


def test_logprobs_are_the_log_softmax_of_what_is_sampled_from():
    logits = torch.tensor([1.0, 3.0, 2.0, float("-inf")])
    lp = logprob(logits, 0.5, 2, 3)
    want = torch.log_softmax(logits / 0.5, dim=-1)
    assert lp.logprob == pytest.approx(float(want[2]))
    assert [i for i, _ in lp.top] == [1, 2, 0]  # the likeliest first; a masked id never among them
    assert logprob(logits, 0.0, 1, 0).logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))


def test_a_grammar_masks_all_but_what_may_come_next(smol):
    vocab = Vocabulary.of(smol.tokenizer, smol.config.vocab_size)
    c = Constraint(vocab, compile_grammar(Grammar("regex", "ab+")))
    tok = smol.tokenizer
    allowed = c.allowed()
    texts = {tok.token_bytes(int(i)) for i in allowed.nonzero()[0]}
    assert texts and all(re.fullmatch(rb"ab*", t) or t == b"a" for t in texts), sorted(texts)[:5]
    for i in tok.ids_of("abbb"):
        c.accept(i)
    assert not c.done and any(c.allowed()[sorted(tok.stop_ids)])  # complete: an end may come, or more b


# -- on the real models, through every entry point ---------------------------------------------------

def test_sampled_outputs_always_validate_against_a_nested_schema(smol):
    reqs = [(i, ask(json_schema=PERSON, temperature=1.0, seed=i)) for i in range(8)]
    outs = dict(execute_many(smol, reqs, parallel=8))
    texts = [outs[i]["text"] for i in range(8)]
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)
    assert len(set(texts)) > 4  # sampled, not one answer eight times
    assert all(outs[i]["finish_reason"] == "stop" for i in range(8))


def test_a_constrained_row_in_a_batch_masks_only_itself(smol):
    plain = ask(max_tokens=24)
    alone = execute(smol, plain)["tokens"]
    outs = dict(execute_many(smol, [("json", ask(response_format={"type": "json_object"})), ("plain", plain),
                                    ("regex", ask(regex="[0-9]{3}-[0-9]{4}"))], parallel=3))
    assert outs["plain"]["tokens"] == alone
    json.loads(outs["json"]["text"])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs["regex"]["text"])


@pytest.mark.parametrize("engine", [{}, {"continuation": "window/v1"},
                                    {"continuation": "codec/v1", "options": ["bits=4"]},
                                    {"continuation": "cells/v1", "options": ["budget=8MiB"]}, {"engine": "no-cache"}],
                         ids=["canonical", "window", "codec", "cells", "no-cache"])
def test_every_engine_takes_a_grammar(smol, engine):
    out = execute(smol, ask(json_schema=CITY, **engine))
    jsonschema.validate(json.loads(out["text"]), CITY)


def test_gbnf_and_lark_grammars(smol):
    yes_no = execute(smol, ask(grammar='root ::= "yes" | "no"'))["text"]
    assert yes_no in ("yes", "no")
    lark = execute(smol, ask(grammar='start: "Colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"'))["text"]
    assert re.fullmatch("Colour: (red|green|blue)", lark)


def test_a_grammar_after_resume(smol, tmp_path):
    saved = tmp_path / "s.lqkv"
    execute(smol, Request.from_dict({"prompt": "A person, as JSON:", "max_tokens": 4, "save_state": str(saved)}))
    out = execute(smol, Request.from_dict({"prompt": "", "resume": str(saved), "max_tokens": 200,
                                           "json_schema": PERSON}))
    assert out["session"]["reused_tokens"] > 0
    jsonschema.validate(json.loads(out["text"]), PERSON)


def test_logprobs_and_bias_on_the_real_model(smol):
    out = execute(smol, ask(max_tokens=6, logprobs=3))
    assert [e["id"] for e in out["logprobs"]] == out["tokens"]
    for e in out["logprobs"]:  # greedy: the chosen token is the likeliest
        assert e["top_logprobs"][0]["id"] == e["id"] and e["logprob"] == e["top_logprobs"][0]["logprob"] <= 0
        assert len(e["top_logprobs"]) == 3 and bytes(e["bytes"]) == smol.tokenizer.token_bytes(e["id"])
    first = out["tokens"][0]
    banned = execute(smol, ask(max_tokens=1, logit_bias={str(first): -100}))["tokens"][0]
    assert banned != first
    forced = execute(smol, ask(max_tokens=1, logit_bias={"1234": 100}))["tokens"]
    assert forced == [1234]


def test_qwen_vocabulary_and_a_schema(qwen):
    out = execute(qwen, ask(json_schema=CITY, max_tokens=20))
    assert set(json.loads(out["text"])) == {"city"}
    assert Vocabulary.of(qwen.tokenizer, qwen.config.vocab_size).inner.vocab_size == 151936


@pytest.mark.parametrize("d", ["real_dir", "smol_dir", "qwen_dir"])
def test_token_bytes_spell_the_text(d, request):
    from larqlpy.model.families import read_config
    from larqlpy.text.tokenizer import Tokenizer

    path = request.getfixturevalue(d)
    tok = Tokenizer.from_dir(path, read_config(path))
    text = "Héllo 世界 😀 def f(x):\n\treturn x  # ok"
    assert b"".join(tok.token_bytes(i) for i in tok.ids_of(text)) == text.encode()


def test_run_json_schema_and_logprobs_from_the_command_line(cli, smol_dir, tmp_path):  # noqa: F811
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    rc, out, err = cli("run", smol_dir, "Invent a person.", "--chat", "--json-schema", schema, "-n", "200", "--json",
                       "--logprobs", "2")
    assert rc in (0, None), err
    rec = json.loads(out)
    jsonschema.validate(json.loads(rec["text"]), PERSON)
    assert len(rec["logprobs"]) == len(rec["tokens"])
    assert_refused(cli("run", smol_dir, "hi", "--regex", "[a-"), "--regex cannot be compiled")
    assert_refused(cli("run", smol_dir, "hi", "--json-schema", tmp_path / "none.json"), "--json-schema")
    assert_refused(cli("run", smol_dir, "hi", "--logit-bias", "5"), "--logit-bias takes ID=BIAS")


def test_a_grammar_spells_an_added_token_that_is_not_special(qwen):
    """Qwen's <tool_call> is an added token marked not special: a grammar that spells it as text
    may take it as that token or as its pieces (llguidance once offered the token, then refused it)."""
    vocab = Vocabulary.of(qwen.tokenizer, qwen.config.vocab_size)
    tag = qwen.tokenizer.ids_of("<tool_call>")
    assert len(tag) == 1 and not vocab.inner.is_special_token(tag[0])
    grammar = compile_grammar(Grammar("regex", "<tool_call>[a-z]{1,5}"))
    for ids in (tag, [t for piece in ("<", "tool", "_call", ">") for t in qwen.tokenizer.ids_of(piece)]):
        c = Constraint(vocab, grammar)
        for t in ids + qwen.tokenizer.ids_of("hi"):
            assert c.allowed()[t] or t in tag  # the mask offers the pieces; the whole token is text too
            c.accept(t)
        assert not c.matcher.is_error()
    r = execute(qwen, Request.from_dict({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
                                         "temperature": 0, "regex": "<tool_call>[a-z]{1,5}"}))
    assert r["text"].startswith("<tool_call>") and r["finish_reason"] == "stop", r
