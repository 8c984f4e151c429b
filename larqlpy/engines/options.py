"""Engine option values: how each is parsed and what is refused (plain Python, no torch).

A parser takes the option's text and returns its value, or raises ValueError with the reason; the
spec validator (spec.py) turns that into a LarqlError naming the engine and the option.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from larqlpy.kernels.kvcodec.tqformat import WIDTHS


@dataclass(frozen=True)
class OptionSpec:
    name: str
    parse: Callable[[str], object]
    required: bool = False
    help: str = ""


def parse_int(text: str) -> int:
    try:
        return int(str(text), 10)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = parse_int(text)
        if value < lo or (hi is not None and value > hi):
            raise ValueError(f"must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {value}")
        return value
    return parse


def check_width(value: int, choices: Sequence[int] = WIDTHS) -> int:
    """A codec width (bits per coordinate) from `choices`, or ValueError."""
    if value not in choices:
        raise ValueError(f"must be one of {', '.join(map(str, choices))}, got {value}")
    return value


def width_in(choices: Sequence[int] = WIDTHS) -> Callable[[str], int]:
    """The parser of a width option: an integer from `choices`."""
    return lambda text: check_width(parse_int(text), choices)


def on_off(text: str) -> str:
    return one_of("on", "off")(text)


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected {' or '.join(choices)}, got {text!r}")
        return text
    return parse


SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB|TiB|K|M|G)?\s*$", re.IGNORECASE)
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20,
         "g": 2**30, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from `64MiB`, `2GiB`, `1.5GB` or a plain count."""
    m = SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"expected a size like 64MiB, 2GiB or 1000000, got {text!r}")
    n = float(m.group(1)) * UNITS[(m.group(2) or "b").lower()]
    if n < 1:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(n)


LayerWidths = tuple[tuple[int, tuple[int, int] | None], ...]


def parse_layer_bits(text: str) -> LayerWidths:
    """`5:8/4,11:exact` -> ((5, (8, 4)), (11, None)): per-layer K/V widths, or f32 rows."""
    out: dict[int, tuple[int, int] | None] = {}
    for item in str(text).split(","):
        layer, sep, width = item.strip().partition(":")
        try:
            index = int(layer, 10)
        except ValueError:
            index = -1
        if not sep or index < 0:
            raise ValueError(f"expected LAYER:K/V or LAYER:exact items, got {item.strip()!r}")
        if index in out:
            raise ValueError(f"layer {index} given twice")
        if width.strip() == "exact":
            out[index] = None
            continue
        kb, slash, vb = width.partition("/")
        try:
            pair = (check_width(parse_int(kb)), check_width(parse_int(vb)))
        except ValueError:
            pair = None
        if not slash or pair is None:
            raise ValueError(f"layer {index}: expected K/V widths from {', '.join(map(str, WIDTHS))} or 'exact', "
                             f"got {width!r}")
        out[index] = pair
    return tuple(sorted(out.items()))


def canonical_layer_bits(text: str) -> str:
    """The option's value as stored (and saved with states): sorted `LAYER:K/V` / `LAYER:exact` items."""
    return ",".join(f"{i}:exact" if w is None else f"{i}:{w[0]}/{w[1]}" for i, w in parse_layer_bits(text))
