"""A thinking model's reasoning without a model: markers told from templates (Qwen3's real one, in
tests/data, from llama.cpp's models/templates), the whole and streamed splits agreeing on every
chunking and giving back the text exactly, enable_thinking rendered from the request, and the
request fields (reasoning_effort, thinking, thinking_budget, chat_template_kwargs, Anthropic's
thinking) read and refused."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from larqlpy.errors import LarqlError
from larqlpy.pipeline.prepare import rendered, with_reasoning
from larqlpy.pipeline.request import EFFORT, Request
from larqlpy.server.anthropic import read_request as anthropic_request
from larqlpy.server.openai import read_request as openai_request
from larqlpy.text.chat_template import ChatTemplate
from larqlpy.text.reasoning import CONTENT, REASONING, Markers, Reasoning, Splitter, markers, reasoning_of, split

QWEN3 = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
# DeepSeek-R1's distills' shape: the generation prompt opens the block, and there is no switch
R1 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
THINK = Markers("<think>", "</think>")
ASK = [{"role": "user", "content": "What is 2+2?"}]
TEXTS = ["<think>\nLet me add.\n\n2+2 is 4.\n</think>\n\nIt is 4.", "  <think>x</think>y", "<think></think>\n\nz",
         "<think>\nnever closed\n", "No thinking here. <think>a</think>", "<thi", "", "\n\n</think>\n\nafter",
         "<think>a</thi", "<think> a </think> b </think> c"]


def streamed(text: str, reasoning: Reasoning, seed: int) -> tuple[str, str]:
    rnd, s, parts, i = random.Random(seed), Splitter(reasoning), [], 0
    while i < len(text):
        j = i + rnd.randint(1, 5)
        parts += s.feed(text[i:j])
        i = j
    parts += s.close()
    assert all(p.text for p in parts)  # nothing empty goes out
    kinds = [p.kind for p in parts]
    assert kinds == sorted(kinds, key=[REASONING, CONTENT].index)  # the reasoning first, then the answer
    return "".join(p.text for p in parts if p.kind == REASONING), "".join(p.text for p in parts if p.kind == CONTENT)


@pytest.mark.parametrize("opened", [False, True])
def test_the_split_is_exact_and_streams_the_same_on_every_chunking(opened):
    r = Reasoning(THINK, opened)
    for text in TEXTS:
        thought, content = split(text, r)
        for seed in range(20):
            assert streamed(text, r, seed) == (thought or "", content)
        lead = r"\s*" if opened else r"\s*<think>\s*"
        if thought is not None:  # the text is the markers, the blank beside them, the reasoning and the content
            assert re.fullmatch(lead + re.escape(thought) + r"\s*(</think>\s*)?" + re.escape(content), text)
            assert thought == thought.strip()
        elif not opened and not text.lstrip().startswith("<think>"):
            assert content == text  # no block: the answer untouched
    assert split("<think>\nhm\n</think>\n\nIt is 4.", Reasoning(THINK)) == ("hm", "It is 4.")
    assert split("\nhm\n</think>\n\nIt is 4.", Reasoning(THINK, True)) == ("hm", "It is 4.")
    assert split("<think>\nhm", None) == (None, "<think>\nhm")  # a model that does not think


def test_markers_are_told_from_the_template_and_the_prompt():
    assert markers(QWEN3) == THINK and markers(R1) == THINK
    assert markers("[THINK]{{ x }}[/THINK]") == Markers("[THINK]", "[/THINK]")
    assert markers("{{ '<seed:think>' }}") == Markers("<seed:think>", "</seed:think>")
    assert markers("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    r1 = ChatTemplate(R1, {}, "R1")
    assert reasoning_of(R1, r1.render(ASK)) == Reasoning(THINK, opened=True)  # its output starts inside
    assert reasoning_of(QWEN3, ChatTemplate(QWEN3, {}, "qwen3").render(ASK)) == Reasoning(THINK, opened=False)


def test_enable_thinking_renders_qwen3s_empty_block_and_r1_gets_a_budget_of_nothing():
    qwen3 = ChatTemplate(QWEN3, {}, "qwen3")
    on = rendered(Request.from_dict({"messages": ASK}), qwen3)
    assert on.endswith("<|im_start|>assistant\n")
    offs = ({"reasoning_effort": "none"}, {"thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}})
    for body in offs:
        req = Request.from_dict({"messages": ASK, **body})
        text = rendered(req, qwen3)
        assert text == on + "<think>\n\n</think>\n\n"
        assert with_reasoning(req, qwen3, text).gen.thinking_budget is None  # the template turned it off
    r1 = ChatTemplate(R1, {}, "R1")
    req = Request.from_dict({"messages": ASK, "reasoning_effort": "minimal"})
    done = with_reasoning(req, r1, rendered(req, r1))
    assert done.reasoning.opened and done.gen.thinking_budget == 0  # no switch: closed as it opens
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {}, "plain")
    assert with_reasoning(req, plain, rendered(req, plain)) is req  # a model that does not think: untouched


def test_request_fields_are_read_and_refused_in_one_line():
    req = Request.from_dict({"messages": ASK, "reasoning_effort": "low"})
    assert req.thinking is True and req.gen.thinking_budget == EFFORT["low"]
    assert Request.from_dict({"messages": ASK, "thinking_budget": 7}).gen.thinking_budget == 7
    chat = openai_request({"messages": ASK, "reasoning_effort": "high", "chat_template_kwargs": {"x": 1}}, chat=True)
    assert chat.gen.thinking_budget == EFFORT["high"] and chat.chat_template_kwargs == {"x": 1}
    assert openai_request({"messages": ASK, "larqlpy": {"thinking_budget": 3}}, chat=True).gen.thinking_budget == 3
    msg = anthropic_request({"max_tokens": 9, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 5}})
    assert msg.thinking is True and msg.gen.thinking_budget == 5
    assert anthropic_request({"max_tokens": 9, "messages": ASK, "thinking": {"type": "disabled"}}).thinking is False
    assert anthropic_request({"max_tokens": 9, "messages": ASK}).thinking is None  # the template's default
    for bad, says in [
        ({"messages": ASK, "reasoning_effort": "extreme"}, "`reasoning_effort` is one of none"),
        ({"messages": ASK, "reasoning_effort": "low", "thinking_budget": 5}, "one setting; give one"),
        ({"messages": ASK, "reasoning_effort": "none", "thinking": True}, "disagree"),
        ({"messages": ASK, "thinking": "yes"}, "`thinking` must be a boolean"),
        ({"messages": ASK, "thinking_budget": -1}, "`thinking_budget` must be >= 0"),
        ({"prompt": "hi", "thinking_budget": 5}, "`thinking_budget` needs `messages`"),
        ({"messages": ASK, "chat_template_kwargs": {"messages": []}}, "cannot set `messages`"),
        ({"messages": ASK, "chat_template_kwargs": [1]}, "`chat_template_kwargs` must be an object"),
    ]:
        with pytest.raises(LarqlError, match=re.escape(says)):
            Request.from_dict(bad)
    for thinking, says in [({"type": "enabled"}, "budget_tokens must be an integer"),
                           ({"type": "on"}, "`thinking` is")]:
        with pytest.raises(LarqlError, match=re.escape(says)):
            anthropic_request({"max_tokens": 9, "messages": ASK, "thinking": thinking})
    with pytest.raises(LarqlError, match="one setting"):
        anthropic_request({"max_tokens": 9, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 5},
                           "larqlpy": {"thinking_budget": 3}})


def test_the_run_flags_need_a_chat_and_a_known_effort(cli):
    code, _, err = cli("run", "models/none", "hi", "--thinking-budget", "5")
    assert code == 2 and err.strip() == ("larqlpy: error: --thinking-budget needs --chat: a model's reasoning is "
                                         "told from its chat template")
    code, _, err = cli("run", "models/none", "hi", "--chat", "--reasoning-effort", "huge")
    assert code == 2 and "--reasoning-effort is one of none, minimal, low, medium, high" in err
