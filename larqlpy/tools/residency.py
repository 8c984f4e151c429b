"""Accounted residency: rows and bytes per layer kind that each engine holds after N positions,
from the same `retained_rows` / `row_bytes` the engines use. Works without weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from larqlpy.engines import EngineSpec, LayerGeometry, Provider, build_provider, preset_spec
from larqlpy.engines.geometry import default_kv_dtype, storing
from larqlpy.engines.presets import RESIDENCY
from larqlpy.errors import LarqlError
from larqlpy.model.decoder import layer_geometries
from larqlpy.model.families import config_from_dict, read_config
from larqlpy.weights.gguf_checkpoint import checkpoint, default_weights
from larqlpy.weights.gguf_file import model_dir

@dataclass(frozen=True)
class Named:
    """A published model's KV geometry (from its config.json): no weights needed to account for it."""

    layers: int
    kv_heads: int
    head_dim: int
    context: int  # max_position_embeddings
    window: int | None = None  # the sliding window of its sliding layers
    sliding: Callable[[int], bool] = lambda i: False  # which layers slide
    latent: bool = False  # MLA: one row a position (kv_lora_rank + qk_rope_head_dim), its key and value

    def geometries(self, kv_dtype: str) -> list[LayerGeometry]:
        return [LayerGeometry(i, self.window if self.sliding(i) else None, self.kv_heads, self.head_dim,
                              kv_dtype=kv_dtype, values_are_keys=self.latent) for i in range(self.layers)]


@dataclass(frozen=True)
class FromConfig:
    """A published model's geometry read by its family from the config.json fields that shape its
    KV (layers of their own shapes, layers reading another's rows: Gemma 4)."""

    raw: dict

    @property
    def context(self) -> int:
        return self.raw["max_position_embeddings"]

    def geometries(self, kv_dtype: str) -> list[LayerGeometry]:
        return layer_geometries(config_from_dict(self.raw), kv_dtype)


def _gemma4(layers: int, period: int, kv: int, window: int, shared: int, context: int, **more) -> FromConfig:
    """Gemma 4's text config: `period - 1` sliding layers to each global one, heads of 256 (512 on
    global layers), the last `shared` layers reading earlier layers' rows."""
    return FromConfig({"model_type": "gemma4_text", "num_hidden_layers": layers, "hidden_size": 2560,
                       "intermediate_size": 10240, "num_attention_heads": 8, "vocab_size": 262144,
                       "num_key_value_heads": kv, "head_dim": 256, "global_head_dim": 512, "sliding_window": window,
                       "num_kv_shared_layers": shared, "max_position_embeddings": context,
                       "layer_types": ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                                       for i in range(layers)], **more})


def _gemma3(layers: int, window: int, kv: int, d: int, context: int) -> Named:
    return Named(layers, kv, d, context, window, lambda i: (i + 1) % 6 != 0)  # five sliding layers, one global


def _gemma2(layers: int, kv: int, d: int) -> Named:
    return Named(layers, kv, d, 8192, 4096, lambda i: i % 2 == 0)  # sliding and global layers alternate


NAMED_GEOMETRIES = {
    "gemma3-270m": _gemma3(18, 512, 1, 256, 32768), "gemma3-1b": _gemma3(26, 512, 1, 256, 32768),
    "gemma3-4b": _gemma3(34, 1024, 4, 256, 131072), "gemma3-12b": _gemma3(48, 1024, 8, 256, 131072),
    "gemma3-27b": _gemma3(62, 1024, 16, 128, 131072),
    "gemma2-2b": _gemma2(26, 4, 256), "gemma2-9b": _gemma2(42, 8, 256),
    "llama3.2-1b": Named(16, 8, 64, 131072), "llama3.2-3b": Named(28, 8, 128, 131072),
    "llama3.1-8b": Named(32, 8, 128, 131072),
    "qwen2.5-0.5b": Named(24, 2, 64, 32768), "qwen2.5-1.5b": Named(28, 2, 128, 32768),
    "qwen2.5-3b": Named(36, 2, 128, 32768), "qwen2.5-7b": Named(28, 4, 128, 32768),
    "qwen3-0.6b": Named(28, 8, 128, 40960), "qwen3-1.7b": Named(28, 8, 128, 40960),
    "qwen3-4b": Named(36, 8, 128, 40960), "qwen3-8b": Named(36, 8, 128, 40960),
    "mistral-7b-v0.1": Named(32, 8, 128, 32768, 4096, lambda i: True),  # every layer slides
    "smollm2-135m": Named(30, 3, 64, 8192),
    # DeepSeek's MLA: one 512 + 64 latent row a position and layer
    "deepseek-v2-lite": Named(27, 1, 576, 163840, latent=True), "deepseek-v3": Named(61, 1, 576, 163840, latent=True),
    # Gemma 4 (google/gemma-4-*'s text_config): E2B and E4B share the last 20 / 18 layers' K/V; 31B
    # has 4 KV heads on its global layers, whose K serves as V, and shares none
    "gemma4-e2b": _gemma4(35, 5, 1, 512, 20, 131072), "gemma4-e4b": _gemma4(42, 6, 2, 512, 18, 131072),
    "gemma4-31b": _gemma4(60, 6, 16, 1024, 0, 262144, attention_k_eq_v=True, num_global_key_value_heads=4),
}


def named_geometry(name: str, kv_dtype: str = "f32") -> list[LayerGeometry]:
    return NAMED_GEOMETRIES[name].geometries(kv_dtype)


