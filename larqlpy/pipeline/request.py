"""One generation request, however it arrives (plain Python, no torch): built from the CLI's flags
and a batch line (`from_dict`, the flat spelling both share), the Python API (`from_api`) or a
server's body (server/openai.py reads one with the checks here). Every field is checked, and
`spec()` makes every engine refusal, before any weights load; `prepare.prepare` turns a request
into a sequence.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, Mapping

from larqlpy.config import GenerationConfig, Grammar
from larqlpy.decode.constraint import check_grammar, schema_text
from larqlpy.engines import EngineSpec, parse_engine_spec
from larqlpy.engines.options import parse_size
from larqlpy.errors import LarqlError
from larqlpy.files import check_output, utf8
from larqlpy.text.messages import check_messages
from larqlpy.text.reasoning import Reasoning
from larqlpy.text.tools import ToolUse, call_grammar, tool_use

MAX_CHOICES = 16  # `n`: each choice is a live sequence of its own
GRAMMAR_FIELDS = ("json_schema", "regex", "grammar", "response_format")  # the flat spelling: one at most
SHAPING = ("frequency_penalty", "presence_penalty", "repetition_penalty")
# `reasoning_effort` as a thinking budget in tokens; none and minimal turn thinking off (docs/serve.md)
EFFORT = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": 16384}
THINKING = ("reasoning_effort", "thinking", "thinking_budget", "chat_template_kwargs")  # a chat's only
RENDERED = ("messages", "tools", "documents", "add_generation_prompt")  # template variables the request sets


@dataclass(frozen=True)
class Request:
    prompt: str = ""  # "" with `messages` or `ids`
    id: Any = None
    messages: tuple[dict, ...] | None = None  # a conversation, rendered with the model's chat template
    ids: tuple[int, ...] | None = None  # the prompt as token ids
    chat_template: str | None = None  # a template file instead of the model's
    engine: str | None = None
    continuation: str | None = None
    options: tuple[str, ...] = ()  # "key=value" strings
    kv_budget: str | None = None  # this request's cells/v1 budget (budget.py: a process's is another)
    resume: str | None = None
    save_state: str | None = None
    reprefill: bool = False
    n: int = 1  # choices of one prompt (prefilled once: state/branches.py)
    tools: ToolUse | None = None  # OpenAI's tools and tool_choice (text/tools.py); with `messages` only
    thinking: bool | None = None  # a thinking model's reasoning on or off (None: as its template has it)
    chat_template_kwargs: dict | None = None  # more variables for the chat template (vLLM's spelling)
    reasoning: Reasoning | None = None  # the reasoning block its template's model writes (set by prepare)
    gen: GenerationConfig = field(default_factory=GenerationConfig)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Request":
        """The flat spelling of the CLI's flags and of a batch line (unknown keys ignored)."""
        if not isinstance(raw, dict):
            raise LarqlError(f"expected a JSON object, got {_json_type(raw)}")
        messages = raw.get("messages")
        if messages is not None:
            if raw.get("prompt") not in (None, ""):
                raise LarqlError("give `prompt` or `messages`, not both")
            raw = {**raw, "prompt": "", "messages": messages_of(messages)}
        prompt = raw.get("prompt")
        if not isinstance(prompt, str):
            raise LarqlError("'prompt' must be a string")
        utf8(prompt, "`prompt`")  # a JSON \\ud800 escape is a str no tokenizer can take
        for key in ("engine", "continuation", "kv_budget", "resume", "save_state", "chat_template"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                raise LarqlError(f"`{key}` must be a string")
        own = {f.name for f in fields(cls)} - {"gen", "options", "prompt", "ids", "tools", "n", "reasoning",
                                               "thinking", "chat_template_kwargs"}
        gen = generation(raw)
        given = [k for k in THINKING if raw.get(k) is not None]
        if given and messages is None:
            raise LarqlError(f"`{given[0]}` needs `messages`: a model's reasoning is told from its chat template")
        return cls(prompt=prompt, options=options_of(raw.get("options", raw.get("continuation_options", ()))),
                   gen=gen, tools=tools_of(raw, gen), n=choices(raw), **chat_settings(raw),
                   **{k: raw[k] for k in own if raw.get(k) is not None})

    @classmethod
    def from_api(cls, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 chat_template: str | None = None, engine: str | None = None, continuation: str | None = None,
                 options: Mapping[str, object] | None = None, **gen: object) -> "Request":
        """The Python API's spelling: a prompt (text or token ids) or messages; `gen` takes
        GenerationConfig / SamplingConfig fields (max_tokens, temperature, stop, ...)."""
        raw: dict[str, Any] = {"chat_template": chat_template, "engine": engine, "continuation": continuation,
                               "options": dict(options or {}), **gen}
        if isinstance(prompt, (list, tuple)):
            return cls.from_dict({**raw, "prompt": ""}).with_ids(token_ids(prompt))
        return cls.from_dict({**raw, "prompt": prompt if prompt is not None else "", "messages": messages})

    def with_ids(self, ids: list[int]) -> "Request":
        return dataclasses.replace(self, prompt="", messages=None, ids=tuple(ids))

    def spec(self) -> EngineSpec | None:
        """The engine spec, or None to take a resumed state's own. Refusals happen here, and the
        request is parsed once however often it is asked."""
        return self._spec

    @cached_property
    def _spec(self) -> EngineSpec | None:
        continuation, options = self.continuation, list(self.options)
        if self.kv_budget is not None:
            if self.engine is not None or continuation not in (None, "cells/v1"):
                raise LarqlError("`kv_budget` applies to cells/v1: drop `engine`, or use `continuation` cells/v1")
            if any(o.partition("=")[0].strip() == "budget" for o in options):
                raise LarqlError("`kv_budget` and the cells/v1 option budget are one setting; give one")
            try:
                parse_size(self.kv_budget)
            except ValueError as e:
                raise LarqlError(f"`kv_budget`: {e}") from None
            continuation = "cells/v1"
            options.append(f"budget={self.kv_budget}")
        chosen = self.engine is not None or continuation is not None or options
        spec = parse_engine_spec(self.engine, continuation, options) if chosen or self.resume is None else None
        if spec is not None and (self.save_state or self.resume):
            spec.stateful("be saved or resumed")
        if self.n > 1 and (self.save_state or self.resume):
            raise LarqlError("`n` > 1 makes several states of one prompt: it cannot `save_state` or `resume`")
        if self.reprefill and self.resume is None:
            raise LarqlError("`reprefill` only makes sense with `resume`")
        if self.save_state is not None:
            check_output(self.save_state, "`save_state`")
        return spec


# -- the checks every spelling shares ----------------------------------------------------------------

def generation(raw: dict[str, Any]) -> GenerationConfig:
    """Generation settings in the flat spelling (flags, a batch line, the Python API), each checked."""
    for key in ("max_tokens", "top_k", "seed", "prefill_chunk", "logprobs", "repeat_last_n", "draft_tokens", "lookup"):
        integer(raw, key)
    for key in ("temperature", "top_p", "draft_p_min", *SHAPING):
        number(raw, key)
    for key in ("stop_at_eos", "draft_fixed"):
        if raw.get(key) is not None and not isinstance(raw[key], bool):
            raise LarqlError(f"`{key}` must be a boolean, got {_json_type(raw[key])}")
    stop = raw.get("stop")
    if stop is not None:
        raw = {**raw, "stop": stops(stop)}
    raw = {**raw, "grammar": _grammar(raw), "logit_bias": _logit_bias(raw.get("logit_bias")),
           "thinking_budget": _thinking(raw)[1]}
    return GenerationConfig.from_dict(raw)


def chat_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """A chat's `thinking` (from `reasoning_effort` too) and `chat_template_kwargs`, as Request fields."""
    extra = raw.get("chat_template_kwargs")
    if extra is not None:
        if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
            raise LarqlError("`chat_template_kwargs` must be an object of template variables")
        taken = [k for k in RENDERED if k in extra]
        if taken:
            raise LarqlError(f"`chat_template_kwargs` cannot set `{taken[0]}`: the request gives it")
    return {"thinking": _thinking(raw)[0], "chat_template_kwargs": extra or None}


def _thinking(raw: dict[str, Any]) -> tuple[bool | None, int | None]:
    """`reasoning_effort`, `thinking` and `thinking_budget` as (thinking on, off or as the template has
    it; the budget in tokens): an effort of none or minimal is thinking off, another a budget (EFFORT)."""
    effort, on, budget = raw.get("reasoning_effort"), raw.get("thinking"), integer(raw, "thinking_budget")
    if on is not None and not isinstance(on, bool):
        raise LarqlError(f"`thinking` must be a boolean, got {_json_type(on)}")
    if effort is None:
        return on, budget
    if effort not in EFFORT:
        raise LarqlError(f"`reasoning_effort` is one of {', '.join(EFFORT)}, got {effort!r}")
    if budget is not None:
        raise LarqlError("`reasoning_effort` and `thinking_budget` are one setting; give one")
    if on is not None and on != bool(EFFORT[effort]):
        raise LarqlError(f"`reasoning_effort` {effort} and `thinking` {str(on).lower()} disagree")
    return bool(EFFORT[effort]), EFFORT[effort] or None


def _grammar(raw: dict[str, Any]) -> Grammar | None:
    """The one grammar the flat spelling may give (`json_schema`, `regex`, `grammar` or OpenAI's
    `response_format`), compiled once here so that one that cannot be is refused before any work."""
    given = [k for k in GRAMMAR_FIELDS if raw.get(k) is not None]
    if len(given) > 1:
        raise LarqlError(f"give one of {', '.join(f'`{k}`' for k in given)}: each is a grammar for the whole output")
    if not given:
        return None
    key = given[0]
    if key == "response_format":
        grammar = _response_format(raw[key])
    elif key == "json_schema":
        grammar = Grammar("json_schema", schema_text(raw[key]))
    else:
        if not isinstance(raw[key], str) or not raw[key]:
            raise LarqlError(f"`{key}` must be a non-empty string")
        grammar = Grammar(key, utf8(raw[key], f"`{key}`"))
    if grammar is not None:
        check_grammar(grammar, key)
    return grammar


def choices(raw: dict[str, Any]) -> int:
    n = integer(raw, "n")
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise LarqlError(f"`n` must be in 1..{MAX_CHOICES}, got {n}")
    return n or 1


def tools_of(raw: dict[str, Any], gen: GenerationConfig) -> ToolUse | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked; a forced call's grammar compiled
    once here, so that parameters no grammar can be made of are refused before any work."""
    use = tool_use(raw.get("tools"), raw.get("tool_choice"), raw.get("parallel_tool_calls", True))
    if use is None:
        return None
    if raw.get("messages") is None:
        raise LarqlError("`tools` need `messages`: tools are offered in a chat")
    if use.forced and gen.grammar is not None:
        raise LarqlError("a required tool call is a grammar of its own: give `tool_choice` \"required\" "
                         "(or a named function) or a grammar such as `response_format`, not both")
    if use.forced:
        try:
            text = call_grammar(use)
        except RecursionError:  # parameters given as a dict (the API) nested past what json.dumps takes
            raise LarqlError("`tools` are nested too deeply") from None
        check_grammar(Grammar("grammar", text), "tools")
    return use


def _response_format(value: Any) -> Grammar | None:
    """OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise LarqlError("`response_format` json_schema must be an object with a `schema` object")
        return Grammar("json_schema", schema_text(spec.get("schema", {})))
    raise LarqlError("`response_format` must be an object whose type is text, json_object or json_schema")


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{"id": bias, ...} (JSON's keys are strings) as (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise LarqlError("`logit_bias` must be an object mapping token ids to biases")
    pairs = []
    for k, v in value.items():
        if not (isinstance(k, int) or (isinstance(k, str) and k.strip().isdigit())) or isinstance(v, bool) or \
                not isinstance(v, (int, float)) or not math.isfinite(v):
            raise LarqlError(f"`logit_bias` maps token ids to numbers, got {k!r}: {v!r}")
        pairs.append((int(k), float(v)))
    return tuple(pairs)


def stops(value: Any, most: int | None = None) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = (value,) if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops) or \
            (most is not None and len(stops) > most):
        raise LarqlError("`stop` must be a string or a list of " + (f"at most {most} strings" if most else "strings"))
    if any(s == "" for s in stops):
        raise LarqlError("`stop` strings must not be empty")
    return tuple(utf8(s, "`stop`") for s in stops)


def options_of(opts: Any) -> tuple[str, ...]:
    """An engine's options as an object or a list of "key=value" strings."""
    if isinstance(opts, dict):
        return tuple(f"{k}={v}" for k, v in opts.items())
    if isinstance(opts, (list, tuple)) and all(isinstance(o, str) for o in opts):
        return tuple(opts)
    raise LarqlError("`options` must be an object or a list of 'key=value' strings")


def messages_of(messages: Any) -> tuple[dict, ...]:
    check_messages(messages)
    kept = []
    for m in messages:
        utf8(m.get("content") or "", "`messages`")
        one = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            one["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
                "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        if isinstance(m.get("reasoning_content"), str):  # an earlier answer's, for templates that take it
            utf8(m["reasoning_content"], "`messages`")
        one.update({k: m[k] for k in ("tool_call_id", "name", "reasoning_content") if isinstance(m.get(k), str)})
        kept.append(one)
    return tuple(kept)


def _arguments(args: str | dict) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def integer(raw: dict, key: str) -> int | None:
    v = raw.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise LarqlError(f"`{key}` must be an integer")
    return v


def number(raw: dict, key: str, lo: float = -math.inf, hi: float = math.inf, default: float | None = None,
            lo_open: bool = False) -> float | None:
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise LarqlError(f"`{key}` must be a number")
    if not math.isfinite(v):
        raise LarqlError(f"`{key}` must be a finite number, got {v}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise LarqlError(f"`{key}` must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def token_ids(ids: Any) -> list[int]:
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise LarqlError("`prompt` must be a non-empty string, or a list of token ids")
    return list(ids)


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)
