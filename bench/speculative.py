"""Speculative decoding (issue 32), measured side by side in one run, greedy throughout:

- the target alone, the target with the draft proposing up to `--draft-tokens` a step (stopping
  early below each `--draft-p-min`), and llama.cpp's plain decode of the target's GGUF, on code
  prompts (chat-rendered);
- the target alone against prompt lookup on an edit task: the prompt a 300-line Python file and the
  request to rename one function, the answer a lightly changed copy;
- whether every speculative run gave plain decode's ids.

Decode tok/s are each run's own (tokens after the first over the time after it; drafting included);
the runners take turns within each prompt. Prints the CPU; asserts nothing.

    python bench/speculative.py --target models/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --draft models/gguf/qwen2.5-coder-0.5b-instruct.gguf
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from decode import LlamaCpp  # noqa: E402
from stream import cpu_name  # noqa: E402

from larqlpy.pipeline.prepare import prepare  # noqa: E402
from larqlpy.pipeline.request import Request  # noqa: E402
from larqlpy.pipeline.runner import execute  # noqa: E402
from larqlpy.weights.loader import attach_draft, load  # noqa: E402

CODE_PROMPTS = [
    "Write a Python function is_prime(n) that checks whether n is a prime number, with a docstring.",
    "Write quicksort in Python as a function that returns a new sorted list.",
    "Write a Python class Stack with push, pop, peek and __len__, each with a docstring.",
    "Write a Python function that reads a CSV file and returns the sum of its second column.",
]


def edit_prompt(lines: int = 300) -> str:
    source = "".join(inspect.getsource(textwrap).splitlines(keepends=True)[:lines])
    return ("Rename the function `dedent` to `remove_indent` everywhere in this file. Reply with the whole "
            "changed file and nothing else.\n\n```python\n" + source + "```")


def run(loaded, content: str, tokens: int, to_eos: bool = False, **extra) -> dict:
    req = {"messages": [{"role": "user", "content": content}], "max_tokens": tokens, "stop_at_eos": to_eos,
           "continuation": "canonical/v1", **extra}
    return execute(loaded, Request.from_dict(req))


def tps(record: dict) -> float:
    return record["stats"]["decode_tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--draft-weights", default=None, help="the draft's weights (default: what its file holds)")
    ap.add_argument("--draft-tokens", type=int, nargs="*", default=[4, 6], help="none: skip the code prompts")
    ap.add_argument("--draft-p-min", type=float, nargs="+", default=[0.75, 0.0],
                    help="the draft's confidence floors measured (0.75: the default; 0: always K)")
    ap.add_argument("--lookup", type=int, nargs="*", default=[5, 10], help="none: skip the edit task")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per code answer")
    ap.add_argument("--edit-tokens", type=int, default=4096,
                    help="at most this many tokens of the edited file; the answer ends at its end of turn")
    args = ap.parse_args()
    from larqlpy.kernels import cpu

    print(f"CPU: {cpu_name()}, 2 threads; kernel features {cpu.describe()}; draft weights "
          f"{args.draft_weights or 'as its file holds'}")
    target = attach_draft(load(args.target, device="cpu"), load(args.draft, device="cpu", weights=args.draft_weights))
    same: list[bool] = []
    if args.draft_tokens:
        code_prompts(target, args, same)
    if args.lookup:
        edit_task(target, args, same)
    print(f"greedy ids identical to plain decode: {sum(same)} of {len(same)} runs")


def code_prompts(target, args, same: list[bool]) -> None:
    llama = LlamaCpp(args.target, 8192)
    rows: dict[str, list[float]] = {}
    for content in CODE_PROMPTS:
        plain = run(target, content, args.tokens, draft_tokens=0)
        rows.setdefault("target alone", []).append(tps(plain))
        for k, p, fixed in ((k, p, f) for k in args.draft_tokens for p in args.draft_p_min for f in (False, True)):
            r = run(target, content, args.tokens, draft_tokens=k, draft_p_min=p, draft_fixed=fixed)
            name = f"draft k={k} p_min={p}" + (" fixed" if fixed else "")
            rows.setdefault(name, []).append(tps(r))
            rows.setdefault(f"{name} acceptance", []).append(r["stats"]["acceptance_rate"])
            rows.setdefault(f"{name} tokens/step", []).append(r["stats"]["tokens_per_target_step"])
            if not fixed:
                c = r["stats"]["draft_choice"]
                rows.setdefault(f"{name} plain-decode rounds", []).append(c["by_length"]["0"]["rounds"] / c["rounds"])
            same.append(r["tokens"] == plain["tokens"])
        ids = prepare(target, Request.from_dict({"messages": [{"role": "user", "content": content}]})).prompt_ids
        rows.setdefault("llama.cpp alone", []).append((args.tokens - 1) / llama.decode(ids, args.tokens - 1))
        print(f"  {content[:50]!r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rows.items()), flush=True)
    print("\ncode prompts (median over prompts):")
    for name, values in rows.items():
        print(f"  {name:40s} {statistics.median(values):8.2f}")
    base, cpp = statistics.median(rows["target alone"]), statistics.median(rows["llama.cpp alone"])
    for name in (f"draft k={k} p_min={p}{f}" for k in args.draft_tokens for p in args.draft_p_min
                 for f in ("", " fixed")):
        spec = statistics.median(rows[name])
        print(f"  {name}: {spec / base:.2f}x the target alone (aim: never below 1.0x), "
              f"{spec / cpp:.2f}x llama.cpp alone")


def edit_task(target, args, same: list[bool]) -> None:
    """The whole answer, to its end of turn: the copy is what lookup pays on, its opening words are not."""
    edit = edit_prompt()
    plain = run(target, edit, args.edit_tokens, to_eos=True, draft_tokens=0)
    print(f"\nedit task ({plain['prompt_tokens']} prompt tokens, {len(plain['tokens'])} generated, "
          f"{plain['finish_reason']}): alone {tps(plain):.2f} tok/s", flush=True)
    for n, fixed in ((n, f) for n in args.lookup for f in (False, True)):
        looked = run(target, edit, args.edit_tokens, to_eos=True, draft_tokens=0, lookup=n, draft_fixed=fixed)
        same.append(looked["tokens"] == plain["tokens"])
        print(f"  lookup={n}{' fixed' if fixed else ''}: {tps(looked):.2f} tok/s = "
              f"{tps(looked) / tps(plain):.2f}x (aim >= 1.5x); acceptance "
              f"{looked['stats']['acceptance_rate']:.2f}, {looked['stats']['tokens_per_target_step']:.2f} tokens "
              "per target step", flush=True)


if __name__ == "__main__":
    main()
