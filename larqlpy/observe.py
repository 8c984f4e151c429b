"""Look before you quantize: per-layer K/V statistics and what each codec would do to these rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from larqlpy.engines import EngineSpec, build_provider
from larqlpy.errors import LarqlError
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


QUESTIONS = Path(__file__).resolve().parent / "data" / "questions.jsonl"


def load_questions(path: str | Path | None = None) -> list[dict]:
    """{"id", "question"} per line (a "prompt" key is used as is instead of the Q/A template)."""
    path = Path(path) if path is not None else QUESTIONS
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise LarqlError(f"{path}: {e.strerror or e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise LarqlError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt", item.get("question")), str):
            raise LarqlError(f"{path}:{n}: expected an object with a 'question' (or 'prompt') string")
        prompt = item.get("prompt") or f"Question: {item['question']} Answer:"
        out.append({"id": item.get("id", n), "prompt": prompt})
    if not out:
        raise LarqlError(f"{path}: no questions")
    return out


def consistency(loaded, questions: list[dict], specs, max_tokens: int = 16) -> dict:
    """Each engine's greedy answers against canonical/v1's: exact match, common prefix, KL."""
    from larqlpy.quality import drift

    refs: dict = {}
    rows = []
    for spec in specs:
        per = []
        for q in questions:
            ids = loaded.tokenizer.encode(q["prompt"])
            d, refs[q["id"]] = drift(loaded.model, spec, ids, max_tokens, refs.get(q["id"]))
            per.append({"id": q["id"], "exact": d.greedy_match == 1.0, "common_prefix": d.common_prefix,
                        "mean_kl": d.mean_kl})
        rows.append({"engine": spec.describe(), "questions": len(per),
                     "exact_match_rate": sum(p["exact"] for p in per) / len(per),
                     "mean_common_prefix": sum(p["common_prefix"] for p in per) / len(per),
                     "mean_kl": sum(p["mean_kl"] for p in per) / len(per), "per_question": per})
    return {"max_tokens": max_tokens, "engines": rows,
            "reference": {str(k): loaded.tokenizer.decode(v[0]) for k, v in refs.items()}}
