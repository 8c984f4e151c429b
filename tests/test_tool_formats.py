"""Each family's tool-call format on its own chat template's output (tests/templates/, from
llama.cpp's models/templates): a conversation with calls rendered through larqlpy's sandboxed
renderer, the text the template wrote for the assistant's calls read back -- whole and in pieces --
as exactly those calls; the convention told from the template; the grammar that forces a call
accepting that text; and a tool's result rendered back into the template. No model is loaded."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import jinja2
import llguidance as llg
import pytest
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from larqlpy.text.chat_template import ChatTemplate
from larqlpy.text.tokenizer import Tokenizer
from larqlpy.text.tool_formats import MARKERS, short_id
from larqlpy.text.tools import call_grammar, convention, read_reply, tool_use
from test_tools import TOOLS, in_pieces

TEMPLATES = Path(__file__).parent / "templates"
ASK = {"role": "user", "content": "What is the weather in Paris, and the time in CET?"}
CALLS = [("abcDEF123", "get_weather", {"city": "Paris", "unit": "celsius"}), ("Xy9Zq0Lm7", "get_time", {"zone": "CET"})]
RESULTS = ['{"temperature": 18}', '"12:00"']


@dataclasses.dataclass(frozen=True)
class Family:
    template: str
    convention: str
    ids: bool  # the template writes the calls' ids into the text, and the format reads them back
    result: str  # how the template wraps the first tool result ({} is its text)
    special: tuple = ("<s>", "</s>")  # bos_token, eos_token
    calls: int = 2  # Llama 3.1's template takes one call a turn
    quoted: bool = False  # the template writes a result as a JSON string (Llama 3.1's `tojson`)


FAMILIES = [
    Family("mistralai-Mistral-Nemo-Instruct-2407", "mistral", True,
           '[TOOL_RESULTS]{{"content": {}, "call_id": "abcDEF123"}}[/TOOL_RESULTS]'),
    Family("Mistral-Small-3.2-24B-Instruct-2506", "mistral_args", True,
           "[TOOL_RESULTS]abcDEF123[TOOL_CONTENT]{}[/TOOL_RESULTS]"),
    Family("unsloth-mistral-Devstral-Small-2507", "mistral_args", False, "[TOOL_RESULTS]{}[/TOOL_RESULTS]"),
    Family("Qwen-Qwen3-0.6B", "hermes", False, "<|im_start|>user\n<tool_response>\n{}\n</tool_response>",
           ("", "<|im_end|>")),
    Family("Qwen-Qwen2.5-7B-Instruct", "hermes", False, "<|im_start|>user\n<tool_response>\n{}\n</tool_response>",
           ("", "<|im_end|>")),
    Family("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes", False,
           "<|im_start|>tool\n<tool_response>\n{}\n</tool_response>", ("<|begin_of_text|>", "<|im_end|>")),
    Family("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek", False,
           "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{}<｜tool▁output▁end｜>",
           ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")),
    Family("deepseek-ai-DeepSeek-V3.1", "deepseek_v31", False, "<｜tool▁output▁begin｜>{}<｜tool▁output▁end｜>",
           ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")),
    Family("meta-llama-Llama-3.1-8B-Instruct", "llama3", False, "<|start_header_id|>ipython<|end_header_id|>\n\n{}",
           ("<|begin_of_text|>", "<|eot_id|>"), calls=1, quoted=True),
]
ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>", "<｜end▁of▁sentence｜>")


def template(family: Family) -> ChatTemplate:
    source = (TEMPLATES / f"{family.template}.jinja").read_text()
    return ChatTemplate(source, {"bos_token": family.special[0], "eos_token": family.special[1]}, family.template)


def conversation(family: Family, ids=None) -> list[dict]:
    calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, n, a in CALLS[:family.calls]]
    if ids is not None:
        calls = [{**c, "id": i} for c, i in zip(calls, ids)]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, RESULTS)]
    return [ASK, {"role": "assistant", "content": "", "tool_calls": calls}, *results]


def reply_text(family: Family) -> str:
    """What the template wrote for the assistant's turn of calls: its whole rendering less what it
    renders before the turn (up to where that and the generation prompt part) and the end of turn."""
    t, use = template(family), tool_use(TOOLS, "auto")
    turn = conversation(family)[:2]
    whole = t.render(turn, add_generation_prompt=False, tools=use)
    before = t.render(turn[:1], add_generation_prompt=True, tools=use)
    at = len(os.path.commonprefix([whole, before]))
    for m in MARKERS:  # not inside a marker: the prompt's "<think>" and the reply's "<｜tool▁calls▁begin｜>" share "<"
        start = whole.find(m, max(at - len(m) + 1, 0))
        at = start if 0 <= start < at else at
    text = whole[at:].rstrip("\n")
    for end in ENDS:
        text = text.removesuffix(end)
    return text


def read_back(text: str, use) -> tuple[str | None, list[dict]]:
    reply = read_reply(text, use)
    return reply.content, list(reply.calls)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.template)
def test_the_convention_is_told_from_the_template(family):
    assert convention(template(family).source) == template(family).convention == family.convention


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.template)
def test_the_calls_a_template_writes_read_back_whole_and_streamed(family):
    use = dataclasses.replace(tool_use(TOOLS, "auto"), convention=family.convention)
    text = reply_text(family)
    assert "get_weather" in text and not text.endswith(ENDS)
    content, calls = read_back(text, use)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    assert got == [(n, a) for _, n, a in CALLS[:family.calls]], text
    assert content is None or not any(m in content for m in MARKERS), content  # Qwen3: its empty think block
    if family.ids:
        assert [c["id"] for c in calls] == [i for i, _, _ in CALLS]
    elif family.convention.startswith("mistral"):
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)  # what its next prompt takes
    else:
        assert all(c["id"].startswith("call_") for c in calls)
    rng = random.Random(family.template)
    for _ in range(4):  # in pieces of random size: the same calls and content
        parts = in_pieces(text, use, rng, 9)
        streamed = [p for p in parts if isinstance(p, dict)]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert ("".join(p for p in parts if isinstance(p, str)).strip() or None) == content


class _Bytes:
    """The 256 bytes as tokens and an end: the grammar walked over the text's own bytes."""
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.template)
def test_the_forcing_grammar_accepts_the_calls_the_template_writes(family):
    text = reply_text(family)
    first = min((i for m in MARKERS if (i := text.find(m)) >= 0), default=text.find("{"))
    calls = text[first:]
    tok = llg.LLTokenizer(llg.TokenizerWrapper(_Bytes()))

    def matches(use, sentence: str) -> bool:
        m = llg.LLMatcher(tok, llg.grammar_from("lark", call_grammar(use)), log_level=0)
        return m.consume_tokens(list(sentence.encode())) and not m.is_error() and m.is_accepting()

    required = dataclasses.replace(tool_use(TOOLS, "required"), convention=family.convention)
    assert matches(required, calls), calls
    wrong = calls.replace("Paris", "Paris" * 10)  # past the city's maxLength
    assert not matches(required, wrong)
    if family.calls > 1:
        assert not matches(dataclasses.replace(required, parallel=False), calls)  # one call at most
    named = dataclasses.replace(tool_use(TOOLS, {"type": "function", "function": {"name": "get_time"}}),
                                convention=family.convention)
    assert not matches(named, calls)  # get_weather is not the named function


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.template)
def test_a_tool_result_goes_back_into_the_template(family):
    t, use = template(family), tool_use(TOOLS, "auto")
    text = t.render(conversation(family), tools=use)
    assert family.result.format(json.dumps(RESULTS[0]) if family.quoted else RESULTS[0]) in text
    if family.convention.startswith("mistral"):  # OpenAI's ids, made the 9 characters its template insists on
        ids = ["call_" + "ab" * 12, "call_" + "cd" * 12]
        text = t.render(conversation(family, ids), tools=use)
        if family.ids:
            assert text.count(short_id(ids[0])) == 2 and short_id(ids[0]) == short_id(ids[0]) != short_id(ids[1])


