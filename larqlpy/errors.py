"""The one error type bad input raises; an interface turns it into a single line and exit code 2.

Messages speak the library's language: a parameter is named as the Python API spells it, in
backticks (`temperature`, `options`), and a suggested configuration travels as data (`suggest`, an
engines.presets preset). `str()` reads them as they are; an interface spells them its own way with
`render` (the CLI: --temperature, --continuation-option, and flags for the preset).
"""

from __future__ import annotations

import re
from typing import Callable

NAMED = re.compile(r"`([a-z][a-z0-9_]*)`")


class LarqlError(Exception):
    """Bad input at a boundary (argument, model directory, GGUF file, engine spec, state file)."""

    exit_code = 2

    def __init__(self, message: str, suggest: tuple | None = None):
        super().__init__(message)
        self.message, self.suggest = message, suggest

    def render(self, name: Callable[[str], str | None] = lambda n: None,
               preset: Callable[[tuple], str] | None = None) -> str:
        """The message with each `parameter` spelled `name(parameter)` (None: kept as it is), and the
        suggestion spelled by `preset`."""
        text = spell(self.message, name)
        if self.suggest is not None:
            text += "; recommended: " + (preset or _describe)(self.suggest)
        return text

    def __str__(self) -> str:
        return self.render()


def _describe(preset: tuple) -> str:
    return " ".join([preset[0], *(f"{k}={v}" for k, v in preset[1])])


def spell(text: str, name: Callable[[str], str | None]) -> str:
    """Library text with each `parameter` spelled `name(parameter)` (None: kept as it is)."""
    return NAMED.sub(lambda m: name(m.group(1)) or m.group(0), text)


def failure(e: Exception) -> str:
    """What a record or a response says of an exception: a refusal's own line, or the error's kind."""
    return str(e) if isinstance(e, LarqlError) else f"{type(e).__name__}: {e}"
