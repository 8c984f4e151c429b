"""OpenAI's /v1/embeddings as larqlpy serves it: the body read (`read_request`: every refusal a
LarqlError or an ApiError, before anything queues), its inputs made into sequences that the engine
thread's scheduler runs beside generation (pipeline/embed.py), and the answer (`response`): each
vector as a list of floats or, as OpenAI sends it, base64 of its little-endian float32 bytes."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from larqlpy.config import ServeConfig, check_pooling
from larqlpy.decode.embed import Embedding
from larqlpy.errors import LarqlError
from larqlpy.pipeline.embed import Input, embeddings, inputs_of
from larqlpy.pipeline.request import integer
from larqlpy.weights.loader import LoadedModel

FORMATS = ("float", "base64")
EXTENSION = ("pooling",)  # the body's "larqlpy" object here


@dataclass(frozen=True)
class Asked:
    """An /v1/embeddings body, read."""

    inputs: tuple[Input, ...]
    pooling: str
    base64: bool


def read_request(body: dict, cfg: ServeConfig, width: int) -> Asked:
    """The body's `input`, `encoding_format`, `dimensions` (this model's `width` only: larqlpy does
    not shorten vectors) and `user` (accepted, unused), and `"larqlpy": {"pooling": ...}`."""
    form = body.get("encoding_format") or "float"
    if form not in FORMATS:
        raise LarqlError(f"`encoding_format` must be one of {', '.join(FORMATS)}, got {form!r}")
    dims = integer(body, "dimensions")
    if dims is not None and dims != width:
        raise LarqlError(f"`dimensions` {dims} is not supported: this model's embeddings have {width} dimensions")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise LarqlError("`user` must be a string")
    ext = body.get("larqlpy") or {}
    if not isinstance(ext, dict) or set(ext) - set(EXTENSION):
        raise LarqlError(f"`larqlpy` here is an object with {', '.join(EXTENSION)} only")
    pooling = check_pooling(ext.get("pooling") or cfg.pooling)
    return Asked(tuple(inputs_of(body.get("input"), cfg.max_embed_inputs)), pooling, form == "base64")


def sequences(loaded: LoadedModel, asked: Asked) -> list[Embedding]:
    """Its inputs tokenized and made sequences (on the preparing pool: tokenizing is the slow part)."""
    return embeddings(loaded, list(asked.inputs), asked.pooling, request=asked)


def encoded(vector, as_base64: bool) -> Any:
    """A vector as OpenAI's answer spells it: floats, or base64 of little-endian float32."""
    if as_base64:
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def response(name: str, seqs: list[Embedding]) -> dict:
    asked: Asked = seqs[0].request
    n = sum(len(s.prompt_ids) for s in seqs)
    return {"object": "list", "model": name,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(s.vector, asked.base64)}
                     for i, s in enumerate(seqs)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}

