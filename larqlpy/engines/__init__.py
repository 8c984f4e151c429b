"""KV engines ("continuation providers") behind one small protocol; see `base.py`."""

from larqlpy.engines.base import AttentionParams, EngineState, LayerGeometry, LayerStore, Provider
from larqlpy.engines.registry import PROVIDERS, build_provider, provider_class
from larqlpy.engines.spec import EngineSpec, parse_engine_spec

__all__ = [
    "AttentionParams", "EngineSpec", "EngineState", "LayerGeometry", "LayerStore", "PROVIDERS",
    "Provider", "build_provider", "parse_engine_spec", "provider_class",
]