def test_mistral_and_deepseek_replies_among_content():
    cases = [
        ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure.", ["get_time"]),
        ("mistral", '[TOOL_CALLS] [{"name": "launch", "arguments": {}}]', '[TOOL_CALLS] [{"name": "launch", '
         '"arguments": {}}]', []),  # not one of the tools: content
        ("mistral_args", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', None, ["get_time"]),
        ("mistral_args", '[TOOL_CALLS]get_time[ARGS]{"zone": ', '[TOOL_CALLS]get_time[ARGS]{"zone": ', []),
        ("deepseek", 'Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
         '{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Looking.", ["get_time"]),
        ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC"}', None,
         ["get_time"]),  # stopped before its end: the call is whole
        ("deepseek_v31", "It is noon.", "It is noon.", []),
    ]
    for conv, text, content, names in cases:
        use = dataclasses.replace(tool_use(TOOLS, "auto"), convention=conv)
        got, calls = read_back(text, use)
        assert (got, [c["function"]["name"] for c in calls]) == (content, names), text


def test_a_mistral_template_refuses_what_the_format_would_not_send():
    t = template(FAMILIES[0])
    calls = [{"id": "x", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    with pytest.raises(jinja2.TemplateError, match="Tool call IDs should be alphanumeric"):  # the template's own rule
        t.template.render(messages=[ASK, {"role": "assistant", "content": "", "tool_calls": calls}], tools=None,
                          bos_token="", eos_token="")
    t.render([ASK, {"role": "assistant", "content": "", "tool_calls": calls}])  # ours gives it a 9-character id


def test_a_special_marker_token_stays_in_the_decoded_text():
    """Mistral's [TOOL_CALLS] is a special token: decoding skips those, but the reply's calls are read
    from its text, so the markers stay (and other special tokens, </s> here, still go)."""
    inner = HFTokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True), AddedToken("</s>", special=True)])
    tok = Tokenizer(inner, None, False, set(), "test")
    ids = inner.encode("a [TOOL_CALLS] b </s>").ids
    assert len(ids) == 4 and tok.decode(ids) == "a[TOOL_CALLS]b" and tok.decode(ids[:1]) == "a"
    stream = tok.stream()
    assert "".join(stream.step(i) for i in ids) == "a[TOOL_CALLS]b"
