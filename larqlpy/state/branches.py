"""n choices from one prompt (OpenAI's `n`): the prompt is prefilled once, and each branch takes a
fork of that state. A store that can share its rows (`LayerStore.fork`: growing exact rows and
codes) keeps the prompt's rows once, read by every branch, and each branch stores only its own new
rows; rings are copied, and an engine whose stores cannot fork at all (cells/v1, no-cache)
prefills the prompt once per branch."""

from __future__ import annotations

from larqlpy.engines import EngineSpec, build_provider
from larqlpy.engines.stores.state import EngineState
from larqlpy.model.decoder import prefill
from larqlpy.state.sources import Held, Reuse


class Branches:
    """The state source `n` sequences of one prompt share: the first to start prefills the prompt
    (whole, on the engine's own terms); each takes a fork of it and samples its first token from
    the prompt's logits."""

    def __init__(self, model, spec: EngineSpec, n: int, chunk: int):
        self.model, self.spec, self.n, self.chunk = model, spec, n, chunk
        self.provider = build_provider(spec)
        self.parent: Held | None = None
        self.taken = 0

    def take(self, ids: list[int], spec: EngineSpec) -> Reuse:
        self.taken += 1
        if self.spec.replay:  # no-cache keeps no state to fork
            return Reuse()
        if self.parent is None:
            state = self._fresh()
            logits = prefill(self.model, state, ids, self.chunk)[-1]
            self.parent = Held(list(ids), state, logits)
        parent = self.parent
        if not all(s.forks for s in parent.state.layers):  # the first takes the prompt's state, the others prefill
            return Reuse(parent) if self.taken == 1 else Reuse()
        child = self._fresh()
        child.fork_from(parent.state)
        info = {"branch": self.taken - 1, "shared_prompt_kv_bytes": self.shared_bytes()}
        return Reuse(Held(list(ids), child, parent.logits.clone()), info)

    def shared_bytes(self) -> int:
        """The prompt's state, held once however many branches read it."""
        return self.parent.state.resident_bytes() if self.parent is not None else 0

    def _fresh(self) -> EngineState:
        return self.provider.new_state(self.model.geometries(), self.model.device)
