"""The decode loop: prefill in chunks, then one token at a time, yielding tokens with metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, Iterator, Sequence

import torch

from larqlpy.engines import EngineSpec, EngineState, build_provider
from larqlpy.errors import LarqlError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise LarqlError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LarqlError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LarqlError(f"--top-p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerationConfig:
    """The defaults the CLI and the Python API share."""

    max_tokens: int = 64
    prefill_chunk: int = 1024
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_at_eos: bool = True

    def __post_init__(self):
        if self.max_tokens < 0:
            raise LarqlError(f"--max-tokens must be >= 0, got {self.max_tokens}")
        if self.prefill_chunk < 1:
            raise LarqlError(f"prefill chunk must be >= 1, got {self.prefill_chunk}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "GenerationConfig":
        """Build from a flat dict (CLI flags, JSON lines); unknown keys are ignored."""
        sampling_keys = {f.name for f in fields(SamplingConfig)}
        own = {f.name for f in fields(cls)} - {"sampling"}
        sampling = SamplingConfig(**{k: v for k, v in raw.items() if k in sampling_keys and v is not None})
        return cls(sampling=sampling, **{k: v for k, v in raw.items() if k in own and v is not None})


@dataclass
class Metrics:
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
        return {"prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled_tokens, "prefill_seconds": round(self.prefill_seconds, 6),
                "prefill_tokens_per_s": round(self.prefill_tps, 3), "decode_tokens": self.decode_tokens,
                "decode_seconds": round(self.decode_seconds, 6), "decode_tokens_per_s": round(self.decode_tps, 3),
                "resident_kv_bytes": self.resident_kv_bytes, "resident_kv_by_kind": dict(self.resident_kv_by_kind),
                "position": self.position}


@dataclass
class Token:
    id: int
    text: str  # the new text this token completes (may be "" while a UTF-8 sequence is open)
    index: int  # 0-based among generated tokens
    logits: torch.Tensor  # (V,) float32 logits this token was chosen from
    metrics: Metrics
    finish_reason: str | None = None  # "stop" (EOS / end_of_turn) or "length" on the last token


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None) -> int:
    if cfg.temperature == 0.0:
        return int(torch.argmax(logits))
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


def generate(model, prompt_ids: Sequence[int], spec: EngineSpec = EngineSpec(),
             cfg: GenerationConfig = GenerationConfig(), stop_ids: set[int] | None = None,
             tokenizer=None, state: EngineState | None = None, logits: torch.Tensor | None = None) -> Iterator[Token]:
    """Yield generated tokens.

    `state` may arrive holding the first `state.position` prompt tokens already (a resumed session):
    only the rest is prefilled; if nothing is left, `logits` (the last position's) must be given.
    With spec.replay (no-cache), every step starts from fresh state and runs the whole history; only
    token ids survive between steps. The state's `last_logits` follows every forward pass.
    """
    if not prompt_ids:
        raise LarqlError("empty prompt: nothing to condition on")
    provider = build_provider(spec)
    geoms = model.geometries()
    fresh = lambda: provider.new_state(geoms, model.device)  # noqa: E731
    state = state if state is not None else fresh()
    gen = None
    if cfg.sampling.seed is not None:
        gen = torch.Generator().manual_seed(cfg.sampling.seed)
    stop_ids = stop_ids or set()
    history = list(prompt_ids)
    start = state.position
    metrics = Metrics(prompt_tokens=len(history), prefilled_tokens=len(history) - start)
    t0 = time.perf_counter()
    if start < len(history):
        logits = prefill(model, state, history[start:], cfg.prefill_chunk)[-1]
    elif logits is None:
        raise LarqlError("the state already holds the whole prompt and no logits came with it")
    state.last_logits = logits
    metrics.prefill_seconds = time.perf_counter() - t0
    if cfg.max_tokens == 0:
        return
    decoded_text = ""
    t_decode = time.perf_counter()
    for i in range(cfg.max_tokens):
        tok = sample(logits, cfg.sampling, gen)
        history.append(tok)
        metrics.decode_tokens = i + 1
        metrics.decode_seconds = time.perf_counter() - t_decode
        metrics.resident_kv_bytes = state.resident_bytes()
        metrics.resident_kv_by_kind = state.resident_by_kind()
        metrics.position = state.position
        finish = "stop" if (cfg.stop_at_eos and tok in stop_ids) else ("length" if i + 1 == cfg.max_tokens else None)
        text = ""
        if tokenizer is not None and finish != "stop":
            full = tokenizer.decode(history[len(prompt_ids):])
            if not full.endswith("\ufffd"):  # wait until a multi-byte character is complete
                text, decoded_text = full[len(decoded_text):], full
        yield Token(tok, text, i, logits, metrics, finish)
        if finish:
            return
        if spec.replay:
            state = fresh()
            logits = prefill(model, state, history, cfg.prefill_chunk)[-1]
        else:
            logits = model(torch.tensor([tok], dtype=torch.long), state)[-1]
        state.last_logits = logits
