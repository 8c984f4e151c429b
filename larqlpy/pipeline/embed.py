"""Embedding inputs made into sequences, the same way for the server and the Python API: OpenAI's
`input` (a string, strings, token ids, or lists of token ids) checked, tokenized, fitted to the
context, and each made an `Embedding` (decode/embed.py) that the scheduler runs beside generation.
Every refusal raises LarqlError here, before anything runs."""

from __future__ import annotations

from typing import Any

from larqlpy.config import GenerationConfig, check_pooling
from larqlpy.decode.embed import Embedding
from larqlpy.errors import LarqlError
from larqlpy.files import utf8
from larqlpy.weights.loader import LoadedModel

Input = str | list[int]


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def one_input(value: Any) -> bool:
    """Whether `input` is one input (a text, or one list of ids) rather than a list of them."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value) and all(_is_id(t) for t in value))


def inputs_of(value: Any, most: int | None = None) -> list[Input]:
    """OpenAI's `input` as a list of inputs, each a string or a list of token ids; an empty one, or
    more than `most`, refused."""
    if one_input(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise LarqlError("`input` must be a non-empty string, a list of strings, a list of token ids or a list of "
                         "lists of token ids")
    if most is not None and len(value) > most:
        raise LarqlError(f"`input` has {len(value):,} inputs; this server takes at most {most:,} a request")
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise LarqlError(f"`input`[{i}] is an empty string: nothing to embed")
            utf8(item, f"`input`[{i}]")
        elif not isinstance(item, list) or not item or not all(_is_id(t) for t in item):
            raise LarqlError(f"`input`[{i}] must be a non-empty string or a non-empty list of token ids")
    return value


def input_ids(loaded: LoadedModel, item: Input, i: int) -> list[int]:
    """One input's ids (a text tokenized as a prompt is: BOS where the model wants one), checked
    against the vocabulary and the context."""
    ids = loaded.tokenizer.encode(item) if isinstance(item, str) else item
    vocab, context = loaded.config.vocab_size, loaded.config.max_position_embeddings
    if isinstance(item, list) and (max(ids) >= vocab or min(ids) < 0):
        raise LarqlError(f"`input`[{i}]: token ids must be in [0, {vocab})")
    if len(ids) > context:
        raise LarqlError(f"`input`[{i}] is {len(ids):,} tokens; the model's context is {context:,} positions")
    return list(ids)


def embeddings(loaded: LoadedModel, items: list[Input], pooling: str | None = None, request: Any = None,
               prefill_chunk: int = GenerationConfig.prefill_chunk) -> list[Embedding]:
    """Each input as a sequence that prefills it, `prefill_chunk` rows a step, and pools its final
    hidden states (`pooling`: config.POOLINGS; None: the default, the last row)."""
    pooling = check_pooling(pooling)
    return [Embedding(loaded.model, input_ids(loaded, item, i), pooling, prefill_chunk=prefill_chunk, key=i,
                      request=request) for i, item in enumerate(items)]
