"""Engine selection: LARQL's V3 (`--continuation ID --continuation-option k=v`) and V2 (`--engine
name:k=v,...`) spellings, parsed and refused once, at the boundary, before any weights load."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from larqlpy.errors import LarqlError

IDENTITY_RE = re.compile(r"^[a-z][a-z0-9-]*/v[0-9]+$")
KEY_RE = re.compile(r"^[a-z_][a-z0-9_]*$")


@dataclass(frozen=True)
class OptionSpec:
    name: str
    parse: Callable[[str], object]
    required: bool = False
    help: str = ""


@dataclass(frozen=True)
class EngineSpec:
    """What to run: a provider identity with validated options, optionally under no-cache replay."""

    identity: str = "canonical/v1"
    options: tuple[tuple[str, object], ...] = ()
    replay: bool = False  # --engine no-cache: rebuild state from token ids every step

    @property
    def options_dict(self) -> dict[str, object]:
        return dict(self.options)

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        base = self.identity + (f" [{opts}]" if opts else "")
        return f"no-cache({base})" if self.replay else base


def int_in(lo: int, hi: int | None = None, choices: Sequence[int] | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        if choices is not None and value not in choices:
            raise ValueError(f"must be one of {', '.join(map(str, choices))}, got {value}")
        if value < lo or (hi is not None and value > hi):
            raise ValueError(f"must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {value}")
        return value
    return parse


def _split_pair(item: str, where: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not KEY_RE.match(key) or not value:
        raise LarqlError(f"{where}: malformed option {item!r} (expected key=value)")
    return key, value


def validate_options(identity: str, pairs: Sequence[tuple[str, str]], where: str) -> tuple[tuple[str, object], ...]:
    """Check pairs against what the provider declares; refuse unknown, duplicate, missing, bad values."""
    from larqlpy.engines.registry import provider_class

    cls = provider_class(identity)
    declared = {o.name: o for o in cls.option_specs()}
    seen: dict[str, object] = {}
    for key, raw in pairs:
        if key not in declared:
            names = ", ".join(declared) or "none"
            hint = f"; {cls.hint()}" if cls.hint() else ""
            raise LarqlError(f"{where}: {identity} has no option {key!r} (declared: {names}){hint}")
        if key in seen:
            raise LarqlError(f"{where}: option {key!r} given twice")
        try:
            seen[key] = declared[key].parse(raw)
        except ValueError as e:
            hint = f"; {cls.hint()}" if cls.hint() else ""
            raise LarqlError(f"{where}: {identity} option {key}: {e}{hint}") from None
    missing = [o.name for o in declared.values() if o.required and o.name not in seen]
    if missing:
        raise LarqlError(f"{where}: {identity} requires option {', '.join(missing)} "
                         f"(e.g. --continuation-option {missing[0]}=...)")
    cls.check_options(seen, where)
    return tuple(sorted(seen.items()))


# V2 names: name -> (identity, how its parameters map onto the provider's options)
V2_ENGINES = {
    "standard": ("canonical/v1", {}),
    "no-cache": (None, {}),
    "windowed-checkpoint": ("window/v1", {"window": "window"}),
    "turbo-quant": ("codec/v1", {"bits": "bits"}),
}


def parse_engine_spec(engine: str | None = None, continuation: str | None = None,
                      continuation_options: Sequence[str] = ()) -> EngineSpec:
    """The one parser for both spellings. Raises LarqlError with a one-line message on any refusal."""
    from larqlpy.engines.registry import provider_class

    if continuation_options and continuation is None:
        raise LarqlError("--continuation-option needs --continuation")
    replay = False
    if engine is not None:
        name, params = _parse_v2(engine)
        if name not in V2_ENGINES:
            raise LarqlError(f"--engine: unknown engine {name!r} (known: {', '.join(V2_ENGINES)})")
        identity, param_map = V2_ENGINES[name]
        if name == "no-cache":
            if params:
                raise LarqlError("--engine no-cache takes no parameters")
            replay = True
        elif continuation is not None:
            raise LarqlError("--engine and --continuation are two spellings of one choice; give one "
                             "(only --engine no-cache layers on a --continuation)")
        else:
            unknown = [k for k, _ in params if k not in param_map]
            if unknown:
                raise LarqlError(f"--engine {name}: unknown parameter {unknown[0]!r}"
                                 f" (known: {', '.join(param_map) or 'none'})")
            provider_class(identity, via=f"--engine {name}")
            pairs = [(param_map[k], v) for k, v in params]
            return EngineSpec(identity, validate_options(identity, pairs, f"--engine {name}"))
    identity = continuation if continuation is not None else "canonical/v1"
    if not IDENTITY_RE.match(identity):
        raise LarqlError(f"--continuation: malformed identity {identity!r} (expected FAMILY/vN, e.g. window/v1)")
    provider_class(identity)
    pairs = [_split_pair(item, "--continuation-option") for item in continuation_options]
    return EngineSpec(identity, validate_options(identity, pairs, "--continuation-option"), replay)


def _parse_v2(text: str) -> tuple[str, list[tuple[str, str]]]:
    name, sep, rest = text.strip().partition(":")
    if not name or not re.match(r"^[a-z][a-z0-9-]*$", name):
        raise LarqlError(f"--engine: malformed engine spec {text!r} (expected name or name:k=v,k=v)")
    if sep and not rest.strip():
        raise LarqlError(f"--engine: malformed engine spec {text!r} (nothing after ':')")
    params = [_split_pair(item, f"--engine {name}") for item in rest.split(",")] if sep else []
    return name, params

