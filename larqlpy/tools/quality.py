"""How far an engine's next-token distributions drift from canonical/v1's.

Teacher-forced: both engines see the same tokens (the reference's greedy continuation), one decode
step at a time, and we compare their next-token distributions at every step: KL(ref || test), top-1
agreement. Free-running: each engine decodes greedily on its own; we count how many generated ids
match the reference position by position, and the common prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from larqlpy.config import GenerationConfig
from larqlpy.decode.stream import stream_generate
from larqlpy.engines import EngineSpec, new_state
from larqlpy.model.decoder import prefill
from larqlpy.state.format import common_prefix


def kl(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> torch.Tensor:
    """KL(ref || test) in nats over the last dim."""
    return kl_logprobs(torch.log_softmax(ref_logits.float(), -1), torch.log_softmax(test_logits.float(), -1))


def kl_logprobs(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) from log-probabilities."""
    return (lp.exp() * (lp - lq)).sum(-1)


def teacher_forced_logits(model, spec: EngineSpec, prompt: Sequence[int], tokens: Sequence[int],
                          chunk: int = 1024) -> torch.Tensor:
    """Logits predicting tokens[i] for each i, feeding the given tokens one decode step at a time."""
    state = new_state(spec, model.geometries(), model.device)
    out = [prefill(model, state, list(prompt), chunk)[-1]]
    for t in tokens[:-1]:
        out.append(model(torch.tensor([t]), state)[-1])
    return torch.stack(out)


def agreement(got: Sequence[int], want: Sequence[int]) -> tuple[float, int]:
    """Free-running ids against the reference's: fraction equal position by position, common prefix."""
    return sum(a == b for a, b in zip(got, want)) / len(want), common_prefix(list(got), list(want))


def forced_score(model, spec: EngineSpec, prompt: Sequence[int], tokens: Sequence[int],
                 ref_logits: torch.Tensor) -> dict:
    """`spec` teacher-forced through `tokens` after `prompt`, against a reference's logits for the same
    steps: mean / max KL(ref || spec), top-1 agreement, and the loss of the actual tokens."""
    logits = teacher_forced_logits(model, spec, prompt, tokens)
    k = kl(ref_logits, logits)
    return {"mean_kl": k.mean().item(), "max_kl": k.max().item(),
            "top1": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
            "loss": torch.nn.functional.cross_entropy(logits, torch.tensor(list(tokens))).item()}


@dataclass
class Drift:
    engine: str
    steps: int
    mean_kl: float
    max_kl: float
    top1: float  # teacher-forced argmax agreement
    greedy_match: float  # free-running: fraction of positions with the same id
    common_prefix: int

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def drift(model, spec: EngineSpec, prompt: Sequence[int], n: int,
          reference: tuple[list[int], torch.Tensor] | None = None) -> tuple[Drift, tuple[list[int], torch.Tensor]]:
    """Compare `spec` with canonical/v1 over n generated tokens after `prompt`."""
    if reference is None:
        cfg = GenerationConfig(max_tokens=n, stop_at_eos=False)
        ref_ids = [t.id for t in stream_generate(model, prompt, EngineSpec(), cfg)]
        reference = (ref_ids, teacher_forced_logits(model, EngineSpec(), prompt, ref_ids))
    ref_ids, ref_logits = reference
    test_logits = teacher_forced_logits(model, spec, prompt, ref_ids)
    k = kl(ref_logits, test_logits)
    free = [t.id for t in stream_generate(model, prompt, spec, GenerationConfig(max_tokens=n, stop_at_eos=False))]
    d = Drift(spec.describe(), len(ref_ids), k.mean().item(), k.max().item(),
              (test_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(), *agreement(free, ref_ids))
    return d, reference


@dataclass
class TextScore:
    """Two models over one text, teacher-forced: how far `test`'s next-token distributions sit from
    `ref`'s, and each model's loss per token on the text itself."""

    tokens: int
    mean_kl: float
    max_kl: float
    top1: float
    ref_loss: float  # mean negative log-likelihood per token, nats
    test_loss: float

    @property
    def ref_ppl(self) -> float:
        return math.exp(self.ref_loss)

    @property
    def test_ppl(self) -> float:
        return math.exp(self.test_loss)


def score_text(ref_model, test_model, ids: Sequence[int], chunk: int = 512,
               spec: EngineSpec = EngineSpec()) -> TextScore:
    """Prefill `ids` through both models in chunks (same engine), comparing every position's logits."""
    states = [new_state(spec, m.geometries(), m.device) for m in (ref_model, test_model)]
    kls, top1, nll_ref, nll_test = [], [], [], []
    for lo in range(0, len(ids) - 1, chunk):
        block = torch.tensor(ids[lo:lo + chunk], dtype=torch.long)
        target = torch.tensor(ids[lo + 1:lo + chunk + 1], dtype=torch.long)
        lr, lt = (torch.log_softmax(m(block, s, all_logits=True).float(), -1)[:len(target)]
                  for m, s in zip((ref_model, test_model), states))
        kls.append(kl_logprobs(lr, lt))
        top1.append(lr.argmax(-1) == lt.argmax(-1))
        nll_ref.append(-lr.gather(1, target[:, None])[:, 0])
        nll_test.append(-lt.gather(1, target[:, None])[:, 0])
        del lr, lt
    k = torch.cat(kls)
    return TextScore(len(k), k.mean().item(), k.max().item(), torch.cat(top1).float().mean().item(),
                     torch.cat(nll_ref).mean().item(), torch.cat(nll_test).mean().item())
