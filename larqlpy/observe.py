"""Look before you quantize: per-layer K/V statistics and what each codec would do to these rows."""

from __future__ import annotations

import torch

from larqlpy.engines import EngineSpec, build_provider
from larqlpy.generate import prefill
from larqlpy.kernels.rowcodec import Int4GroupCodec, TurboQuantCodec
from larqlpy.state.rules import default_rules_path

QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)
OUTLIER_RATIO = 4.0  # a channel whose largest |value| is this many times the median channel's


def codecs_for(d: int) -> dict:
    cpu = torch.device("cpu")
    out = {"tq4": TurboQuantCodec(d, 4, cpu), "tq3": TurboQuantCodec(d, 3, cpu)}
    if d % 32 == 0:
        out["int4g32"] = Int4GroupCodec(d, 32, cpu)
    return out


def tensor_stats(x: torch.Tensor, codecs: dict) -> dict:
    """x: (rows, D) -> value range, quantiles, per-channel outliers, per-row cosine per codec."""
    vals = x.flatten()
    qs = torch.quantile(vals, torch.tensor(QUANTILES, dtype=vals.dtype)).tolist()
    chan = x.abs().amax(0)
    outliers = int((chan > OUTLIER_RATIO * chan.median()).sum())
    cos = {}
    for name, codec in codecs.items():
        c = torch.nn.functional.cosine_similarity(x, codec.decode(codec.encode(x)), dim=-1)
        cos[name] = {"mean": c.mean().item(), "min": c.min().item()}
    return {"min": vals.min().item(), "max": vals.max().item(), "quantiles": dict(zip(map(str, QUANTILES), qs)),
            "outlier_channels": outliers, "cosine": cos}


@torch.inference_mode()
def kv_stats(loaded, ids: list[int], min_cosine: float = 0.995, codec: str = "tq4") -> dict:
    state = build_provider(EngineSpec()).new_state(loaded.model.geometries(), loaded.device)
    prefill(loaded.model, state, ids, 1024)
    layers = []
    for store in state.layers:
        g = store.geometry
        k, v = store.read(0, torch.float32)
        codecs = codecs_for(g.head_dim)
        entry = {"layer": g.index, "kind": g.kind, "K": tensor_stats(k.reshape(-1, g.head_dim), codecs),
                 "V": tensor_stats(v.reshape(-1, g.head_dim), codecs)}
        worst = min(entry[t]["cosine"][codec]["mean"] for t in ("K", "V"))
        entry["quantizes_badly"] = worst < min_cosine
        layers.append(entry)
    keep_exact = [e["layer"] for e in layers if e["quantizes_badly"]]
    return {"positions": len(ids), "codec": codec, "min_cosine": min_cosine, "layers": layers,
            "keep_exact": keep_exact, "rules": suggested_rules(len(layers), keep_exact)}


def suggested_rules(n_layers: int, keep_exact: list[int]) -> str:
    """The packaged rules with `quantize_layers` set to the layers that quantize well."""
    good = [i for i in range(n_layers) if i not in keep_exact]
    value = "all" if not keep_exact else ("none" if not good else "[" + ", ".join(map(str, good)) + "]")
    lines = []
    for line in default_rules_path().read_text().splitlines():
        if line.strip().startswith("quantize_layers:"):
            indent = line[: len(line) - len(line.lstrip())]
            note = f"  # kv-stats: keep {keep_exact} exact" if keep_exact else "  # kv-stats: every layer quantizes well"
            line = f"{indent}quantize_layers: {value}{note}"
        lines.append(line)
    return "\n".join(lines) + "\n"
