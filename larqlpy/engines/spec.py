"""What to run: an engine identity with validated options (`EngineSpec`), and the validator every
spelling goes through. Plain Python: option refusals need no torch."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from larqlpy.errors import LarqlError

if TYPE_CHECKING:
    from larqlpy.engines.provider import Provider

IDENTITY_RE = re.compile(r"^[a-z][a-z0-9-]*/v[0-9]+$")
KEY_RE = re.compile(r"^[a-z_][a-z0-9_]*$")


@dataclass(frozen=True)
class EngineSpec:
    """A provider identity with validated options, optionally under no-cache replay."""

    identity: str = "canonical/v1"
    options: tuple[tuple[str, object], ...] = ()
    replay: bool = False  # no-cache: rebuild state from token ids every step

    @property
    def options_dict(self) -> dict[str, object]:
        return dict(self.options)

    def stateful(self, purpose: str) -> "EngineSpec":
        """This spec, when it keeps an attention state; no-cache refused (the one wording of it),
        `purpose` saying what needed the state."""
        if self.replay:
            raise LarqlError(f"`engine` no-cache keeps no state (no KV rows between steps), so it cannot {purpose}; "
                             "name a `continuation` instead")
        return self

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        base = self.identity + (f" [{opts}]" if opts else "")
        return f"no-cache({base})" if self.replay else base


def split_pair(item: str, where: str) -> tuple[str, str]:
    """`key=value` -> (key, value); `where` names the parameter it came in (for the refusal)."""
    key, sep, value = item.partition("=")
    key, value = key.strip(), value.strip()
    if not sep or not KEY_RE.match(key) or not value:
        raise LarqlError(f"{where}: malformed option {item!r} (expected key=value)")
    return key, value


def validate_options(cls: type["Provider"], pairs: Sequence[tuple[str, str]],
                     where: str) -> tuple[tuple[str, object], ...]:
    """Check (key, text) pairs against what `cls` declares; refuse unknown, duplicate, missing and
    bad values. `where` opens every refusal: the parameter (or file) the options came from."""
    declared = {o.name: o for o in cls.option_specs()}
    seen: dict[str, object] = {}
    suggest = cls.suggestion()
    for key, raw in pairs:
        if key not in declared:
            names = ", ".join(declared) or "none"
            raise LarqlError(f"{where}: {cls.identity} has no option {key!r} (declared: {names})", suggest=suggest)
        if key in seen:
            raise LarqlError(f"{where}: option {key!r} given twice")
        try:
            seen[key] = declared[key].parse(raw)
        except ValueError as e:
            raise LarqlError(f"{where}: {cls.identity} option {key}: {e}", suggest=suggest) from None
    for key, value in cls.defaults():
        seen.setdefault(key, declared[key].parse(str(value)))
    missing = [o.name for o in declared.values() if o.required and o.name not in seen]
    if missing:
        raise LarqlError(f"{where}: {cls.identity} requires option {', '.join(missing)} "
                         f"(e.g. {missing[0]}=...)")
    cls.check_options(seen, where)
    return tuple(sorted(seen.items()))
