"""What each operation a chat template can run in one step of C would make, estimated from its
operands before it runs (template_bounds.py says why): the intercepted operators (`**`, `*`, `+`,
`%`), str.format, the str and bytes methods that pad, repeat or replace, the calls that keep their
arguments (dict(), namespace(), a macro's varargs, dict.fromkeys), and every filter and global that
builds text or a list. A rule that cannot read its arguments estimates nothing: the operation then
raises its own error for them."""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable

from larqlpy.text.template_bounds import Bounds, measure, refuse_bits, refuse_size, text_size

_STRINGS = (str, bytes, bytearray)
_LISTS = (list, tuple)


def _n(x: Any) -> int:
    """An integer argument (a width, a count) as the operation would take it; 0 for anything else."""
    return x if isinstance(x, int) else 0


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 16 else 10**16  # a literal width in a format string


def _length(x: Any) -> int:
    return len(x) if isinstance(x, _STRINGS) else text_size(x)


def check_binop(op: str, left: Any, right: Any, b: Bounds) -> None:
    """A list is measured as it prints (`text_size`): `[l, l]` made by `[l] * 2` holds l twice."""
    if op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            refuse_bits("'**'", abs(left).bit_length() * right, b)
    elif op == "*":
        if isinstance(left, int) and isinstance(right, int):
            refuse_bits("'*'", abs(left).bit_length() + abs(right).bit_length(), b)
        elif isinstance(right, int) and isinstance(left, (*_STRINGS, *_LISTS)):
            refuse_size("'*'", _length(left) * right, b)
        elif isinstance(left, int) and isinstance(right, (*_STRINGS, *_LISTS)):
            refuse_size("'*'", _length(right) * left, b)
    elif op == "+":
        if isinstance(left, _STRINGS) and isinstance(right, _STRINGS):
            refuse_size("'+'", len(left) + len(right), b)
        elif isinstance(left, _LISTS) and isinstance(right, _LISTS):
            refuse_size("'+'", _length(left) + _length(right), b)
    elif op == "%" and isinstance(left, (str, bytes)):
        refuse_size("'%'", percent_size(left, right), b)


_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _values(args: Any) -> list:
    if isinstance(args, Mapping):
        return list(args.values())
    return list(args) if isinstance(args, tuple) else [args]


def _widest(values: list, numbers: list[int]) -> int:
    return max([*(text_size(v) for v in values), *numbers, 0])


def percent_size(fmt: str | bytes, args: Any) -> int:
    """`fmt % args`: each conversion writes at most the widest argument or its width or precision
    (`*` takes one from the arguments)."""
    specs = _PERCENT.findall(fmt if isinstance(fmt, str) else fmt.decode("latin-1"))
    if not specs:
        return len(fmt)
    values = _values(args)
    numbers = [_number(n) for spec in specs for n in spec if n.isdigit()]
    if any("*" in spec for spec in specs):
        numbers += [abs(v) for v in values if isinstance(v, int)]
    return len(fmt) + len(specs) * _widest(values, numbers)


def format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    """`fmt.format(*args, **kwargs)`: each field writes at most the widest argument or a number in
    its spec (a nested `{}` in a spec takes one from the arguments)."""
    try:
        parts = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # format() refuses it too
    specs = "".join(spec or "" for _, name, spec, _ in parts if name is not None)
    fields = sum(name is not None for _, name, _, _ in parts)
    values = [*args, *kwargs.values()]
    numbers = [_number(n) for n in re.findall(r"\d+", specs)]
    if "{" in specs:
        numbers += [abs(v) for v in values if isinstance(v, int)]
    return sum(len(text) for text, _, _, _ in parts) + fields * _widest(values, numbers)


def _replaced(s: Any, old: Any, new: Any, count: Any) -> int:
    size = text_size(s)
    found = size + 1 if not old else s.count(old) if isinstance(s, (str, bytes)) else size
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return size + found * text_size(new)


