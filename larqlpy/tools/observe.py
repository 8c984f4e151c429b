"""Look before you quantize: per-layer K/V statistics and what each codec would do to these rows."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from larqlpy.engines import EngineSpec, new_state
from larqlpy.engines.lifecycle import default_rules_path
from larqlpy.engines.stores.base import AttentionParams, QueryTap
from larqlpy.errors import LarqlError
from larqlpy.files import PROMPT_LIMIT, read_text
from larqlpy.kernels.kvcodec.rowcodec import Int4GroupCodec, TurboQuantCodec
from larqlpy.model.decoder import prefill
from larqlpy.tools.quality import drift
from larqlpy.weights.loader import LoadedModel

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


QUERIES = 64  # the newest positions whose attention is re-scored against quantized keys
WIDER = 2.0  # a layer whose attention KL is this many times the median layer's gets more key bits


class _LastQueries:
    """The newest QUERIES queries a layer was asked (H, n, D), and its attention parameters."""

    def __init__(self):
        self.q, self.params = None, AttentionParams(1.0)

    def __call__(self, store, q, p):
        q = q.float()
        self.q = q[:, -QUERIES:] if self.q is None else torch.cat((self.q, q), 1)[:, -QUERIES:]
        self.params = p


def attention_kl(store, q: torch.Tensor, params: AttentionParams, codec) -> float:
    """Mean KL(exact || quantized keys) of the attention weights of the newest queries q (H, n, D),
    each over the rows it may see, with the keys through `codec` (under the model's key calibration
    when it has one, as codec calib=on stores them)."""
    g, end, n = store.geometry, store.end, q.shape[1]
    lo = g.read_start(end - n)
    k = store.read(lo, torch.float32)[0].cpu()  # the codecs here are the CPU ones
    q = q.cpu()
    cal = g.key_calibration
    x = k if cal is None else cal.apply(k, lo)
    y = codec.decode(codec.encode(x.reshape(-1, g.head_dim))).view_as(x)
    kq = y if cal is None else cal.undo(y, lo)
    hkv = k.shape[0]
    group = q.shape[0] // hkv
    total, count = 0.0, 0
    for j in range(n):
        pos = end - n + j
        a, b = g.read_start(pos) - lo, pos + 1 - lo
        for h in range(hkv):
            qh = q[h * group:(h + 1) * group, j]
            p = torch.log_softmax(params.logits(qh @ k[h, a:b].T), -1)
            r = torch.log_softmax(params.logits(qh @ kq[h, a:b].T), -1)
            total += (p.exp() * (p - r)).sum().item()
            count += group
    return total / count


@torch.inference_mode()
def kv_stats(loaded: LoadedModel, ids: list[int], min_cosine: float = 0.995, codec: str = "tq4") -> dict:
    state = new_state(EngineSpec(), loaded.model.geometries(), loaded.device)
    stores, seen = state.layers, [_LastQueries() for _ in state.layers]
    state.layers = [QueryTap(s, rec) for s, rec in zip(stores, seen)]
    prefill(loaded.model, state, ids, 1024)
    layers = []
    for store, rec in zip(stores, seen):
        g = store.geometry
        k, v = (t.cpu() for t in store.read(0, torch.float32))
        codecs = codecs_for(g.head_dim)
        entry = {"layer": g.index, "kind": g.kind, "K": tensor_stats(k.reshape(-1, g.head_dim), codecs),
                 "V": tensor_stats(v.reshape(-1, g.head_dim), codecs),
                 "attention_kl": {name: attention_kl(store, rec.q, rec.params, codecs[name])
                                  for name in ("tq4", "tq3")}}
        worst = min(entry[t]["cosine"][codec]["mean"] for t in ("K", "V"))
        entry["quantizes_badly"] = worst < min_cosine
        layers.append(entry)
    keep_exact = [e["layer"] for e in layers if e["quantizes_badly"]]
    calibrated = all(g.key_calibration is not None for g in loaded.model.geometries())
    return {"positions": len(ids), "codec": codec, "min_cosine": min_cosine, "layers": layers,
            "keep_exact": keep_exact, "rules": suggested_rules(len(layers), keep_exact),
            "calibrated": calibrated, "layer_bits": suggested_layer_bits(layers)}


def suggested_layer_bits(layers: list[dict]) -> str:
    """codec/v1's `layer_bits`: 8-bit keys (4-bit values) where the attention KL at 4 bits is WIDER
    times the median layer's; empty when no layer stands out."""
    kls = sorted(e["attention_kl"]["tq4"] for e in layers)
    median = kls[len(kls) // 2]
    return ",".join(f"{e['layer']}:8/4" for e in layers if e["attention_kl"]["tq4"] > WIDER * median)


def suggested_rules(n_layers: int, keep_exact: list[int]) -> str:
    """The packaged rules with `quantize_layers` set to the layers that quantize well."""
    good = [i for i in range(n_layers) if i not in keep_exact]
    value = "all" if not keep_exact else ("none" if not good else "[" + ", ".join(map(str, good)) + "]")
    lines = []
    for line in default_rules_path().read_text().splitlines():
        if line.strip().startswith("quantize_layers:"):
            indent = line[: len(line) - len(line.lstrip())]
            note = f"  # kv-stats: keep {keep_exact} exact" if keep_exact else \
                "  # kv-stats: every layer quantizes well"
            line = f"{indent}quantize_layers: {value}{note}"
        lines.append(line)
    return "\n".join(lines) + "\n"


QUESTIONS = Path(__file__).resolve().parent.parent / "data" / "questions.jsonl"


def load_questions(path: str | Path | None = None) -> list[dict]:
    """{"id", "question"} per line (a "prompt" key is used as is instead of the Q/A template)."""
    path = Path(path) if path is not None else QUESTIONS
    lines = read_text(path, "", PROMPT_LIMIT).splitlines()
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


def consistency(loaded: LoadedModel, questions: list[dict], specs, max_tokens: int = 16) -> dict:
    """Each engine's greedy answers against canonical/v1's: exact match, common prefix, KL."""
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
