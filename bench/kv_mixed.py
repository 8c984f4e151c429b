"""Mixed-precision KV on the real 270M: the table in docs/codec.md (`make kv-quality`).

A prompt of --prompt positions of larqlpy/data/long.txt is prefilled (its rows stored as each engine
stores them), then the next --steps tokens of the text are teacher-forced one decode step at a time:
at every step, KL(canonical || engine) of the next-token distribution, top-1 agreement with
canonical, and the loss (cross-entropy) of the text's actual next token. Then each engine generates
--greedy tokens greedily after the same prompt: greedy match against canonical's ids, decode tok/s.
Bits per value count everything stored (codes, norms, scales, exact rows, the recent tier's second
copy) at the run's length; the model's key calibration is measured first when it has none (as the
request pipeline does).

    python bench/kv_mixed.py --model models/gemma-3-270m [--prompt 1280 --steps 256 --greedy 32]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from larqlpy.engines.presets import COMPACT, RECOMMENDED, option_texts


ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "larqlpy" / "data" / "long.txt"

PLAIN = ["calib=off", "sink=0", "recent=0"]  # LARQL's codec: codes alone (codec/v1's defaults off)

CONFIGS = [
    ("canonical/v1", []),
    ("codec/v1", ["bits=4"]),  # the defaults: calib=auto (on), recent=16, sink=1
    ("codec/v1", ["bits=3"]),
    ("codec/v1", ["bits=4", *PLAIN]),
    ("codec/v1", ["bits=3", *PLAIN]),
    ("int4-group/v1", []),
    ("codec/v1", ["k_bits=8", "v_bits=4", *PLAIN]),
    ("codec/v1", ["k_bits=5", "v_bits=3", "sink=4", "calib=off", "recent=0"]),
    ("codec-recent/v1", ["bits=4", "exact_recent_k=64"]),
    # one lever at a time on 4-bit codes: key calibration, the 8-bit recent tier with a sink
    ("codec/v1", ["bits=4", "calib=on", "sink=0", "recent=0"]),
    ("codec/v1", ["bits=4", "calib=off"]),
    (RECOMMENDED[0], option_texts(RECOMMENDED)),
    ("codec/v1", ["bits=4", "recent=32", "sink=4"]),
    ("codec/v1", ["k_bits=4", "v_bits=3"]),
    (COMPACT[0], option_texts(COMPACT)),
    ("codec/v1", ["k_bits=3", "v_bits=2"]),
    ("codec/v1", ["bits=3", "layer_bits=4:6/3"]),
    # what `larqlpy kv-stats` suggests for this text without a calibration (the global layers and 15)
    ("codec/v1", ["bits=4", "layer_bits=5:8/4,11:8/4,15:8/4", *PLAIN]),
]
QUOTED = [  # llama.cpp's quantized KV cache on the same model (quoted from the notes, not run here)
    ("llama.cpp q4_0 KV (quoted)", 4.5, 0.06, "+8%"),
    ("llama.cpp q8_0 KV (quoted)", 8.5, 0.003, ""),
]


def greedy(model, spec, prompt_ids: list[int], n: int) -> tuple[list[int], float]:
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.stream import stream_generate

    toks = list(stream_generate(model, prompt_ids, spec, GenerationConfig(max_tokens=n, stop_at_eos=False)))
    return [t.id for t in toks], toks[-1].metrics.decode_tps


def main() -> None:
    from larqlpy.calibration import ensure
    from larqlpy.engines import build_provider, parse_engine_spec
    from larqlpy.weights.loader import load
    from larqlpy.tools.quality import agreement, forced_score, teacher_forced_logits
    from larqlpy.tools.residency import bits_per_value

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--prompt", type=int, default=1280, help="positions prefilled before the measured steps")
    ap.add_argument("--steps", type=int, default=256, help="teacher-forced decode steps")
    ap.add_argument("--greedy", type=int, default=32, help="greedily generated tokens per engine")
    ap.add_argument("--only", type=int, nargs="*", help="indices into CONFIGS (default: all)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    loaded = load(args.model, device="cpu")
    ensure(loaded, parse_engine_spec(continuation="codec/v1", options=["bits=4"]))
    model = loaded.model
    ids = loaded.tokenizer.encode(TEXT.read_text())[:args.prompt + args.steps]
    n = len(ids)
    geoms = model.geometries()
    ref_spec = parse_engine_spec()
    prompt, forced = ids[:args.prompt], ids[args.prompt:]
    ref = teacher_forced_logits(model, ref_spec, prompt, forced)
    ref_ids, _ = greedy(model, ref_spec, ids[:args.prompt], args.greedy)
    print(f"\n{Path(args.model).name} ({model.cfg.num_hidden_layers} layers), {n} tokens of larqlpy/data/long.txt: "
          f"{args.prompt} prefilled, {n - args.prompt} teacher-forced decode steps; greedy: {args.greedy} tokens "
          "after the prompt\n")
    print("| engine | bits/value stored | mean KL | max KL | top-1 | loss/token | vs exact | greedy match "
          "| decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    exact_loss = None
    for i, (identity, opts) in enumerate(CONFIGS):
        if args.only is not None and i not in args.only and i != 0:
            continue
        spec = parse_engine_spec(continuation=identity, options=opts)
        m = forced_score(model, spec, prompt, forced, ref)
        if exact_loss is None:
            exact_loss = m["loss"]
        got, tps = greedy(model, spec, ids[:args.prompt], args.greedy)
        match, _ = agreement(got, ref_ids)
        bits = bits_per_value(build_provider(spec), geoms, n)
        print(f"| {spec.describe()} | {bits:.3f} | {m['mean_kl']:.4f} | {m['max_kl']:.3f} | {m['top1']:.3f} | "
              f"{m['loss']:.4f} | {100 * (m['loss'] / exact_loss - 1):+.1f}% | {match:.3f} | {tps:.1f} |", flush=True)
    for name, bits, k, loss in QUOTED:
        print(f"| {name} | ≈{bits} | ≈{k} | | | | {loss or ''} | | |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
