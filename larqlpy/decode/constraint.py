"""Constrained decoding through llguidance (docs/structured.md says why llguidance): a grammar
compiled once per request, a matcher per sequence that says which ids may come next, and what a
sampled id does to it. No torch here: the request checks a grammar before any weights load.

A JSON Schema is held to one layout -- ", " between items, ": " after keys, no other whitespace --
so a model cannot spend its tokens on blank space; the text still parses as any JSON does.
"""

from __future__ import annotations

import functools
import json
from typing import Iterable

import llguidance as llg
import numpy as np

from larqlpy.config import Grammar
from larqlpy.errors import LarqlError
from larqlpy.text.tokenizer import added_as_text
from larqlpy.text.tools import JSON_LAYOUT

_VOCABULARIES: dict[tuple, "Vocabulary"] = {}
# llguidance's errors without its parser state and grammar appended (pages of internals, in a 400)
_LIMITS = llg.LLParserLimits(verbose_errors=False)
PROBE_STEPS = 64  # bytes a grammar is walked at the boundary (past a forced tool call's opening)


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
        raise LarqlError(f"`{what}` cannot be compiled: {reason(str(e))}") from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, limits=_LIMITS)
    if failed:
        raise LarqlError(f"`{what}` cannot be compiled: {reason(messages[0])}")
    return text


def check_grammar(grammar: Grammar, what: str = "grammar") -> str:
    """`compile_grammar`, and the grammar's first PROBE_STEPS bytes walked (each step the first byte
    it allows) on a vocabulary of the 256 bytes: what compiles but fails at the first mask (no text
    can match: `{"$ref": "#"}`) or the first token (more than llguidance can bound: `a{1000000}`)
    is refused here, at the boundary, for every tokenizer alike, not with a sequence under way."""
    text = compile_grammar(grammar, what)
    matcher = llg.LLMatcher(_bytes(), text, log_level=0, limits=_LIMITS)
    words = np.zeros(9, dtype=np.int32)  # 257 ids: the bytes and an end
    for _ in range(PROBE_STEPS):
        if matcher.is_error() or matcher.is_stopped():
            break
        matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:256])
        if matcher.is_error() or not allowed.size:  # nothing but the end may follow
            break
        matcher.consume_token(int(allowed[0]))
    if matcher.is_error():
        raise LarqlError(f"`{what}` cannot be compiled: {reason(matcher.get_error())}")
    return text


def reason(message: str) -> str:
    """llguidance's reason in one line: its state is not appended (_LIMITS), and its terse word for
    a grammar that nothing can match is said plainly."""
    text = one_line(message.replace("<non-verbose/>", ""))
    return "no text can match it" if text == "NoExtensionBias" else text


def one_line(message: str, most: int = 300) -> str:
    text = " ".join(message.split())
    return text if len(text) <= most else text[:most - 3] + "..."


@functools.cache
def _bytes() -> "llg.LLTokenizer":
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens()))


class _ByteTokens:
    """The 256 bytes as tokens, and an end (256): what `check_grammar` walks a grammar on."""
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<end>"]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


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
            _VOCABULARIES[key] = cls(added_as_text(tokenizer.to_json()), size, tokenizer.stop_ids)
        return _VOCABULARIES[key]


class Constraint:
    """One sequence's place in its grammar: which ids may come next (`allowed`), what a sampled id
    does (`accept`), and whether the grammar is complete (`done`: only an end may follow)."""

    def __init__(self, vocab: Vocabulary, grammar: str):
        self.vocab = vocab
        self.matcher = llg.LLMatcher(vocab.inner, grammar, log_level=0, limits=_LIMITS)
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
            raise LarqlError(f"the output grammar failed: {reason(self.matcher.get_error())}")


def schema_text(schema) -> str:
    """A JSON Schema given as an object or as its JSON text, as JSON text (checked to be an object)."""
    try:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise LarqlError("`json_schema` must be a JSON object (a JSON Schema)")
        return json.dumps(schema)
    except json.JSONDecodeError as e:
        raise LarqlError(f"`json_schema` is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:  # as a batch line or a server's body nested as deeply is refused
        raise LarqlError("`json_schema` is not valid JSON (nested too deeply)") from None
