"""Sessions across processes: resume a saved state, reuse its prefix, save where the run stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from larqlpy._version import __version__
from larqlpy.engines import EngineSpec, build_provider
from larqlpy.engines.registry import checked_options
from larqlpy.engines.stores.base import EngineState
from larqlpy.errors import LarqlError
from larqlpy.model.loader import LoadedModel
from larqlpy.state.format import check_compatible, common_prefix, load_state
from larqlpy.state.store import restore_state, save_state


@dataclass
class Resumed:
    spec: EngineSpec
    state: EngineState
    logits: torch.Tensor | None  # set when the state already holds the whole prompt
    reused: int  # prompt tokens the state already held (not prefilled again)
    trimmed_from: int | None = None  # the saved position, when the state was cut back to a common prefix
    extra: dict = field(default_factory=dict)  # what else the file carried (a chat's messages)


def resume(loaded: LoadedModel, path: str | Path, prompt_ids: list[int] | None, spec: EngineSpec | None,
           reprefill: bool = False) -> tuple[Resumed, list[int]]:
    """Load `path` into a fresh state of its engine; returns the plan and the ids to generate from.

    prompt_ids None: continue from the saved tokens. A prompt that extends the saved tokens reuses
    them and prefills only the suffix; one that diverges trims the state to the common prefix where
    the engine can (else refuses, unless `reprefill`)."""
    saved = load_state(path)
    engine = saved.header["engine"]
    if spec is None:
        opts = checked_options(engine["identity"], [(k, str(v)) for k, v in engine["options"].items()],
                               f"{path}: saved engine")
        spec = EngineSpec(engine["identity"], opts)
    if spec.replay:
        raise LarqlError("`engine` no-cache keeps no state between steps: nothing to resume into")
    check_compatible(saved, model_fingerprint=loaded.fingerprint, tokenizer_fingerprint=loaded.tokenizer.fingerprint,
                     identity=spec.identity, options=spec.options_dict, numerics=numerics(loaded))
    state = build_provider(spec).new_state(loaded.model.geometries(), loaded.device)
    restore_state(saved, state)
    saved_logits = None if saved.logits is None else torch.from_numpy(saved.logits)
    state.last_logits = saved_logits
    ids = list(saved.tokens) if prompt_ids is None else list(prompt_ids)
    if not ids:
        raise LarqlError("empty prompt: nothing to condition on")
    extra = {k: saved.header[k] for k in ("chat",) if k in saved.header}
    fit = align(state, saved.tokens, ids, saved_logits)
    if fit is not None:
        return Resumed(spec, state, fit.logits, fit.reused, fit.trimmed_from, extra), ids
    if not reprefill:
        common = common_prefix(saved.tokens[:saved.processed], ids)
        raise LarqlError(f"{path}: the prompt diverges from the saved tokens at position {common}, and "
                         f"{spec.identity} can no longer go back there (its window moved past it); "
                         "pass `reprefill` to prefill the prompt from scratch")
    fresh = build_provider(spec).new_state(loaded.model.geometries(), loaded.device)
    return Resumed(spec, fresh, None, 0, saved.processed, extra), ids


@dataclass
class Fit:
    reused: int  # positions of the new ids the state already holds
    trimmed_from: int | None  # the state's position before it was cut back to them
    logits: torch.Tensor | None  # the last position's logits, when the state holds all of the new ids


def align(state: EngineState, held: list[int], ids: list[int], logits: torch.Tensor | None) -> Fit | None:
    """Make `state` (holding held[:state.position]) serve `ids`: keep the prefix they share, cutting
    the state back to it where the engine can. None: the engine cannot go back there."""
    processed = state.position
    common = common_prefix(held[:processed], ids)
    if common == processed and len(ids) >= processed:
        last = logits if len(ids) == processed else None
        if len(ids) > processed or last is not None:
            return Fit(processed, None, last)
    target = min(common, len(ids) - 1)
    if all(s.can_trim(target) for s in state.layers):
        for s in state.layers:
            s.trim(target)
        return Fit(target, processed, None)
    return None


def save(loaded: LoadedModel, path: str | Path, state: EngineState, tokens: list[int], extra: dict | None = None) -> int:
    """Save where the run stopped: `tokens` is the whole history (the last sampled token included,
    even though it has not been fed yet); the state holds `state.position` of them. `extra` goes
    into the header too (a chat's messages)."""
    return save_state(path, state, model_fingerprint=loaded.fingerprint,
                      tokenizer_fingerprint=loaded.tokenizer.fingerprint, tokens=tokens,
                      logits=state.last_logits, extra={"larqlpy": __version__, **numerics(loaded), **(extra or {})})


def numerics(loaded: LoadedModel) -> dict[str, str]:
    """What the rows' numbers depend on beyond the model: saved with a state, checked on resume."""
    return {"weights": loaded.weights, "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "device": loaded.device.type,
            **({"weights_digest": loaded.weights_digest} if loaded.weights_digest is not None else {})}
