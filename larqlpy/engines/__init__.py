"""KV engines ("continuation providers"): what to run (this package, plain Python) and how rows are
kept (`stores/`, torch). See docs/architecture.md."""

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.provider import Provider
from larqlpy.engines.registry import (PROVIDERS, build_provider, new_state, parse_engine_spec, preset_spec,
                                      provider_class)
from larqlpy.engines.spec import EngineSpec

__all__ = [
    "EngineSpec", "LayerGeometry", "PROVIDERS", "Provider", "build_provider", "new_state",
    "parse_engine_spec", "preset_spec", "provider_class",
]