def resolve_geometry(model_or_name: str, kv_dtype: str | None = None) -> tuple[str, list[LayerGeometry], int]:
    """(name, the layers' geometries, the trained context) of a named geometry or a model (a
    directory or a .gguf). kv_dtype None: what a run would keep exact rows in -- for a model, the
    default beside the weights its files hold; for a named geometry (no weights to choose by), f32."""
    if model_or_name in NAMED_GEOMETRIES:
        geometries = named_geometry(model_or_name, kv_dtype or "f32")
        return model_or_name, geometries, NAMED_GEOMETRIES[model_or_name].context
    path = Path(model_or_name)
    if not path.exists():
        raise LarqlError(f"{model_or_name}: neither a model directory nor a named geometry "
                         f"({', '.join(NAMED_GEOMETRIES)})")
    cfg = read_config(model_dir(path))
    kv_dtype = kv_dtype or default_kv_dtype(default_weights(checkpoint(path, cfg)))
    return str(path), layer_geometries(cfg, kv_dtype), cfg.max_position_embeddings


def account(provider: Provider, geometries: list[LayerGeometry], positions: int) -> dict:
    provider.check_geometry(geometries)
    by_kind: dict[str, dict[str, int]] = {}
    for g in geometries:
        by_kind.setdefault(g.kind, {"layers": 0, "rows": 0, "bytes": 0})["layers"] += 1
    for g in storing(geometries):  # a layer reading an earlier layer's rows holds none: counted there
        k = by_kind[g.kind]
        rows = provider.retained_rows(g, positions)
        k["rows"] += rows
        k["bytes"] += provider.layer_bytes(g, positions)
    return {"engine": provider.identity, "options": dict(provider.options), "by_kind": by_kind,
            "rows": sum(k["rows"] for k in by_kind.values()), "bytes": sum(k["bytes"] for k in by_kind.values())}


def bits_per_value(provider: Provider, geometries: list[LayerGeometry], positions: int) -> float:
    """Stored bits per retained K/V value after `positions` positions (codes, norms, scales and exact
    rows all counted)."""
    total = sum(provider.layer_bytes(g, positions) for g in storing(geometries))
    values = sum(provider.retained_rows(g, positions) * (1 if g.values_are_keys else 2) * g.n_kv_heads * g.head_dim
                 for g in storing(geometries))
    return 8 * total / values


def default_specs() -> list[EngineSpec]:
    """Every provider, with the options that show its range (engines.presets.RESIDENCY)."""
    return [preset_spec(p) for p in RESIDENCY]


def _takes(spec: EngineSpec, geometries: list[LayerGeometry]) -> bool:
    try:
        build_provider(spec).check_geometry(geometries)
    except LarqlError:
        return False
    return True


def specs_for(specs: list[EngineSpec] | None, geometries: list[LayerGeometry]) -> list[EngineSpec]:
    """The engines asked for (each refusing layers it cannot hold), or every default one that takes
    these layers (TurboQuant codes need a power-of-two row: not MLA's 576-wide latent rows)."""
    return specs or [s for s in default_specs() if _takes(s, geometries)]


def residency(model_or_name: str, positions: int, specs: list[EngineSpec] | None = None,
              within_context: bool = True, kv_dtype: str | None = None) -> dict:
    """Each engine's rows and bytes by layer kind after `positions` positions; refused past the
    model's trained context unless `within_context` is False (accounting past it, for checks)."""
    if positions < 0:
        raise LarqlError(f"`positions` must be >= 0, got {positions}")
    name, geometries, context = resolve_geometry(model_or_name, kv_dtype)
    if within_context and positions > context:
        raise LarqlError(f"`positions` {positions:,} is past {name}'s context of {context:,} positions")
    rows = [account(build_provider(s), geometries, positions) for s in specs_for(specs, geometries)]
    note = None if any(g.window for g in geometries) else \
        "no sliding layers: window/v1 (and codec/v1's retention) keep every row, as canonical/v1 does"
    return {"geometry": name, "positions": positions, "context": context, "layers": len(geometries), "note": note,
            "kv_dtype": geometries[0].kv_dtype if geometries else None,
            "kinds": {kind: sum(1 for g in geometries if g.kind == kind) for kind in ("sliding", "global")},
            "shared": sum(1 for g in geometries if g.reads is not None),
            "engines": rows}


def capacity(model_or_name: str, budget: int, specs: list[EngineSpec] | None = None,
             limit: int = 1 << 40, kv_dtype: str | None = None) -> dict:
    """The inverse question: the longest context each engine's accounted rows fit in `budget` bytes.

    Accounted bytes never shrink as positions grow, so a binary search finds the largest N with
    bytes(N) <= budget; an engine whose bytes stop growing reports `unbounded`. The model's trained
    context comes with the answer: a capacity past it is room the model cannot use."""
    if budget < 1:
        raise LarqlError(f"`budget` must be positive, got {budget}")
    name, geometries, context = resolve_geometry(model_or_name, kv_dtype)
    out = []
    for spec in specs_for(specs, geometries):
        provider = build_provider(spec)

        def fits(n: int) -> bool:
            return account(provider, geometries, n)["bytes"] <= budget

        if not fits(0):
            best = -1
        elif fits(limit):
            best = None
        else:
            lo, hi = 0, limit  # fits(lo), not fits(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            best = lo
        row = {"engine": provider.identity, "options": dict(provider.options),
               "max_positions": best if best is None or best >= 0 else 0}
        if best is not None and best >= 0:
            row["bytes_at_max"] = account(provider, geometries, best)["bytes"]
        out.append(row)
    return {"geometry": name, "budget": budget, "context": context,
            "kv_dtype": geometries[0].kv_dtype if geometries else None, "engines": out}
