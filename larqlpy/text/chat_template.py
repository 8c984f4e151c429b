"""A model's chat template, rendered with jinja2 exactly as transformers' `apply_chat_template` does:
the same sandboxed environment (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols), the same globals (raise_exception, strftime_now, dict, namespace) and tojson filter,
and the tokenizer's special tokens (bos_token, eos_token, ...) as variables. The text it renders
is tokenized without adding BOS: the template writes its own.

Unlike transformers, a render is bounded (template_bounds.py): in time, and in the size of what it
makes, each step that C would do at once measured before it runs (template_rules.py). A template
that keeps within the bounds renders byte for byte as it does there.
"""

from __future__ import annotations

import json
import weakref
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.ext import Extension
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Cycler

from larqlpy.errors import LarqlError
from larqlpy.files import read_text
from larqlpy.text.messages import check_messages
from larqlpy.text.template_bounds import BOUNDS, Bounds, TemplateBoundError, refuse_size, text_size, within
from larqlpy.text.template_rules import GLOBALS, bounded_filter, bounded_global, check_binop, check_call
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


class _Generator(CodeGenerator):
    """jinja's code generator, with `a ~ b` measured before it is joined (`_Sandbox.joined`) and each
    list, tuple or dict the template writes measured as it is made (`_Sandbox.built`)."""

    @optimizeconst
    def visit_Concat(self, node, frame):
        if frame.eval_ctx.volatile:  # as jinja chooses the join
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        elif frame.eval_ctx.autoescape:
            join = "markup_join"
        else:
            join = "str_join"
        self.write(f"environment.joined({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_List(self, node, frame):
        self._built(super().visit_List, node, frame)

    def visit_Tuple(self, node, frame):
        if node.ctx == "load":  # not the names a {% for %} or {% set %} assigns
            self._built(super().visit_Tuple, node, frame)
        else:
            super().visit_Tuple(node, frame)

    def visit_Dict(self, node, frame):
        self._built(super().visit_Dict, node, frame)

    def _built(self, visit, node, frame):
        self.write("environment.built(")
        visit(node, frame)
        self.write(")")


_RUNTIME = ("_loop_vars", "_block_vars")  # what jinja adds to a call in a loop or a block, and takes out


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with what would build text or numbers past `bounds` refused before it
    is built: operators, calls (str methods, str.format), `~`, each `{{ }}` and each block's output."""

    code_generator_class = _Generator
    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def __init__(self, bounds: Bounds, **kwargs):
        super().__init__(finalize=self._finalize, **kwargs)
        self.bounds = bounds

    def call_binop(self, context, operator, left, right):
        if operator == "+" and type(left) is str and type(right) is str:  # most of a template's: kept to one call
            if len(left) + len(right) > self.bounds.chars:
                refuse_size("'+'", len(left) + len(right), self.bounds)
            return left + right
        check_binop(operator, left, right, self.bounds)
        return self.binop_table[operator](left, right)

    def call(self, context, obj, /, *args, **kwargs):
        builds = obj in (self.globals["dict"], _Namespace, Cycler) or (
            isinstance(obj, Macro) and (obj.catch_varargs or obj.catch_kwargs))
        given = {k: v for k, v in kwargs.items() if k not in _RUNTIME} if kwargs else kwargs
        args = check_call(obj, args, given, self.bounds, builds)  # str methods, str.format (jinja's wrapper)
        return super().call(context, obj, *args, **kwargs)

    def concat(self, pieces):  # a block's output joined: a macro's, a caller's, a {% set %} block's
        pieces = pieces if isinstance(pieces, list) else list(pieces)
        refuse_size("a block's output", sum(map(len, pieces)), self.bounds)
        return "".join(pieces)

    def built(self, value):  # [a, b], (a, b), {k: v}: `[l, l]` holds l twice
        if len(value) > 1:
            refuse_size("a list, tuple or dict", text_size(value), self.bounds)
        return value

    def joined(self, join, parts):
        refuse_size("'~'", sum(text_size(p) for p in parts), self.bounds)
        return join(parts)

    def _finalize(self, value):  # each {{ value }}, before str(value)
        if not isinstance(value, str):
            refuse_size("'{{ }}'", text_size(value), self.bounds)
        return value


def _environment(bounds: Bounds) -> _Sandbox:
    env = _Sandbox(bounds, trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=_TemplateDict(), namespace=_Namespace)
    env.filters = {name: bounded_filter(name, f, bounds) for name, f in env.filters.items()}
    env.globals.update({name: bounded_global(name, env.globals[name], rule, bounds) for name, rule in GLOBALS.items()})
    return env


_OWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its model's template, compiled once


# What `check` renders: a conversation every chat model should take.
SAMPLE = ({"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"},
          {"role": "assistant", "content": "Hello! How can I help you today?"},
          {"role": "user", "content": "What is the capital of France?"})


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str], origin: str, bounds: Bounds = BOUNDS):
        self.source, self.special, self.origin, self.bounds = source, dict(special), origin, bounds
        try:
            self.template = _environment(bounds).from_string(source)
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
        context = dict(messages=template_messages(messages, conv, tools), tools=offered if conv != "generic" else None,
                       documents=None, add_generation_prompt=add_generation_prompt, **{**self.special, **kwargs})
        try:
            return within(self.bounds.seconds, self._render, context)
        except TemplateBoundError as e:
            raise TemplateBoundError(f"{self.origin}: {e.message}") from None
        except RecursionError:
            raise TemplateBoundError(f"{self.origin}: rendering recursed past Python's limit (a macro that calls "
                                     "itself without end?)") from None
        except MemoryError:
            raise TemplateBoundError(f"{self.origin}: rendering ran out of memory") from None
        except jinja2.exceptions.TemplateError as e:  # raise_exception(...) in the template, or a sandbox refusal
            raise LarqlError(f"{self.origin}: {e.message or e}") from None
        except Exception as e:  # the template's own failure on these messages (a TypeError, a division by 0)
            raise LarqlError(f"{self.origin}: {type(e).__name__}: {' '.join(str(e).split())}") from None

    def _render(self, context: dict[str, Any]) -> str:
        pieces, total, most = [], 0, self.bounds.chars
        for piece in self.template.generate(context):
            total += len(piece)
            if total > most:
                refuse_size("the output", total, self.bounds)
            pieces.append(piece)
        return "".join(pieces)

    def check(self) -> None:
        """Renders `SAMPLE`: a template past the bounds on it raises TemplateBoundError; one that
        refuses the conversation itself (a template without a system role) does not."""
        try:
            self.render([dict(m) for m in SAMPLE])
        except TemplateBoundError:
            raise
        except LarqlError:
            pass
