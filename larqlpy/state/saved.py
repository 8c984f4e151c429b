"""State files across processes: a file as the source of a request's state (read once, checked
against this model and engine, restored, fitted to the prompt), and saving where a run stopped."""

from __future__ import annotations

from pathlib import Path

import torch

from larqlpy._version import __version__
from larqlpy.engines import EngineSpec, new_state
from larqlpy.engines.registry import build_provider, checked_options, provider_class
from larqlpy.errors import LarqlError
from larqlpy.state.format import SavedState, check_compatible, common_prefix, load_state
from larqlpy.state.sources import Held, Reuse, align
from larqlpy.state.store import restore_state, save_state
from larqlpy.weights.loader import LoadedModel


class FileSource:
    """`resume`: a state file, read when the request is prepared; its engine when the request names
    none, its tokens when the prompt is empty (continue where it stopped)."""

    def __init__(self, loaded: LoadedModel, path: str | Path, reprefill: bool = False):
        self.loaded, self.path, self.reprefill = loaded, Path(path), reprefill
        self.saved = load_state(path)

    def spec(self, spec: EngineSpec | None) -> EngineSpec:
        return (spec or saved_spec(self.saved)).stateful("resume a saved state")

    @property
    def tokens(self) -> list[int]:
        return list(self.saved.tokens)

    def take(self, ids: list[int], spec: EngineSpec) -> Reuse:
        held = restore(self.loaded, self.saved, spec)
        info = {"resumed_from": str(self.path)}
        fit = align(held, ids)
        if fit is not None:
            trimmed = self.saved.processed if fit.state.position < self.saved.processed else None
            return Reuse(fit, {**info, "reused_tokens": fit.state.position, "trimmed_from": trimmed})
        if not self.reprefill:
            common = common_prefix(self.saved.tokens[:self.saved.processed], ids)
            raise LarqlError(f"{self.path}: the prompt diverges from the saved tokens at position {common}, and "
                             f"{spec.identity} can no longer go back there (its window moved past it); "
                             "pass `reprefill` to prefill the prompt from scratch")
        return Reuse(None, {**info, "reused_tokens": 0, "trimmed_from": self.saved.processed})


def saved_spec(saved: SavedState) -> EngineSpec:
    """The engine a state file was saved under, its options checked as any input's."""
    engine = saved.header["engine"]
    identity, given = engine["identity"], engine["options"]
    where = f"{saved.path}: saved engine"
    then = [(k, v) for k, v in provider_class(identity, where).saved_defaults() if k not in given]
    opts = checked_options(identity, [(k, str(v)) for k, v in [*given.items(), *then]], where)
    return EngineSpec(identity, opts)


def restore(loaded: LoadedModel, saved: SavedState, spec: EngineSpec) -> Held:
    """A state file's state, checked against this model, its weights and `spec`, in a fresh state."""
    geometries = loaded.model.geometries()
    check_compatible(saved, model_fingerprint=loaded.fingerprint, tokenizer_fingerprint=loaded.tokenizer.fingerprint,
                     identity=spec.identity, options=build_provider(spec).resolved(geometries),
                     numerics=numerics(loaded), made_options=saved_spec(saved).options_dict)
    state = new_state(spec, geometries, loaded.device)
    restore_state(saved, state)
    return Held(list(saved.tokens), state, None if saved.logits is None else torch.from_numpy(saved.logits))


def save(loaded: LoadedModel, path: str | Path, held: Held, extra: dict | None = None,
         what: str = "`save_state`") -> int:
    """Save a state where its run stopped: `held.tokens` is the whole history (the last sampled token
    included, though the state has not run it); `extra` goes into the header too (a chat's messages);
    `what` names the path in a refusal."""
    return save_state(path, held.state, model_fingerprint=loaded.fingerprint,
                      tokenizer_fingerprint=loaded.tokenizer.fingerprint, tokens=held.tokens, logits=held.logits,
                      extra={"larqlpy": __version__, **numerics(loaded), **(extra or {})}, what=what)


def numerics(loaded: LoadedModel) -> dict[str, str]:
    """What the rows' numbers depend on beyond the model: saved with a state, checked on resume."""
    return {"weights": loaded.weights, "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "device": loaded.device.type, "kv_dtype": loaded.kv_dtype,
            **({"weights_digest": loaded.weights_digest} if loaded.weights_digest is not None else {})}
