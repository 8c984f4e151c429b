"""How each chat-template family's model writes tool calls, one registry (no torch, no jinja2): a
format is told from its template's source, shapes the conversation's calls and results for that
template, writes the Lark grammar (llguidance's) that forces a call, and reads calls out of a
reply as it streams (`scan`, a piece at a time) or once it has ended (`finish`).

    hermes        Qwen2/2.5/3, Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3        Llama 3.1+: a bare {"name": ..., "parameters": {...}} (after an optional <|python_tag|>)
    mistral       Mistral 7B v0.3, Nemo: [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]
    mistral_args  Mistral Small 3.2, Magistral, Devstral: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}, [CALL_ID] optional
    deepseek      V3, R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
                  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    deepseek_v31  V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
    generic       a template that knows no tools: the hermes form, described in a system message

Qwen3's template writes calls and results exactly as Qwen2.5's does (tests/test_tool_formats.py
reads its own rendering back), so it is the hermes format.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from typing import Any, Callable

Call = tuple[str, Any, "str | None"]  # a call as written: its name, its arguments (parsed JSON), its id if any

# JSON held to one layout, json.dumps' own (grammars' JSON too: decode/constraint.py): a model cannot
# spend tokens on blank space, and a call it makes re-renders in the next prompt as the same text
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3: what may come before a call
TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
SHORT_ID = re.compile(r"^[A-Za-z0-9]{9}$")  # Mistral's templates refuse any other call id
_ALNUM = string.ascii_letters + string.digits


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array that opens at `start` closes (the index after it), or None
    while it has not closed yet: brackets counted outside strings."""
    depth, inside, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if escaped:
            escaped = False
        elif inside:
            escaped, inside = c == "\\", c != '"'
        elif c == '"':
            inside = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def call_object(obj: Any) -> Call | None:
    """{"name": ..., "arguments" | "parameters": ..., "id"?: ...} as a call, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    ident = obj.get("id")
    return obj["name"], obj.get("arguments", obj.get("parameters", {})), ident if isinstance(ident, str) else None


def short_id(ident: Any = None) -> str:
    """A Mistral call id: 9 letters and digits -- `ident` kept when it is one, else made from it
    the same way every time (a conversation re-renders as the same prompt), or drawn afresh."""
    if isinstance(ident, str) and SHORT_ID.match(ident):
        return ident
    raw = hashlib.sha256(ident.encode()).digest() if isinstance(ident, str) else secrets.token_bytes(16)
    return "".join(_ALNUM[b % len(_ALNUM)] for b in raw[:9])


class Format:
    """The hermes format; the others change what differs. `opens`: where a call begins in a reply
    (None: only a bare JSON answer is a call); `noise`: wrappers around calls, neither content nor
    calls; `markers`: the texts a vocabulary may hold as one token each, forced as that token."""

    name = "hermes"
    opens: str | None = OPEN
    noise: tuple[str, ...] = ()
    markers: tuple[str, ...] = (OPEN, CLOSE)
    key = "arguments"  # what the call object names its arguments

    def told(self, source: str) -> bool:
        return OPEN in source

    def message(self, m: dict) -> dict:
        """An OpenAI message as this family's template takes it: a call's arguments as an object
        (OpenAI sends a JSON string; templates `tojson` it)."""
        if not m.get("tool_calls"):
            return dict(m)
        calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                 for c in m["tool_calls"]]
        return {**m, "tool_calls": calls}

    def new_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    # -- reading a reply: the text after `opens` -----------------------------------------------------

    def scan(self, text: str) -> tuple[list[Call] | None, int] | None:
        """The call(s) that begin `text` and how many characters they took (calls None: not a
        call, that text is content), or None while they may still be coming."""
        end = text.find(CLOSE)
        if end < 0:
            return None
        return self.finish(text[:end]), end + len(CLOSE)

    def finish(self, text: str) -> list[Call] | None:
        """What is left once the reply has ended (a call without its closing tag), or None."""
        call = call_object(_loads(text.strip()))
        return [call] if call is not None else None

    # -- forcing a call -------------------------------------------------------------------------------

    def grammar(self, functions: list[dict], many: bool, tag: Callable[[str], str]) -> str:
        """A Lark grammar whose every sentence is one call of `functions` (`many`: or several);
        `tag(text)` spells a marker, as its one token where the vocabulary has it."""
        repeat = ' ("\\n" block)*' if many else ""
        return (f'start: block{repeat}\nblock: open "\\n" call "\\n" close\nopen: {tag(OPEN)}\nclose: {tag(CLOSE)}\n'
                f"call: %json {json.dumps(call_schema(functions, self.key))}\n")


class Generic(Format):
    name = "generic"

    def told(self, source: str) -> bool:
        return True


class Llama3(Format):
    name, opens, markers, key = "llama3", None, (), "parameters"

    def told(self, source: str) -> bool:
        return "tools" in source and (PYTHON_TAG in source or "<|eom_id|>" in source)

    def grammar(self, functions: list[dict], many: bool, tag: Callable[[str], str]) -> str:
        return f"start: call\ncall: %json {json.dumps(call_schema(functions, self.key))}\n"


class Mistral(Format):
    """[TOOL_CALLS] then a JSON list of calls (`named` False), or calls as NAME[CALL_ID]ID[ARGS]{...},
    each after its own [TOOL_CALLS] (`named`). Either is read under both names: a model writes
    what it was trained on, whichever template it is served with."""

    opens, markers = TOOL_CALLS, (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self, named: bool):
        self.named = named
        self.name = "mistral_args" if named else "mistral"

    def told(self, source: str) -> bool:
        return TOOL_CALLS in source and (ARGS in source) == self.named

    def message(self, m: dict) -> dict:
        out = super().message(m)
        if out.get("tool_calls"):
            out["tool_calls"] = [{**c, "id": short_id(c.get("id"))} for c in out["tool_calls"]]
        if m["role"] == "tool":
            out["tool_call_id"] = short_id(m.get("tool_call_id"))
        return out

    def new_id(self) -> str:
        return short_id()

    def scan(self, text: str) -> tuple[list[Call] | None, int] | None:
        start = len(text) - len(text.lstrip())
        if start == len(text):
            return None
        if text[start] in "[{":  # the JSON list (or one object)
            end = _json_end(text, start)
            return None if end is None else (self.finish(text[:end]), end)
        at = text.find(ARGS)
        if at < 0:
            return None if len(text) < 200 else (None, len(text))  # a name runs 64 characters at most
        body = at + len(ARGS)
        body += len(text[body:]) - len(text[body:].lstrip())
        end = _json_end(text, body) if body < len(text) else None
        return None if end is None else (self.finish(text[:end]), end)

    def finish(self, text: str) -> list[Call] | None:
        text = text.strip()
        if text[:1] in "[{":
            listed = _loads(text)
            listed = listed if isinstance(listed, list) else [listed]
            calls = [call_object(c) for c in listed]
            return calls if calls and None not in calls else None
        head, sep, args = text.partition(ARGS)
        name, _, ident = head.partition(CALL_ID)
        args = _loads(args)
        return [(name.strip(), args, ident.strip() or None)] if sep and args is not None else None

    def grammar(self, functions: list[dict], many: bool, tag: Callable[[str], str]) -> str:
        if not self.named:
            schema = call_schema(functions, "arguments", {"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}})
            repeat = ' (", " call)*' if many else ""
            return (f'start: open " "? "[" call{repeat} "]"\nopen: {tag(TOOL_CALLS)}\n'
                    f"call: %json {json.dumps(schema)}\n")
        rules = [f'call_{i}: open {json.dumps(f["name"])} ident? args args_{i}\n'
                 f'args_{i}: %json {json.dumps(arguments_schema(f))}' for i, f in enumerate(functions)]
        return (f'start: call{"+" if many else ""}\ncall: {" | ".join(f"call_{i}" for i in range(len(functions)))}\n'
                f'ident: callid /[A-Za-z0-9]{{9}}/\nopen: {tag(TOOL_CALLS)}\nargs: {tag(ARGS)}\n'
                f"callid: {tag(CALL_ID)}\n" + "\n".join(rules) + "\n")


class DeepSeek(Format):
    """Each call between <｜tool▁call▁begin｜> and <｜tool▁call▁end｜>, the lot between
    <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>; inside, V3's `function<｜tool▁sep｜>NAME` and
    its arguments in a ```json block (`fenced`), or V3.1's NAME<｜tool▁sep｜>ARGUMENTS. Its
    templates join a call's `arguments` into the text as they are: they stay JSON text."""

    opens, noise, markers = DS_CALL, (DS_CALLS, DS_CALLS_END), (DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END, DS_SEP)

    def __init__(self, fenced: bool):
        self.fenced = fenced
        self.name = "deepseek" if fenced else "deepseek_v31"

    def told(self, source: str) -> bool:
        return DS_SEP in source and ("```json" in source) == self.fenced

    def message(self, m: dict) -> dict:
        # the R1 template renders calls only on a message whose content is none
        return {**m, "content": m.get("content") or None} if m.get("tool_calls") else dict(m)

    def scan(self, text: str) -> tuple[list[Call] | None, int] | None:
        end = text.find(DS_CALL_END)
        return None if end < 0 else (self.finish(text[:end]), end + len(DS_CALL_END))

    def finish(self, text: str) -> list[Call] | None:
        head, sep, args = text.partition(DS_SEP)
        if not sep:
            return None
        name = head.strip()
        if self.fenced or name == "function":  # V3's form, under either name
            name, _, args = args.partition("\n")
            args = args.strip().removeprefix("```json").removesuffix("```")
        args = _loads(args.strip())
        return [(name.strip(), args, None)] if args is not None else None

    def grammar(self, functions: list[dict], many: bool, tag: Callable[[str], str]) -> str:
        rules = []
        for i, f in enumerate(functions):
            name = json.dumps(f["name"])
            body = f'"function" sep {name} "\\n```json\\n" args_{i} "\\n```"' if self.fenced else f"{name} sep args_{i}"
            rules.append(f"call_{i}: begin {body} end\nargs_{i}: %json {json.dumps(arguments_schema(f))}")
        repeat = (' ("\\n" call)*' if self.fenced else " call*") if many else ""
        return (f"start: calls call{repeat} calls_end\ncall: {' | '.join(f'call_{i}' for i in range(len(functions)))}\n"
                f"calls: {tag(DS_CALLS)}\ncalls_end: {tag(DS_CALLS_END)}\nbegin: {tag(DS_CALL)}\n"
                f"end: {tag(DS_CALL_END)}\nsep: {tag(DS_SEP)}\n" + "\n".join(rules) + "\n")


def arguments_schema(function: dict) -> dict:
    return {"x-guidance": JSON_LAYOUT, **(function.get("parameters") or {"type": "object"})}


def call_schema(functions: list[dict], key: str, extra: dict | None = None) -> dict:
    """The JSON Schema of a call object to one of `functions`: its name, its arguments under `key`."""
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 key: f.get("parameters") or {"type": "object"}, **(extra or {})},
                "required": ["name", key], "additionalProperties": False} for f in functions]
    return {"x-guidance": JSON_LAYOUT, **(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})}


# The order they are told in: the first whose `told` says yes (generic last, saying yes to all).
FORMATS: tuple[Format, ...] = (Mistral(True), Mistral(False), DeepSeek(True), DeepSeek(False), Format(), Llama3(),
                               Generic())
BY_NAME = {f.name: f for f in FORMATS}
MARKERS = tuple(dict.fromkeys(m for f in FORMATS for m in (*f.markers, *f.noise)))  # every format's, once


def told(template_source: str) -> Format:
    return next(f for f in FORMATS if f.told(template_source))
