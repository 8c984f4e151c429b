"""The decode loop, in layers (as mlx-lm layers `generate_step` under `stream_generate`):

- `generate_step(forward, logits, ...)`: sample an id, yield (id, logits), feed the id, repeat --
  forever; whoever consumes it decides when to stop (the last id yielded is never fed).
- `stream_tokens(steps, ...)`: Tokens from those pairs -- text from an incremental detokenizer
  (cost per token independent of the output's length), a fresh metrics snapshot per token, stop
  handling.
- `stream_generate(model, prompt_ids, spec, cfg, ...)`: prefill the prompt, then stream.

`forward(id) -> logits` is where a step meets the model: `Cached` runs one position on the engine
state; `Replay` (no-cache) rebuilds a fresh state from the whole history every step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from larqlpy.config import GenerationConfig, SamplingConfig
from larqlpy.engines import EngineSpec, build_provider
from larqlpy.engines.stores.base import EngineState
from larqlpy.errors import LarqlError


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

    @property
    def prefill_tps(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes from the prefill's logits; decode time covers the rest
        steps = max(self.decode_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled_tokens,
                "prefill_seconds": round(self.prefill_seconds, 6), "prefill_tokens_per_s": round(self.prefill_tps, 3),
                "decode_tokens": self.decode_tokens, "decode_seconds": round(self.decode_seconds, 6),
                "decode_tokens_per_s": round(self.decode_tps, 3), "resident_kv_bytes": self.resident_kv_bytes,
                "resident_kv_by_kind": dict(self.resident_kv_by_kind), "position": self.position}


@dataclass(frozen=True)
class Token:
    id: int
    text: str  # the new text this token completes (may be "" while a UTF-8 sequence is open)
    index: int  # 0-based among generated tokens
    logits: torch.Tensor  # (V,) float32 logits this token was chosen from
    metrics: Metrics
    finish_reason: str | None = None  # "stop" (EOS / end_of_turn) or "length" on the last token


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    """One id from a row of logits. Logits that are not finite (an overflow in the weights'
    arithmetic) are refused rather than sampled from: under greedy decoding the argmax itself tells
    (a NaN anywhere is what argmax picks, and an infinity is the maximum), at no extra pass."""
    if cfg.temperature == 0.0:  # numpy's argmax (the first maximum, as torch's): 12x faster on a CPU row
        cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
        best = int(logits.numpy().argmax()) if cpu else int(torch.argmax(logits))
        if not math.isfinite(float(logits[best])):
            raise non_finite()
        return best
    refuse_non_finite(logits)
    logits = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < cfg.top_p  # always keeps the most likely token
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def prefill(model, state: EngineState, ids: Sequence[int], chunk: int, all_logits: bool = False) -> torch.Tensor:
    """Run ids through the model in chunks; logits of the last position (or of every position)."""
    outs = []
    chunk = min(chunk, state.max_chunk or chunk)
    for lo in range(0, len(ids), chunk):
        block = torch.tensor(ids[lo:lo + chunk], dtype=torch.long)
        outs.append(model(block, state, all_logits=all_logits))
    return torch.cat(outs) if all_logits else outs[-1]


class Cached:
    """One decode step on the engine state: the id's position only."""

    def __init__(self, model, state: EngineState):
        self.model, self.state = model, state

    def __call__(self, tok: int) -> torch.Tensor:
        logits = self.model(torch.tensor([tok], dtype=torch.long), self.state)[-1]
        self.state.last_logits = logits
        return logits


class Replay:
    """no-cache: every step starts from a fresh state and runs the whole history; only token ids
    survive between steps."""

    def __init__(self, model, new_state: Callable[[], EngineState], history: list[int], chunk: int,
                 state: EngineState):
        self.model, self.new_state, self.history, self.chunk, self.state = model, new_state, history, chunk, state

    def __call__(self, tok: int) -> torch.Tensor:
        self.history.append(tok)
        self.state = self.new_state()
        logits = prefill(self.model, self.state, self.history, self.chunk)[-1]
        self.state.last_logits = logits
        return logits


