"""A model's chat template, rendered with jinja2 exactly as transformers' `apply_chat_template` does:
the same sandboxed environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols), the same globals (raise_exception, strftime_now, dict, namespace) and tojson filter,
and the tokenizer's special tokens (bos_token, eos_token, ...) as variables. The text it renders
is tokenized without adding BOS: the template writes its own.
"""

from __future__ import annotations

import json
import weakref
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from larqlpy.errors import LarqlError
from larqlpy.files import read_text
from larqlpy.text.messages import check_messages
from larqlpy.text.tools import ToolUse, convention, template_messages


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' own filter: jinja's escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """dict() for templates, without attribute access to break out with."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """namespace() refusing underscore-prefixed names (no way to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's tokens for
    training): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_TemplateDict(), namespace=_Namespace)
    return env


_OWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its model's template, compiled once


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str], origin: str):
        self.source, self.special, self.origin = source, dict(special), origin
        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise LarqlError(f"{origin}: not a valid chat template (line {e.lineno}: {e.message})") from None

    @classmethod
    def for_tokenizer(cls, tokenizer, override: str | Path | None = None) -> "ChatTemplate":
        """The model's own template (tokenizer_config.json's chat_template, or chat_template.jinja),
        or the one in `override`; a model without one is refused."""
        if override is not None:
            return cls(read_text(override, "`chat_template`"), tokenizer.special_tokens(), str(override))
        if tokenizer in _OWN:
            return _OWN[tokenizer]
        source = tokenizer.config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if not isinstance(source, str) or not source.strip():
            raise LarqlError("this model has no chat template (tokenizer_config.json has no chat_template); "
                             "give one with `chat_template`")
        _OWN[tokenizer] = own = cls(source, tokenizer.special_tokens(), "the model's chat template")
        return own

    @property
    def convention(self) -> str:
        """How this template's model calls tools (text/tools.py)."""
        return convention(self.source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: ToolUse | None = None,
               **kwargs: Any) -> str:
        """`messages` (OpenAI's, tool calls and results included) as the prompt text; `tools` are
        passed to the template as transformers passes them, or described in the system message
        where the template knows none."""
        check_messages(messages)
        conv = self.convention
        offered = [dict(t) for t in tools.tools] if tools is not None and tools.choice != "none" else None
        try:
            return self.template.render(messages=template_messages(messages, conv, tools),
                                        tools=offered if conv != "generic" else None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **{**self.special, **kwargs})
        except jinja2.exceptions.TemplateError as e:  # raise_exception(...) in the template, or a sandbox refusal
            raise LarqlError(f"{self.origin}: {e.message or e}") from None