def _joined(items: Any, sep: Any) -> int:
    if isinstance(items, str):  # joined character by character
        return len(items) * (1 + text_size(sep))
    return sum(text_size(i) for i in items) + max(len(items) - 1, 0) * text_size(sep)


def _pad(s, width, fillchar=" "):
    return max(len(s), _n(width))


def _expandtabs(s, tabsize=8):
    return len(s) + s.count("\t" if isinstance(s, str) else b"\t") * _n(tabsize)


def _translate(s, table, delete=b""):
    widest = max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, dict) else 1
    return len(s) * widest


# str and bytes methods that write more than they read: (self, the method's own arguments) -> size
METHODS: dict[str, Callable[..., int]] = {
    "center": _pad, "ljust": _pad, "rjust": _pad, "zfill": _pad, "expandtabs": _expandtabs,
    "replace": lambda s, old, new, count=-1: _replaced(s, old, new, count),
    "join": lambda s, items: _joined(items, s), "translate": _translate,
    "encode": lambda s, encoding="utf-8", errors="strict": len(s) * (4 if encoding in ("utf-8", "utf8") else 10),
    "decode": lambda s, encoding="utf-8", errors="strict": 4 * len(s), "hex": lambda s, *_, **__: 3 * len(s),
    **{name: lambda s: 3 * len(s) for name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold")},
}


def _materialized(x: Any) -> Any:
    """What is to be joined or summed as a list, its items counted first (a range, an iterator, a dict's keys)."""
    return x if isinstance(x, (str, list, tuple)) or not isinstance(x, Iterable) else list(x)


def _fromkeys(keys, value=None):
    return text_size(keys) + len(keys) * (text_size(value) + 4)


def check_call(obj: Any, args: tuple, kwargs: dict, b: Bounds, builds: bool = False) -> tuple:
    """A call the template makes, before it runs; returns the arguments to call with. `builds`: it
    keeps its arguments in what it returns (dict(), namespace(), a macro's varargs), each counted
    as often as it is given."""
    if builds:
        refuse_size("a call's arguments", sum(map(text_size, args)) + sum(map(text_size, kwargs.values())), b)
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", None)
    formats = getattr(obj, "__wrapped__", None)  # jinja's sandboxed str.format
    if name in ("format", "format_map") and isinstance(getattr(formats, "__self__", None), str):
        given = ((), args[0]) if name == "format_map" and args and isinstance(args[0], Mapping) else (args, kwargs)
        refuse_size(f"str.{name}()", format_size(formats.__self__, *given), b)
    elif isinstance(owner, (str, bytes, bytearray)) and name in METHODS:
        if name == "join" and args:
            args = (_materialized(args[0]), *args[1:])
        refuse_size(f"{type(owner).__name__}.{name}()", _estimate(METHODS[name], (owner, *args), kwargs), b)
    elif name == "fromkeys" and args:  # dict.fromkeys(keys, value): the value once a key
        args = (_materialized(args[0]), *args[1:])
        refuse_size("dict.fromkeys()", _estimate(_fromkeys, args, kwargs), b)
    elif isinstance(owner, int) and name == "to_bytes":
        refuse_size("int.to_bytes()", _estimate(lambda length=1, *_, **__: _n(length), args, kwargs), b)
    return args


def _estimate(rule: Callable[..., int], args: tuple, kwargs: dict) -> int:
    try:
        return rule(*args, **kwargs)
    except (TypeError, AttributeError, ValueError):
        return 0  # arguments the operation refuses itself


def _json(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    size, items, depth = measure(x) if not isinstance(x, str) else (len(x) + 2, 1, 0)
    step = len(indent) if isinstance(indent, str) else _n(indent)
    return size * (12 if ensure_ascii else 1) + items * (1 + step * depth)


def _urlize(value, trim_url_limit=None, nofollow=False, target=None, rel=None, extra_schemes=None):
    size = text_size(value)  # each word may become a link: <a href="..." rel="..." target="...">...</a>
    return 3 * size + (size // 2 + 1) * (40 + len(target or "") + len(rel or ""))


# filters, by name: (the filter's arguments, past the context jinja passes some) -> size
FILTERS: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80: max(text_size(value), _n(width)),
    "indent": lambda s, width=4, first=False, blank=False: text_size(s) + (
        (s.count("\n") if isinstance(s, str) else text_size(s)) + 1) * (
        len(width) if isinstance(width, str) else _n(width)),
    "wordwrap": lambda s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True: text_size(s) * (
        1 + (len(wrapstring) if isinstance(wrapstring, str) else 1)),
    "replace": lambda s, old, new, count=None: _replaced(s, old, new, count),
    "join": lambda value, d="", attribute=None: _joined(value, d) if isinstance(value, (str, list, tuple)) else 0,
    "list": lambda value: 8 * len(value) if isinstance(value, str) else 0,  # a character an item: 8 bytes and more
    "batch": lambda value, linecount, fill_with=None: text_size(value) + _n(linecount) * (text_size(fill_with) + 2),
    "slice": lambda value, slices, fill_with=None: text_size(value) + _n(slices) * (text_size(fill_with) + 4),
    "format": lambda value, *args, **kwargs: percent_size(value, kwargs or args) if isinstance(
        value, str) else text_size(value),
    "tojson": _json, "urlize": _urlize,
}
# what the other filters may grow their text by (escapes; a percent-encoded UTF-8 byte; ß -> SS)
GROWTH = {"e": 6, "escape": 6, "forceescape": 6, "xmlattr": 6, "urlencode": 12, "upper": 3, "lower": 3, "title": 3,
          "capitalize": 3}
# filters that build no text of their arguments, and no list: what they return they were given, or
# a lazy generator of it
SAFE = {"abs", "attr", "bool", "count", "d", "default", "first", "float", "int", "items", "last", "length",
        "map", "reject", "rejectattr", "round", "random", "select", "selectattr"}


def bounded_filter(name: str, f: Callable, b: Bounds) -> Callable:
    """`f` refusing, before it runs, what would pass the bounds: its arguments measured (an iterator
    taken into a list first, to be counted), its rule's estimate, and a list it returns."""
    if name in SAFE:
        return f
    rule, growth = FILTERS.get(name), GROWTH.get(name, 1)
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # the context jinja passes first

    @functools.wraps(f)  # keeps jinja_pass_arg
    def bounded(*args, **kwargs):
        if len(args) > skip and (isinstance(args[skip], Iterator) or name in ("join", "sum")):
            args = (*args[:skip], _materialized(args[skip]), *args[skip + 1:])
        given = args[skip:]
        if rule is not None:
            size = _estimate(rule, given, kwargs)
        else:
            size = growth * max([text_size(a) for a in (*given, *kwargs.values())] + [0])
        refuse_size(f"the filter '{name}'", size, b)
        out = f(*args, **kwargs)
        if isinstance(out, (list, tuple, dict)) and not (given and isinstance(given[0], str)):
            refuse_size(f"the filter '{name}'", text_size(out), b)  # the same item many times (reverse, list)
        return out

    return bounded


def _lipsum(n=5, html=True, min=20, max=100):
    words = _n(max) if _n(max) > _n(min) else _n(min)
    return 16 * _n(n) * words  # paragraphs of up to `max` words of at most 16 characters


def bounded_global(name: str, f: Callable, rule: Callable[..., int], b: Bounds) -> Callable:
    """A global function (lipsum, strftime_now) refusing, before it runs, what would pass the bounds."""

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        refuse_size(f"{name}()", _estimate(rule, args, kwargs), b)
        return f(*args, **kwargs)

    return bounded


GLOBALS: dict[str, Callable[..., int]] = {
    "lipsum": _lipsum, "strftime_now": lambda fmt: 32 * text_size(fmt),  # %c: 24 characters for 2
}
