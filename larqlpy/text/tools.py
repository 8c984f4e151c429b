"""Tool calls as OpenAI's API spells them and as chat templates and models know them (no torch, no
jinja2): `tools` and `tool_choice` checked at the boundary; the convention a template's model
calls tools in (text/tool_formats.py, one registry of the families' formats); the conversation's
tool messages in the shape templates take; the grammar that forces a call (`required`, a named
function); and the calls read back out of the text, whole or as it streams.

Under any convention an answer that is nothing but call objects is read as calls: small models drop
the tags (Qwen2.5-Coder-0.5B answers a weather question with the bare JSON).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from larqlpy.errors import LarqlError
from larqlpy.text.tool_formats import BY_NAME, JSON_LAYOUT, MARKERS, OPEN, PYTHON_TAG, Format, call_object, told

CHOICES = ("auto", "none", "required")
__all__ = ["JSON_LAYOUT"]  # decode/constraint.py's, from here as before
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function's name
GENERIC_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass(frozen=True)
class ToolUse:
    """A request's tools (OpenAI tool objects, checked), its choice (auto, none, required, or the
    one function it must call: `name`), and the convention its template calls them in (set when
    the prompt is rendered)."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True  # OpenAI's parallel_tool_calls: False, one call at most
    convention: str = "hermes"  # a name in text/tool_formats.py's registry

    @property
    def format(self) -> Format:
        return BY_NAME[self.convention]

    @property
    def forced(self) -> bool:
        return self.choice == "required" or self.name is not None

    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools if self.name is None or t["function"]["name"] == self.name]


def tool_use(tools: Any, choice: Any, parallel: Any = True) -> ToolUse | None:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked; None when no tools are given."""
    if not isinstance(parallel, bool):
        raise LarqlError("`parallel_tool_calls` must be a boolean")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise LarqlError("`tool_choice` needs `tools`")
        return None
    if not isinstance(tools, list) or not tools:
        raise LarqlError("`tools` must be a non-empty list of {\"type\": \"function\", \"function\": {...}} objects")
    seen = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise LarqlError(f"`tools`[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not isinstance(fn.get("name"), str) or not NAME.match(fn["name"]):
            raise LarqlError(f"`tools`[{i}].function.name must be 1-64 letters, digits, _ . or -")
        if fn["name"] in seen:
            raise LarqlError(f"`tools` names the function {fn['name']!r} twice")
        seen.add(fn["name"])
        if not isinstance(fn.get("parameters", {}), dict):
            raise LarqlError(f"`tools`[{i}].function.parameters must be a JSON Schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise LarqlError(f"`tools`[{i}].function.description must be a string")
    if choice is None or choice in CHOICES:
        return ToolUse(tuple(tools), choice or "auto", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise LarqlError("`tool_choice` is \"auto\", \"none\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name not in seen:
        raise LarqlError(f"`tool_choice` names the function {name!r}, which `tools` does not have")
    return ToolUse(tuple(tools), "function", name, parallel)


def convention(template_source: str) -> str:
    """The name of the tool-call format a template's model writes (text/tool_formats.py)."""
    return told(template_source).name


# -- the conversation, as templates take it ---------------------------------------------------------

def template_messages(messages: list[dict], conv: str, use: ToolUse | None) -> list[dict]:
    """OpenAI messages in the shape the convention's templates take (its format's `message`: calls'
    arguments as objects, or Mistral's short ids), and under the generic convention the tools
    described in the system message and calls and results written into the turns."""
    if conv != "generic":
        return [BY_NAME[conv].message(m) for m in messages]
    out = _as_text([BY_NAME[conv].message(m) for m in messages])
    if use is not None and use.choice != "none":
        listing = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in use.tools)
        prompt = GENERIC_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _as_text(messages: list[dict]) -> list[dict]:
    """Calls as <tool_call> blocks in the assistant's turn; a run of tool results as one user turn
    (templates that know no tools mostly insist that user and assistant alternate)."""
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_result"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_result": True})
        elif m.get("tool_calls"):
            calls = "\n".join(render_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).lstrip("\n")})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_result"} for m in out]


def render_call(name: str, arguments: dict) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


# -- forcing a call -----------------------------------------------------------------------------------

