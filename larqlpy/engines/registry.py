"""Providers by identity string. One module per engine; this is the only list of them."""

from __future__ import annotations

from larqlpy.engines.base import Provider
from larqlpy.engines.canonical import Canonical
from larqlpy.engines.cells import Cells
from larqlpy.engines.codec import Codec, CodecRecent, Int4Group
from larqlpy.engines.spec import EngineSpec
from larqlpy.engines.window import Window
from larqlpy.errors import LarqlError

PROVIDERS: dict[str, type[Provider]] = {cls.identity: cls for cls in (Canonical, Window, Codec, CodecRecent, Int4Group, Cells)}


def provider_class(identity: str, via: str = "--continuation") -> type[Provider]:
    try:
        return PROVIDERS[identity]
    except KeyError:
        raise LarqlError(f"{via}: unknown continuation identity {identity!r} "
                         f"(known: {', '.join(PROVIDERS)})") from None


def build_provider(spec: EngineSpec) -> Provider:
    return provider_class(spec.identity)(spec.options_dict)
