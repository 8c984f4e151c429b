"""The codec engines' accuracy on the real 270M, as markdown tables for docs/codec.md.

1. Per-row cosine between original and decoded K and V rows captured from a canonical run over
   1,024 positions, every layer: min and mean, at 4 and 3 bits (and the INT4 group scheme).
2. End to end against canonical/v1, for several prompts: teacher-forced mean / max next-token KL and
   top-1 agreement, and free-running greedy agreement, over N generated tokens.

    python bench/codec_quality.py --model models/gemma-3-270m [--tokens 256]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The history of the printing press begins in",
    "Question: Why is the sky blue? Answer:",
    "def fibonacci(n):\n",
]
ENGINES = [
    ("codec/v1", ["bits=4"]),
    ("codec/v1", ["bits=3"]),
    ("codec-recent/v1", ["bits=4", "exact_recent_k=64"]),
    ("codec-recent/v1", ["bits=3", "exact_recent_k=64"]),
    ("int4-group/v1", []),
]


def cosine_table(loaded) -> None:
    from larqlpy.engines import new_state, parse_engine_spec
    from larqlpy.kernels.kvcodec.rowcodec import Int4GroupCodec, TurboQuantCodec

    ids = loaded.tokenizer.encode((ROOT / "larqlpy" / "data" / "long.txt").read_text())[:1024]
    state = new_state(parse_engine_spec(), loaded.model.geometries(), loaded.device)
    loaded.model(torch.tensor(ids), state)
    cpu = torch.device("cpu")
    d = loaded.config.head_dim
    codecs = [("tq4", TurboQuantCodec(d, 4, cpu)), ("tq3", TurboQuantCodec(d, 3, cpu)),
              ("int4g", Int4GroupCodec(d, 32, cpu))]
    print(f"\nPer-row cosine, decoded vs original, {len(ids)} positions of larqlpy/data/long.txt, every KV head\n")
    print("| layer | kind | " + " | ".join(f"{t} {n} min / mean" for n, _ in codecs for t in ("K", "V")) + " |")
    print("|---|---|" + "---|" * (2 * len(codecs)))
    means = {n: [] for n, _ in codecs}
    for i, store in enumerate(state.layers):
        k, v = store.read(0, torch.float32)
        cells = []
        for name, codec in codecs:
            for x in (k.reshape(-1, d), v.reshape(-1, d)):
                cos = torch.nn.functional.cosine_similarity(x, codec.decode(codec.encode(x)), dim=-1)
                cells.append(f"{cos.min().item():.4f} / {cos.mean().item():.4f}")
                means[name].append(cos.mean().item())
        print(f"| {i} | {store.geometry.kind} | " + " | ".join(cells) + " |")
    print("\nMean over layers and K/V: " + ", ".join(f"{n} {sum(m) / len(m):.4f}" for n, m in means.items()))


def drift_table(loaded, tokens: int) -> None:
    from larqlpy.engines import build_provider, parse_engine_spec
    from larqlpy.tools.quality import drift
    from larqlpy.tools.residency import bits_per_value

    print(f"\nAgainst canonical/v1, {tokens} generated tokens per prompt, {len(PROMPTS)} prompts "
          "(teacher-forced KL and top-1; free-running greedy match)\n")
    print("| engine | bits/value stored | mean KL | max KL | top-1 | greedy match | common prefix (per prompt) |")
    print("|---|---|---|---|---|---|---|")
    refs = {}
    for identity, opts in ENGINES:
        spec = parse_engine_spec(continuation=identity, options=opts)
        rows = []
        for p in PROMPTS:
            ids = loaded.tokenizer.encode(p)
            d, refs[p] = drift(loaded.model, spec, ids, tokens, refs.get(p))
            rows.append(d)
        n = len(rows)
        bits = bits_per_value(build_provider(spec), loaded.model.geometries(), 4096)  # a long context
        print(f"| {spec.describe()} | {bits:.3f} | {sum(r.mean_kl for r in rows) / n:.4f} | "
              f"{max(r.max_kl for r in rows):.3f} | {sum(r.top1 for r in rows) / n:.3f} | "
              f"{sum(r.greedy_match for r in rows) / n:.3f} | {', '.join(str(r.common_prefix) for r in rows)} |",
              flush=True)


def main() -> None:
    from larqlpy.weights.loader import load

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--cosine-only", action="store_true", help="only the per-row cosine table")
    args = ap.parse_args()
    t0 = time.perf_counter()
    loaded = load(args.model, device="cpu")
    cosine_table(loaded)
    if not args.cosine_only:
        drift_table(loaded, args.tokens)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
