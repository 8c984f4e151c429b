"""Tool calls as OpenAI's API spells them and as chat templates and models know them (no torch, no
jinja2): `tools` and `tool_choice` checked at the boundary; the convention a template's model
calls tools in; the conversation's tool messages in the shape templates take; the grammar that
forces a call (`required`, a named function); and the calls read back out of the text, whole or
as it streams.

Conventions, told from the template's source:
    hermes   Qwen2/2.5 and Hermes: the template renders `tools` itself and the model answers
             <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3   Llama 3.1+: the template renders `tools`; the model answers {"name": ..., "parameters": {...}}
    generic  a template that knows no tools (SmolLM2, Gemma 3): the tools and the hermes answer form
             are described in a system message, calls and results are written into the turns as text
Under any of them an answer that is nothing but call objects is read as calls: small models drop
the tags (Qwen2.5-Coder-0.5B answers a weather question with the bare JSON).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from larqlpy.errors import LarqlError

CHOICES = ("auto", "none", "required")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3: what may come before a call
# JSON held to one layout, json.dumps' own (grammars' JSON too: decode/constraint.py): a model cannot
# spend tokens on blank space, and a call it makes re-renders in the next prompt as the same text
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
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
    convention: str = "hermes"

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
    if OPEN in template_source:
        return "hermes"
    if "tools" in template_source and (PYTHON_TAG in template_source or "<|eom_id|>" in template_source):
        return "llama3"
    return "generic"


# -- the conversation, as templates take it ---------------------------------------------------------

def template_messages(messages: list[dict], conv: str, use: ToolUse | None) -> list[dict]:
    """OpenAI messages in the shape templates take: a call's `arguments` as an object (OpenAI sends
    a JSON string; templates `tojson` it), and under the generic convention the tools described in
    the system message and calls and results written into the turns."""
    out = [_parsed_arguments(m) for m in messages]
    if conv != "generic":
        return out
    out = _as_text(out)
    if use is not None and use.choice != "none":
        listing = "\n".join(json.dumps(dict(t), ensure_ascii=False) for t in use.tools)
        prompt = GENERIC_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _parsed_arguments(m: dict) -> dict:
    if not m.get("tool_calls"):
        return dict(m)
    calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in m["tool_calls"]]
    return {**m, "tool_calls": calls}


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
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


# -- forcing a call -----------------------------------------------------------------------------------

def call_grammar(use: ToolUse, single: dict[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's) whose every sentence is a call -- one, to the named function,
    or one or more to any -- with arguments that match the function's parameters. `single`: the
    tags the vocabulary holds as one token (Qwen's <tool_call>), by id: a model writes them so."""
    key = "parameters" if use.convention == "llama3" else "arguments"
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False} for f in use.functions()]
    schema = {"x-guidance": JSON_LAYOUT, **(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})}
    call = f"call: %json {json.dumps(schema)}"
    if use.convention == "llama3":
        return f"start: call\n{call}\n"
    many = ' ("\\n" block)*' if use.name is None and use.parallel else ""

    def tag(text: str) -> str:
        tok = (single or {}).get(text)
        return f'<[{tok}]> | "{text}"' if tok is not None else f'"{text}"'

    return (f'start: block{many}\nblock: open "\\n" call "\\n" close\nopen: {tag(OPEN)}\nclose: {tag(CLOSE)}\n'
            f"{call}\n")


def tag_tokens(ids_of) -> dict[str, int]:
    """The call tags a vocabulary holds as one token each (`ids_of`: text -> its ids)."""
    return {t: ids[0] for t in (OPEN, CLOSE) if len(ids := ids_of(t)) == 1}


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


def openai_call(name: str, arguments: Any) -> dict:
    return {"id": "call_" + secrets.token_hex(12), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _call(text: str, use: ToolUse) -> dict | None:
    """One call's JSON as an OpenAI tool call, or None when it is not one of the request's tools."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    known = {f["name"] for f in use.functions()}
    return openai_call(obj["name"], args) if obj["name"] in known and isinstance(args, dict) else None


class CallStream:
    """Text in as it is generated; out come content strings and calls (dicts) once each is whole.
    Text that may be the start of a call is held back until it is one or is not.

    An answer that begins with a JSON object is read as bare calls once it ends (Llama 3's form,
    and what small Qwen models often write, tags left out); otherwise, except under Llama 3,
    calls are <tool_call> blocks among the content."""

    def __init__(self, use: ToolUse):
        self.use, self.buffer, self.inside, self.after = use, "", False, False  # after: a call just closed
        self.mode: str | None = None  # bare, tagged or plain: told by the answer's first characters

    def feed(self, text: str) -> list:
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head or PYTHON_TAG.startswith(head):
                return []  # it may yet be the tag
            bare = head.startswith(("{", PYTHON_TAG))
            self.mode = "bare" if bare else "plain" if self.use.convention == "llama3" else "tagged"
        if self.mode == "bare":
            return []
        if self.mode == "plain":
            text, self.buffer = self.buffer, ""
            return [text]
        return self._tagged()

    def _tagged(self) -> list:
        out: list = []
        while True:
            if self.after and not self.inside:  # the blank between calls, or after the last, is not content
                self.buffer = self.buffer.lstrip()
                self.after = not self.buffer
            if not self.inside:
                at = self.buffer.find(OPEN)
                if at < 0:
                    keep = _open_prefix(self.buffer)
                    out += [self.buffer[:len(self.buffer) - keep]] if len(self.buffer) > keep else []
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out += [self.buffer[:at]] if at else []
                self.buffer, self.inside = self.buffer[at + len(OPEN):], True
            end = self.buffer.find(CLOSE)
            if end < 0:
                return out
            call = _call(self.buffer[:end].strip(), self.use)
            out.append(call if call is not None else OPEN + self.buffer[:end + len(CLOSE)])
            self.buffer, self.inside, self.after = self.buffer[end + len(CLOSE):], False, call is not None

    def close(self) -> list:
        """What is left when generation ends: bare calls, an unclosed call (a model that stopped
        without its closing tag), or held-back text."""
        text, self.buffer = self.buffer, ""
        if not text:
            return []
        if self.mode == "bare":
            calls = [_call(part, self.use) for part in _json_objects(text)]
            return calls if calls and all(c is not None for c in calls) else [text]
        if self.inside:
            call = _call(text.strip(), self.use)
            return [call] if call is not None else [OPEN + text]
        return [text]


def _open_prefix(text: str) -> int:
    """How many characters at the end of `text` could begin OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
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
