"""How each engine keeps its rows (torch): the layer store protocol, shared storage, the stores."""

from larqlpy.engines.stores.base import AttentionParams, EngineState, LayerStore, QueryTap, Scratch, Shared

__all__ = ["AttentionParams", "EngineState", "LayerStore", "QueryTap", "Scratch", "Shared"]
