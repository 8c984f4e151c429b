"""Constrained decoding through llguidance (docs/structured.md says why llguidance): a grammar
compiled once per request, a matcher per sequence that says which ids may come next, and what a
sampled id does to it. No torch here: the request checks a grammar before any weights load.

A JSON Schema is held to one layout -- ", " between items, ": " after keys, no other whitespace --
so a model cannot spend its tokens on blank space; the text still parses as any JSON does.
"""

from __future__ import annotations

import json
from typing import Iterable

import llguidance as llg
import numpy as np

from larqlpy.config import Grammar
from larqlpy.errors import LarqlError
from larqlpy.text.tools import JSON_LAYOUT

_VOCABULARIES: dict[tuple, "Vocabulary"] = {}


def compile_grammar(grammar: Grammar, what: str = "grammar") -> str:
    """llguidance's grammar for `grammar`, or a one-line refusal naming `what` (the field it came in)."""
    try:
        if grammar.kind == "json_object":
            text = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        elif grammar.kind == "json_schema":
            text = llg.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_LAYOUT)
        elif grammar.kind == "regex":
            text = llg.LLMatcher.grammar_from_regex(grammar.text)
        else:  # Lark, or llama.cpp's GBNF (llguidance converts it)
            text = llg.grammar_from("grammar", grammar.text)
    except ValueError as e:
        raise LarqlError(f"`{what}` cannot be compiled: {one_line(str(e))}") from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        raise LarqlError(f"`{what}` cannot be compiled: {one_line(messages[0])}")
    return text


def one_line(message: str, most: int = 300) -> str:
    text = " ".join(message.split())
    return text if len(text) <= most else text[:most - 3] + "..."


class Vocabulary:
    """A model's tokens as llguidance sees them (built once per tokenizer: about a second at 150K
    tokens). `ends`: the ids that end a turn, which the grammar allows once it may end."""

    def __init__(self, tokenizer_json: str, size: int, ends: Iterable[int]):
        self.size = size
        self.inner = llg.LLTokenizer(tokenizer_json, n_vocab=size, eos_token=sorted(ends))

    @classmethod
    def of(cls, tokenizer, size: int) -> "Vocabulary":
        key = (tokenizer.fingerprint, size, tuple(sorted(tokenizer.stop_ids)))
        if key not in _VOCABULARIES:
            _VOCABULARIES[key] = cls(tokenizer.to_json(), size, tokenizer.stop_ids)
        return _VOCABULARIES[key]


class Constraint:
    """One sequence's place in its grammar: which ids may come next (`allowed`), what a sampled id
    does (`accept`), and whether the grammar is complete (`done`: only an end may follow)."""

    def __init__(self, vocab: Vocabulary, grammar: str):
        self.vocab = vocab
        self.matcher = llg.LLMatcher(vocab.inner, grammar, log_level=0)
        self._check()
        self.words = np.zeros((vocab.size + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """A bool per id: may it come next."""
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        self._check()
        return np.unpackbits(self.words.view(np.uint8), bitorder="little")[:self.vocab.size].view(bool)

    def accept(self, tok: int) -> None:
        if not self.matcher.consume_token(tok):
            self._check()

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    def rollback(self, n: int) -> None:
        """Forget the last n accepted ids."""
        if n and not self.matcher.rollback(n):
            self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise LarqlError(f"the output grammar failed: {one_line(self.matcher.get_error())}")


def schema_text(schema) -> str:
    """A JSON Schema given as an object or as its JSON text, as JSON text (checked to be an object)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise LarqlError(f"`json_schema` is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") \
                from None
    if not isinstance(schema, dict):
        raise LarqlError("`json_schema` must be a JSON object (a JSON Schema)")
    return json.dumps(schema)
