"""One id from a row of logits: greedy, or temperature / top-k / top-p with a seeded generator.
Logits that are not finite (an overflow in the weights' arithmetic) are refused, never sampled."""

from __future__ import annotations

import math

import torch

from larqlpy.config import SamplingConfig
from larqlpy.errors import LarqlError


def sample(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None, shaped: bool = False) -> int:
    """One id from `logits` (V,). Under greedy decoding the argmax itself tells whether a logit is
    not finite (a NaN anywhere is what argmax picks, and an infinity is the maximum): no extra pass.
    `shaped`: logits already checked and then masked (their -inf are ids that may not come)."""
    if cfg.temperature == 0.0:  # numpy's argmax (the first maximum, as torch's) is faster on a CPU row
        cpu = logits.device.type == "cpu" and logits.dtype == torch.float32
        best = int(logits.numpy().argmax()) if cpu else int(torch.argmax(logits))
        if not math.isfinite(float(logits[best])):
            raise non_finite()
        return best
    if not shaped:
        refuse_non_finite(logits)
    return draw(probabilities(logits, cfg).cpu(), gen)


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """What a sampled id is drawn from (temperature > 0): the softmax of the logits over the
    temperature, cut to top-k and top-p (not renormalized: `draw` scales by the sum)."""
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
    return probs


def verify(logits: torch.Tensor, cfg: SamplingConfig, gen: torch.Generator | None, proposal: int,
           q: torch.Tensor | None, shaped: bool = False) -> int:
    """The id to take where a speculator proposed `proposal`, drawn from `q` (V,) -- None: proposed
    for sure (prompt lookup) -- so that what comes out is distributed as `sample` would give it
    (Leviathan et al. 2023, Chen et al. 2023): the proposal is kept with probability min(1, p/q),
    else an id is drawn from max(p - q, 0). Greedy: the argmax, whatever was proposed."""
    if cfg.temperature == 0.0:
        return sample(logits, cfg, gen, shaped)
    if not shaped:
        refuse_non_finite(logits)
    p = probabilities(logits, cfg).cpu().double()
    p = p / p.sum()
    p_x = float(p[proposal])
    q_x = 1.0 if q is None else float(q[proposal])
    if q_x > 0 and float(torch.rand(1, generator=gen, dtype=torch.float64)) * q_x < p_x:
        return proposal
    rest = p.clone()
    if q is None:
        rest[proposal] = 0.0
    else:
        rest = (rest - q.cpu().double()).clamp_(min=0.0)
    return draw(rest if float(rest.sum()) > 0 else p, gen)


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """One id with probability `probs` (V,), by the inverse of its cumulative sum (in float64, so that
    an id's share is its own to 1e-16): one pass over the row, where torch.multinomial draws an
    exponential per id, ten times slower (docs/structured.md). An id of probability 0 is never drawn."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand(1, generator=gen, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def non_finite() -> LarqlError:
    return LarqlError("the model produced non-finite logits (NaN or infinity); its weights or this `dtype` overflow")


def refuse_non_finite(logits: torch.Tensor) -> None:
    """Raise unless every logit is finite."""
    # A finite sum means every logit is finite (an infinity or NaN makes the sum one), at a fraction
    # of isfinite's cost over a large vocabulary; only a non-finite sum needs the full check.
    if not math.isfinite(float(logits.sum())) and not bool(torch.isfinite(logits).all()):
        raise non_finite()
