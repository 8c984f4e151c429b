"""`n` choices from one prefill (issue 31), measured side by side in one run: the wall time of n=4
against n=1 at temperature 0.8 on a 1,000-token prompt (the two alternating; the median of each
repeat's ratio, whose two runs are adjacent in time, beside the ratio of the medians),
and the KV they hold: the prompt's state, held once, beside each branch's own rows, against four
requests that each hold the whole prompt.

    python bench/choices.py --model models/smollm2-135m-instruct
    python bench/choices.py --model models/gguf/qwen2.5-coder-0.5b-instruct.gguf
    python bench/choices.py --model ... --engine codec/v1 --options bits=4 calib=on recent=16 sink=1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from stream import cpu_name  # noqa: E402

from larqlpy.decode.scheduler import Scheduler  # noqa: E402
from larqlpy.pipeline.prepare import prepare_all  # noqa: E402
from larqlpy.pipeline.request import Request  # noqa: E402
from larqlpy.weights.loader import load  # noqa: E402


def prompt_ids(loaded, n: int) -> list[int]:
    text = (ROOT / "larqlpy" / "data" / "long.txt").read_text()
    return loaded.tokenizer.encode(text)[:n]


def run(loaded, ids: list[int], n: int, tokens: int, engine: str, options: list[str]) -> tuple[float, int, int]:
    """Wall seconds, the KV the choices hold at the end (their own rows plus the prompt's shared
    state, once) and the tokens made."""
    req = Request.from_dict({"prompt": "", "n": n, "max_tokens": tokens, "temperature": 0.8, "seed": 1,
                             "stop_at_eos": False, "continuation": engine, "options": options}).with_ids(ids)
    t0 = time.perf_counter()
    seqs = prepare_all(loaded, req)
    for _ in Scheduler(loaded.model, n).run(seqs):
        pass
    wall = time.perf_counter() - t0
    shared = seqs[0].info.get("shared_prompt_kv_bytes", 0)
    return wall, shared + sum(s.state.resident_bytes() for s in seqs), sum(len(s.output) for s in seqs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--weights", default=None)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--choices", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", default="canonical/v1")
    ap.add_argument("--options", nargs="*", default=[], help="the engine's options, key=value")
    args = ap.parse_args()
    loaded = load(args.model, device="cpu", weights=args.weights)
    ids = prompt_ids(loaded, args.prompt)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; model {args.model} ({loaded.weights}), "
          f"{len(ids)}-token prompt, {args.tokens} tokens a choice, temperature 0.8, {args.engine} "
          f"{' '.join(args.options)}")
    run(loaded, ids, 1, 4, args.engine, args.options)  # warm: kernels compiled, buffers touched
    walls: dict[int, list[float]] = {1: [], args.choices: []}
    kv = {}
    for r in range(args.repeats):
        for n in ((1, args.choices) if r % 2 == 0 else (args.choices, 1)):
            wall, kv[n], _ = run(loaded, ids, n, args.tokens, args.engine, args.options)
            walls[n].append(wall)
    one, many = statistics.median(walls[1]), statistics.median(walls[args.choices])
    # each repeat's two runs are adjacent in time, so their ratio cancels the host's drift between repeats
    pairs = sorted(b / a for a, b in zip(walls[1], walls[args.choices]))
    print(f"| n | wall s (median of {args.repeats}) | KV held at the end |\n|---|---|---|")
    print(f"| 1 | {one:.2f} | {kv[1] / 2**20:.1f} MiB |")
    print(f"| {args.choices} | {many:.2f} | {kv[args.choices] / 2**20:.1f} MiB "
          f"({args.choices} x n=1 would be {args.choices * kv[1] / 2**20:.1f} MiB) |")
    print(f"\nper repeat, n={args.choices} over n=1: {', '.join(f'{x:.2f}' for x in pairs)}")
    print(f"n={args.choices} costs {statistics.median(pairs):.2f}x the wall time of n=1 (median of the repeats' "
          f"ratios; {many / one:.2f}x the medians' ratio) (aim: <= 1.4x)")


if __name__ == "__main__":
    main()