def call_grammar(use: ToolUse, single: dict[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's) whose every sentence is a call in the convention's format --
    one, to the named function, or one or more to any -- with arguments that match the function's
    parameters. `single`: the format's markers the vocabulary holds as one token (Qwen's
    <tool_call>, Mistral's [TOOL_CALLS]), by id: a model writes them so."""

    def tag(text: str) -> str:
        tok = (single or {}).get(text)
        return f"<[{tok}]> | {json.dumps(text)}" if tok is not None else json.dumps(text)

    return use.format.grammar(use.functions(), use.name is None and use.parallel, tag)


def tag_tokens(ids_of) -> dict[str, int]:
    """The call markers (every format's) a vocabulary holds as one token each (`ids_of`: text -> its ids)."""
    return {t: ids[0] for t in MARKERS if len(ids := ids_of(t)) == 1}


# -- reading calls back -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    content: str | None
    calls: tuple[dict, ...] = ()  # OpenAI tool_calls: {"id", "type": "function", "function": {"name", "arguments"}}


def read_reply(text: str, use: ToolUse | None) -> Reply:
    """The assistant's text as content and tool calls (none: the text is all content). Text that
    looks like a call but does not parse stays content."""
    if use is None or use.choice == "none":
        return Reply(text)
    reader = CallStream(use)
    parts = reader.feed(text) + reader.close()
    content = "".join(p for p in parts if isinstance(p, str))
    calls = tuple(p for p in parts if isinstance(p, dict))[:None if use.parallel else 1]
    return Reply(content.strip() or None if calls else content, calls)


def openai_call(name: str, arguments: Any, ident: str | None = None) -> dict:
    """An OpenAI tool call; `ident`: the id the model wrote (Mistral's), else a fresh one (`call_...`)."""
    return {"id": ident or BY_NAME["hermes"].new_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _openai(calls: list | None, use: ToolUse) -> list[dict] | None:
    """Calls as read (name, arguments, id) as OpenAI's, or None when one is not a call to one of
    the request's tools with an object of arguments (some models write them as a JSON string)."""
    if not calls:
        return None
    known, out = {f["name"] for f in use.functions()}, []
    for name, args, ident in calls:
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if name not in known or not isinstance(args, dict):
            return None
        out.append(openai_call(name, args, ident or use.format.new_id()))
    return out


class CallStream:
    """Text in as it is generated; out come content strings and calls (dicts) once each is whole.
    Text that may be the start of a call is held back until it is one or is not.

    An answer that begins with a JSON object is read as bare calls once it ends (Llama 3's form,
    and what small Qwen models often write, tags left out); otherwise calls are read in the
    convention's format among the content (Llama 3's has no tags: the rest is content)."""

    def __init__(self, use: ToolUse):
        self.use, self.format, self.buffer, self.inside = use, use.format, "", False
        self.after = False  # a call just closed: the blank after it is not content
        self.mode: str | None = None  # bare, tagged or plain: told by the answer's first characters
        self.marks = tuple(m for m in (self.format.opens, *self.format.noise) if m)

    def feed(self, text: str) -> list:
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []  # it may yet be the tag
            bare = head.startswith(("{", PYTHON_TAG))
            self.mode = "bare" if bare else "plain" if not self.marks else "tagged"
        if self.mode == "bare":
            return []
        if self.mode == "plain":
            text, self.buffer = self.buffer, ""
            return [text]
        return self._tagged()

    def _tagged(self) -> list:
        out: list = []
        while True:
            if self.after and not self.inside:
                self.buffer = self.buffer.lstrip()
                self.after = not self.buffer
            if not self.inside:
                at, mark = min(((i, m) for m in self.marks if (i := self.buffer.find(m)) >= 0), default=(-1, ""))
                if at < 0:
                    keep = _mark_prefix(self.buffer, self.marks)
                    out += [self.buffer[:len(self.buffer) - keep]] if len(self.buffer) > keep else []
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out += [self.buffer[:at]] if at else []
                self.buffer = self.buffer[at + len(mark):]
                if mark != self.format.opens:  # a wrapper: dropped
                    self.after = True
                    continue
                self.inside = True
            scanned = self.format.scan(self.buffer)
            if scanned is None:
                return out
            calls, used = _openai(scanned[0], self.use), scanned[1]
            out += calls if calls is not None else [self.format.opens + self.buffer[:used]]
            self.buffer, self.inside, self.after = self.buffer[used:], False, calls is not None

    def close(self) -> list:
        """What is left when generation ends: bare calls, an unclosed call (a model that stopped
        without its closing tag), or held-back text."""
        text, self.buffer = self.buffer, ""
        if not text:
            return []
        if self.mode == "bare":
            read = [call_object(_load(part)) for part in _json_objects(text)]
            calls = _openai(read, self.use) if None not in read else None
            return calls if calls is not None else [text]
        if self.inside:
            calls = _openai(self.format.finish(text), self.use)
            return calls if calls is not None else [self.format.opens + text]
        return [text]


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _mark_prefix(text: str, marks: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `marks`."""
    for k in range(min(max(map(len, marks)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-k:]) for m in marks):
            return k
    return 0


def _json_objects(text: str) -> list[str]:
    """Llama 3's calls: one JSON object, or several separated by ';' (an optional <|python_tag|>)."""
    text = text.strip().removeprefix(PYTHON_TAG)
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return [text]
        parts.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \n;":
            at += 1
    return parts
