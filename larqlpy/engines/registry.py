"""Providers by identity string (the only list of them), and the one parser of both spellings of an
engine choice: LARQL's V3 (`continuation` identity + `options`) and V2 (`engine` name:k=v,...).
Every refusal is raised here, at the boundary, before any weights load; nothing here needs torch."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Sequence

from larqlpy.engines.canonical import Canonical
from larqlpy.engines.cells import Cells
from larqlpy.engines.codec import Codec, CodecRecent, Int4Group
from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.presets import Preset, option_texts
from larqlpy.engines.provider import Provider
from larqlpy.engines.spec import IDENTITY_RE, EngineSpec, split_pair, validate_options
from larqlpy.engines.window import Window
from larqlpy.errors import LarqlError

if TYPE_CHECKING:
    import torch

    from larqlpy.engines.stores.state import EngineState

PROVIDERS: dict[str, type[Provider]] = {cls.identity: cls
                                        for cls in (Canonical, Window, Codec, CodecRecent, Int4Group, Cells)}

# V2 names: name -> (identity, how its parameters map onto the provider's options)
V2_ENGINES = {
    "standard": ("canonical/v1", {}),
    "no-cache": (None, {}),
    "windowed-checkpoint": ("window/v1", {"window": "window"}),
    "turbo-quant": ("codec/v1", {"bits": "bits"}),
}


def provider_class(identity: str, where: str = "`continuation`") -> type[Provider]:
    try:
        return PROVIDERS[identity]
    except KeyError:
        raise LarqlError(f"{where}: unknown continuation identity {identity!r} "
                         f"(known: {', '.join(PROVIDERS)})") from None


def build_provider(spec: EngineSpec) -> Provider:
    return provider_class(spec.identity)(spec.options_dict)


def new_state(spec: EngineSpec, geometries: Sequence[LayerGeometry], device: "torch.device") -> "EngineState":
    """A fresh attention state of `spec`'s engine for a model of these layers."""
    return build_provider(spec).new_state(geometries, device)


def checked_options(identity: str, pairs: Sequence[tuple[str, str]], where: str) -> tuple[tuple[str, object], ...]:
    """`pairs` validated against what `identity`'s provider declares."""
    return validate_options(provider_class(identity), pairs, where)


def parse_engine_spec(engine: str | None = None, continuation: str | None = None,
                      options: Sequence[str] = ()) -> EngineSpec:
    """The one parser for both spellings. Raises LarqlError with a one-line message on any refusal."""
    if options and continuation is None:
        raise LarqlError("`options` needs `continuation`")
    replay = False
    if engine is not None:
        name, params = _parse_v2(engine)
        if name not in V2_ENGINES:
            raise LarqlError(f"`engine`: unknown engine {name!r} (known: {', '.join(V2_ENGINES)})")
        identity, param_map = V2_ENGINES[name]
        if name == "no-cache":
            if params:
                raise LarqlError("`engine` no-cache takes no parameters")
            replay = True
        elif continuation is not None:
            raise LarqlError("`engine` and `continuation` are two spellings of one choice; give one "
                             "(only `engine` no-cache layers on a `continuation`)")
        else:
            unknown = [k for k, _ in params if k not in param_map]
            if unknown:
                raise LarqlError(f"`engine` {name}: unknown parameter {unknown[0]!r}"
                                 f" (known: {', '.join(param_map) or 'none'})")
            where = f"`engine` {name}"
            return EngineSpec(identity, checked_options(identity, [(param_map[k], v) for k, v in params], where))
    identity = continuation if continuation is not None else "canonical/v1"
    if not IDENTITY_RE.match(identity):
        raise LarqlError(f"`continuation`: malformed identity {identity!r} (expected FAMILY/vN, e.g. window/v1)")
    provider_class(identity)
    pairs = [split_pair(item, "`options`") for item in options]
    return EngineSpec(identity, checked_options(identity, pairs, "`options`"), replay)


def preset_spec(preset: Preset) -> EngineSpec:
    """A named configuration (engines.presets) as the spec a run takes, validated like any input."""
    return parse_engine_spec(continuation=preset[0], options=option_texts(preset))


def _parse_v2(text: str) -> tuple[str, list[tuple[str, str]]]:
    name, sep, rest = text.strip().partition(":")
    if not name or not re.match(r"^[a-z][a-z0-9-]*$", name):
        raise LarqlError(f"`engine`: malformed engine spec {text!r} (expected name or name:k=v,k=v)")
    if sep and not rest.strip():
        raise LarqlError(f"`engine`: malformed engine spec {text!r} (nothing after ':')")
    params = [split_pair(item, f"`engine` {name}") for item in rest.split(",")] if sep else []
    return name, params