def non_finite() -> LarqlError:
    return LarqlError("the model produced non-finite logits (NaN or infinity); its weights or this `dtype` overflow")


def refuse_non_finite(logits: torch.Tensor) -> None:
    """Raise unless every logit is finite."""
    # A finite sum means every logit is finite (an infinity or NaN makes the sum one), and costs a
    # twentieth of isfinite over a 262,144-entry row; only a non-finite sum needs the full check.
    if not math.isfinite(float(logits.sum())) and not bool(torch.isfinite(logits).all()):
        raise non_finite()


def finish_reason(tok: int, index: int, max_tokens: int, stop_ids: set[int]) -> str | None:
    """"stop" for a stop id, "length" for the last allowed token, else None."""
    return "stop" if tok in stop_ids else ("length" if index + 1 == max_tokens else None)


def generate_step(forward: Callable[[int], torch.Tensor], logits: torch.Tensor, sampling: SamplingConfig,
                  gen: torch.Generator | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(id, the logits it was sampled from), one per step, without end."""
    while True:
        tok = sample(logits, sampling, gen)
        yield tok, logits
        logits = forward(tok)


def stream_tokens(steps: Iterator[tuple[int, torch.Tensor]], max_tokens: int, stop_ids: set[int],
                  detokenizer=None, snapshot: Callable[[int], Metrics] = lambda i: Metrics()) -> Iterator[Token]:
    """Tokens from (id, logits) pairs: text, a metrics snapshot each (`snapshot(i)`), and the finish
    reason on the last one. A stop id ends the stream and adds no text."""
    if max_tokens == 0:
        return
    for i, (tok, logits) in enumerate(steps):
        finish = finish_reason(tok, i, max_tokens, stop_ids)
        text = "" if tok in stop_ids or detokenizer is None else detokenizer.step(tok)
        yield Token(tok, text, i, logits, snapshot(i), finish)
        if finish:
            return


def stream_generate(model, prompt_ids: Sequence[int], spec: EngineSpec = EngineSpec(),
                    cfg: GenerationConfig = GenerationConfig(), stop_ids: set[int] | None = None,
                    tokenizer=None, state: EngineState | None = None,
                    logits: torch.Tensor | None = None) -> Iterator[Token]:
    """Yield generated tokens.

    `state` may arrive holding the first `state.position` prompt tokens already (a resumed session):
    only the rest is prefilled; if nothing is left, `logits` (the last position's) must be given.
    The state's `last_logits` follows every forward pass.
    """
    if not prompt_ids:
        raise LarqlError("empty prompt: nothing to condition on")
    provider = build_provider(spec)
    geoms = model.geometries()
    state = state if state is not None else provider.new_state(geoms, model.device)
    history = list(prompt_ids)
    start = state.position
    t0 = time.perf_counter()
    if start < len(history):
        logits = prefill(model, state, history[start:], cfg.prefill_chunk)[-1]
    elif logits is None:
        raise LarqlError("the state already holds the whole prompt and no logits came with it")
    state.last_logits = logits
    prefill_seconds = time.perf_counter() - t0
    forward = Replay(model, lambda: provider.new_state(geoms, model.device), history, cfg.prefill_chunk, state) \
        if spec.replay else Cached(model, state)
    gen = torch.Generator().manual_seed(cfg.sampling.seed) if cfg.sampling.seed is not None else None
    t_decode = time.perf_counter()

    def snapshot(i: int) -> Metrics:
        s = forward.state
        return Metrics(len(prompt_ids), len(prompt_ids) - start, prefill_seconds, i + 1,
                       time.perf_counter() - t_decode, s.resident_bytes(), s.resident_by_kind(), s.position)

    stops = (stop_ids or set()) if cfg.stop_at_eos else set()
    detokenizer = tokenizer.stream() if tokenizer is not None else None
    yield from stream_tokens(generate_step(forward, logits, cfg.sampling, gen), cfg.max_tokens, stops,
                             detokenizer, snapshot)
