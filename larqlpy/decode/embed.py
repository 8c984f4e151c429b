"""An embedding as a sequence: it prefills its prompt in the scheduler beside generating sequences
and ends without sampling. Its blocks ask the decoder for their final-normed hidden rows
("hidden": transformers' last_hidden_state, never through the LM head); it pools them -- the last
row, or the mean of every row, summed chunk by chunk -- and L2-normalizes the result."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from larqlpy.config import GenerationConfig
from larqlpy.decode.output import Token
from larqlpy.decode.sequence import Sequence
from larqlpy.engines import EngineSpec
from larqlpy.engines.stores.state import EngineState


class Embedding(Sequence):
    def __init__(self, model, prompt_ids: list[int], pooling: str, *,
                 prefill_chunk: int = GenerationConfig.prefill_chunk, key=None, request=None):
        """`pooling`: "last" or "mean" (config.POOLINGS, checked by pipeline/embed.py). An exact
        engine (canonical/v1): the state lives only while the prompt is read."""
        gen = GenerationConfig(max_tokens=0, prefill_chunk=prefill_chunk, stop_at_eos=False)
        super().__init__(model, prompt_ids, EngineSpec(), gen, key=key, request=request)
        self.pooling = pooling
        self.pooled: torch.Tensor | None = None  # mean: the sum of the rows so far
        self.vector: torch.Tensor | None = None  # (E,) float32 on the CPU, unit length, once finished

    def block(self) -> tuple[torch.Tensor, EngineState, str]:
        """Its next prefill chunk; its hidden rows wanted where it pools them (mean: every chunk)."""
        n, lo = self.rows(), self.state.position
        want = "hidden" if self.pooling == "mean" or n == self.pending else "none"
        return torch.tensor(self.history[lo:lo + n], dtype=torch.long), self.state, want

    def feed(self, hidden: torch.Tensor | None) -> list[Token]:
        if hidden is None:
            return []
        if self.pooling == "mean":
            total = hidden.sum(0)
            self.pooled = total if self.pooled is None else self.pooled + total
        if self.pending:
            return []
        pooled = self.pooled / len(self.prompt_ids) if self.pooling == "mean" else hidden[-1]
        self.vector = F.normalize(pooled.float(), dim=0).cpu()
        self.finish_reason = "stop"
        self._ended()
        self.state = None  # its rows are no use to anyone now: freed before the answer goes out
        return []

    def held(self):
        """None: an embedding leaves no state for a later request."""
        return None
