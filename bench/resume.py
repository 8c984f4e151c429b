"""Resume a saved 4,000-token state and generate 16 tokens, against prefilling the same prompt from
scratch, per engine, side by side in one run: time to first token, total time, their ratios, and
the state file's size.

    python bench/resume.py --model models/gemma-3-270m [--positions 4000] [--tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINES = [("canonical/v1", []), ("window/v1", []), ("codec/v1", ["bits=4"]), ("cells/v1", ["budget=32MiB"])]


def main() -> None:
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.sequence import Sequence
    from larqlpy.decode.stream import generate_step, stream_generate
    from larqlpy.engines import parse_engine_spec
    from larqlpy.state.saved import FileSource, save
    from larqlpy.weights.loader import load

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--positions", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    loaded = load(args.model, device="cpu")
    text = (ROOT / "larqlpy" / "data" / "long.txt").read_text()
    ids = loaded.tokenizer.encode(text * 2)[: args.positions]
    cfg = GenerationConfig(max_tokens=args.tokens, stop_at_eos=False)
    print(f"{args.positions}-token prompt, then {args.tokens} tokens; median of {args.repeats}")
    print(f"{'engine':28}{'prefill+gen s':>14}{'resume+gen s':>13}{'first tok prefill':>19}{'first tok resume':>18}"
          f"{'TTFT ratio':>11}{'total ratio':>12}{'file MiB':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for identity, opts in ENGINES:
            spec = parse_engine_spec(continuation=identity, options=opts)
            path = Path(tmp) / "s.kv"
            seq = Sequence(loaded.model, ids, spec, GenerationConfig(max_tokens=1))
            list(generate_step(loaded.model, seq))
            save(loaded, path, seq.held())  # the prompt's state, with its last position's logits

            def fresh():
                t0 = time.perf_counter()
                it = stream_generate(loaded.model, ids, spec, cfg)
                next(it)
                t1 = time.perf_counter()
                for _ in it:
                    pass
                return t1 - t0, time.perf_counter() - t0

            def resumed():
                t0 = time.perf_counter()
                source = FileSource(loaded, path)
                it = generate_step(loaded.model, Sequence(loaded.model, ids, source.spec(None), cfg, source=source))
                next(it)
                t1 = time.perf_counter()
                for _ in it:
                    pass
                return t1 - t0, time.perf_counter() - t0

            f = [fresh() for _ in range(args.repeats)]
            r = [resumed() for _ in range(args.repeats)]
            f_first, f_total = statistics.median(x[0] for x in f), statistics.median(x[1] for x in f)
            r_first, r_total = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
            name = identity + "".join(f" {o}" for o in opts)
            print(f"{name:28}{f_total:14.2f}{r_total:13.2f}{f_first:19.3f}{r_first:18.3f}"
                  f"{f_first / r_first:10.0f}x{f_total / r_total:11.1f}x{path.stat().st_size / 2**20:10.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
