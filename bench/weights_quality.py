"""Low-bit weights against float32 (the GGUF dequantized), as the markdown tables in docs/weights.md.

For each --weights precision: bytes the weights take, next-token KL against float32 and top-1
agreement teacher-forced over a fixed text (larqlpy/data/long.txt), loss and perplexity on that text,
and greedy-id agreement with float32 over N generated tokens on several prompts.

    python bench/weights_quality.py --model models/gemma-3-270m [--tokens 256] [--text-tokens 3000]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "The history of the printing press begins in",
    "Question: Why is the sky blue? Answer:",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens per prompt")
    ap.add_argument("--text-tokens", type=int, default=3000)
    ap.add_argument("--weights", default="bf16,native,int8,int4")
    args = ap.parse_args()

    from larqlpy.engines import EngineSpec
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.stream import stream_generate
    from larqlpy.weights.loader import load
    from larqlpy.tools.quality import agreement, score_text

    t0 = time.time()
    ref = load(args.model, device="cpu")
    text_ids = ref.tokenizer.encode((ROOT / "larqlpy" / "data" / "long.txt").read_text())[:args.text_tokens]
    cfg = GenerationConfig(max_tokens=args.tokens, stop_at_eos=False)
    prompts = [ref.tokenizer.encode(p) for p in PROMPTS]
    ref_greedy = [[t.id for t in stream_generate(ref.model, p, EngineSpec(), cfg)] for p in prompts]
    rows = []
    for fmt in args.weights.split(","):
        test = load(args.model, device="cpu", weights=fmt)
        s = score_text(ref.model, test.model, text_ids)
        match, prefixes = [], []
        for p, want in zip(prompts, ref_greedy):
            got = [t.id for t in stream_generate(test.model, p, EngineSpec(), cfg)]
            frac, prefix = agreement(got, want)
            match.append(frac)
            prefixes.append(prefix)
        bits = 8 * test.weight_bytes / (ref.weight_bytes / 4)  # per parameter: ref holds float32
        rows.append((fmt, test.weight_bytes, bits, s, sum(match) / len(match), prefixes))
        del test
    print(f"\n{s.tokens} teacher-forced positions of larqlpy/data/long.txt; greedy over {args.tokens} tokens x "
          f"{len(PROMPTS)} prompts; float32 loss {s.ref_loss:.4f} nats/token (perplexity {s.ref_ppl:.2f})\n")
    print("| weights | MiB | bits/weight | mean KL | max KL | top-1 | loss/token | perplexity | greedy match "
          "| common prefix per prompt |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| f32 | {ref.weight_bytes / 2**20:.0f} | 32.00 | 0 | 0 | 100% | {s.ref_loss:.4f} | {s.ref_ppl:.2f} | 100% "
          f"| {', '.join(str(args.tokens) for _ in PROMPTS)} |")
    for fmt, nbytes, bits, s, match, prefixes in rows:
        print(f"| {fmt} | {nbytes / 2**20:.0f} | {bits:.2f} | {s.mean_kl:.4f} | {s.max_kl:.3f} | {100 * s.top1:.1f}% "
              f"| {s.test_loss:.4f} ({100 * (s.test_loss / s.ref_loss - 1):+.1f}%) | {s.test_ppl:.2f} "
              f"| {100 * match:.1f}% | {', '.join(map(str, prefixes))} |")
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
