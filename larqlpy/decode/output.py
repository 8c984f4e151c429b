"""What a sequence lets out: each sampled id's text (the detokenizer), held back while it could still
begin a stop string and cut at one, with its log-probability where asked -- as `Token`s, each with
the `Metrics` snapshot of its moment. The sequence samples ids; this is where they become output
(as mlx-lm's `stream_generate` owns the detokenizer while `generate_step` yields ids)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from larqlpy.decode.logits import Logprob
from larqlpy.decode.stops import Piece, StopStrings


@dataclass(frozen=True)
class Metrics:
    """A snapshot: every Token carries its own."""

    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # fewer than prompt_tokens when a resumed state already held a prefix
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    resident_kv_bytes: int = 0
    resident_kv_by_kind: dict[str, int] = field(default_factory=dict)
    position: int = 0
    proposed_tokens: int = 0  # speculative decoding: ids proposed, those the target kept, target passes
    accepted_tokens: int = 0
    target_steps: int = 0
    draft_choice: dict[str, Any] = field(default_factory=dict)  # the proposal counts chosen, and why
    compile_seconds: float = 0.0  # kernels compiled inside prefill and decode (a cold cache), out of both

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill's logits; decode time covers the rest
        steps = max(self.decode_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance(self) -> float:
        """The share of proposed ids the target kept."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Ids decoded per forward pass of the target (1 without speculation)."""
        return max(self.decode_tokens - 1, 0) / self.target_steps if self.target_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {"prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled_tokens,
               "prefill_seconds": round(self.prefill_seconds, 6), "prefill_tokens_per_s": round(self.prefill_tps, 3),
               "decode_tokens": self.decode_tokens, "decode_seconds": round(self.decode_seconds, 6),
               "decode_tokens_per_s": round(self.decode_tps, 3), "resident_kv_bytes": self.resident_kv_bytes,
               "resident_kv_by_kind": dict(self.resident_kv_by_kind), "position": self.position,
               "compile_seconds": round(self.compile_seconds, 6)}
        if self.target_steps:
            out.update(proposed_tokens=self.proposed_tokens, accepted_tokens=self.accepted_tokens,
                       acceptance_rate=round(self.acceptance, 4), target_steps=self.target_steps,
                       tokens_per_target_step=round(self.tokens_per_step, 4))
            if self.draft_choice:
                out["draft_choice"] = dict(self.draft_choice)
        return out


@dataclass(frozen=True)
class Token:
    id: int
    text: str  # the new text this token completes (may be "" while a UTF-8 sequence is open)
    index: int  # 0-based among the tokens let out
    logits: torch.Tensor  # (V,) float32 logits this token was chosen from
    metrics: Metrics
    finish_reason: str | None = None  # "stop" (a stop id or string, a complete grammar) or "length", on the last
    logprob: Logprob | None = None  # when the request asks for log-probabilities


class Output:
    """One sequence's output: the ids let out, their text and log-probabilities. A stop string ends
    the text at its first character and drops the ids after the one it ends in (`cut`)."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.detokenizer = tokenizer.stream() if tokenizer is not None else None
        self.stops = StopStrings(stop)
        self.ids: list[int] = []  # the ids let out (a stop string drops what follows its cut)
        self.logprobs: list[Logprob | None] = []
        self.text = ""

    @property
    def cut(self) -> bool:
        """A stop string has ended the text."""
        return self.stops.cut

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self.stops.matched

    def take(self, tok: int, logits: torch.Tensor, lp: Logprob | None, stop_id: bool, end: str | None
             ) -> tuple[list[Piece], str | None]:
        """A sampled id: the pieces it lets out, and the finish it makes. `stop_id`: it is a stop id
        (no text of its own; what waited goes out before it). `end`: the output ends with it anyway
        ("stop": the grammar is complete, "length": max_tokens), unless a stop string cut it first."""
        if stop_id:
            out = self.stops.flush()
            if not self.stops.cut:
                out.append(Piece(tok, "", (logits, lp)))
            return out, "stop"
        text = self.detokenizer.step(tok) if self.detokenizer is not None else ""
        out = self.stops.push(Piece(tok, text, (logits, lp)))
        if self.stops.cut:
            return out, "stop"
        if end is not None:
            return out + self.stops.flush(), end
        return out, None

    def cut_logits(self, pieces: list[Piece]) -> torch.Tensor:
        """After a cut: the logits of the last id kept (the one the text ends in)."""
        return (pieces[-1] if pieces else self.stops.dropped[0]).extra[0]

    def release(self, pieces: list[Piece], finish: str | None, metrics: Metrics) -> list[Token]:
        """The pieces as tokens, the last carrying `finish`."""
        out = []
        for i, p in enumerate(pieces):
            logits, lp = p.extra
            last = i == len(pieces) - 1
            out.append(Token(p.id, p.text, len(self.ids), logits, metrics, finish if last else None, lp))
            self.ids.append(p.id)
            self.logprobs.append(lp)
            self.text += p.text
        return out
