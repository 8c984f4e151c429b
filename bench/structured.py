"""Structured outputs (issue 31), measured side by side in one run:

1. the libraries: llguidance and xgrammar (when installed) on the model's own tokenizer -- building
   the tokenizer's index, compiling a nested JSON Schema, and the per-token mask over a valid
   answer's tokens;
2. what the mask costs a decode step: decode tok/s with and without a JSON Schema, at batch 1 and
   batch 8, the two alternating;
3. how often sampled outputs (temperature 1) parse and validate against the schema, and how often
   a required tool call (`tool_choice: "required"`, tests/test_tools.py's two tools) is made and
   its arguments validate against its function's parameters.

    python bench/structured.py --model models/smollm2-135m-instruct
    python bench/structured.py --model models/gguf/qwen2.5-coder-0.5b-instruct.gguf --samples 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from stream import cpu_name  # noqa: E402

from larqlpy.config import Grammar  # noqa: E402
from larqlpy.decode.constraint import Constraint, Vocabulary, compile_grammar  # noqa: E402
from larqlpy.pipeline.request import Request  # noqa: E402
from larqlpy.pipeline.runner import execute_many  # noqa: E402
from larqlpy.text.tools import JSON_LAYOUT  # noqa: E402
from larqlpy.weights.loader import load  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from test_structured import PERSON as SCHEMA  # noqa: E402  (the nested schema the tests hold to)
from test_tools import ASK as WEATHER_ASK, TOOLS, check_call  # noqa: E402

ANSWER = {"name": "Ada Lovelace", "age": 36, "address": {"city": "London", "zip": "01234"},
          "pets": [{"kind": "cat", "name": "Puff"}, {"kind": "dog", "name": "Rex"}]}
ASK = [{"role": "user", "content": "Invent a person. Reply with JSON only."}]


def timed(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def llguidance_figures(loaded) -> dict:
    tok, size = loaded.tokenizer, loaded.config.vocab_size
    t0 = time.perf_counter()
    vocab = Vocabulary(tok.to_json(), size, tok.stop_ids)
    index = time.perf_counter() - t0
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    compile_s = timed(lambda: Constraint(vocab, compile_grammar(grammar)))
    ids = tok.ids_of(json.dumps(ANSWER, separators=(JSON_LAYOUT["item_separator"], JSON_LAYOUT["key_separator"])))
    c = Constraint(vocab, compile_grammar(grammar))
    steps = []
    for i in ids:
        t0 = time.perf_counter()
        c.allowed()
        steps.append(time.perf_counter() - t0)
        c.accept(i)
    return {"index_s": index, "compile_s": compile_s, "mask_ms": 1000 * statistics.median(steps),
            "mean_ms": 1000 * statistics.mean(steps), "tokens": len(ids)}


def xgrammar_figures(loaded) -> dict | None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    hf = PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer.inner) if loaded.tokenizer.inner is not None \
        else None
    size = loaded.config.vocab_size
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=size, stop_token_ids=sorted(loaded.tokenizer.stop_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    index = time.perf_counter() - t0
    schema = json.dumps(SCHEMA)
    compile_s = timed(lambda: xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False,
                                                                             separators=(", ", ": "))))
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": ")))
    bitmask = xgr.allocate_token_bitmask(1, size)
    ids = loaded.tokenizer.ids_of(json.dumps(ANSWER))
    steps = []
    for i in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        steps.append(time.perf_counter() - t0)
        if not matcher.accept_token(i):
            raise SystemExit(f"xgrammar refused token {len(steps)} of the answer")
    return {"index_s": index, "compile_s": compile_s, "mask_ms": 1000 * statistics.median(steps),
            "mean_ms": 1000 * statistics.mean(steps), "tokens": len(ids)}


def decode_rate(loaded, batch: int, constrained: bool, tokens: int) -> float:
    """Aggregate decode tok/s of `batch` sequences (prefill excluded: each sequence's own decode time)."""
    extra = {"json_schema": SCHEMA} if constrained else {"stop_at_eos": False}
    reqs = [(i, Request.from_dict({"messages": ASK, "max_tokens": tokens, "temperature": 1.0, "seed": i, **extra}))
            for i in range(batch)]
    t0 = time.perf_counter()
    recs = dict(execute_many(loaded, reqs, parallel=batch))
    wall = time.perf_counter() - t0
    made = sum(r["stats"]["decode_tokens"] for r in recs.values())
    prefill = max(r["stats"]["prefill_seconds"] for r in recs.values())
    return made / max(wall - prefill, 1e-9)


def validity(loaded, samples: int, parallel: int) -> tuple[int, int, list[str]]:
    import jsonschema

    reqs = [(i, Request.from_dict({"messages": ASK, "max_tokens": 300, "temperature": 1.0, "seed": 1000 + i,
                                   "json_schema": SCHEMA})) for i in range(samples)]
    good, bad = 0, []
    for _, rec in execute_many(loaded, reqs, parallel=parallel):
        try:
            jsonschema.validate(json.loads(rec["text"]), SCHEMA)
            good += 1
        except Exception as e:  # noqa: BLE001 - the failure is the figure
            bad.append(f"{type(e).__name__}: {rec['text'][:80]!r}")
    return good, samples, bad


def tool_validity(loaded, samples: int, parallel: int) -> tuple[int, int, list[str]]:
    reqs = [(i, Request.from_dict({"messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": "required",
                                   "max_tokens": 120, "temperature": 1.0, "seed": 2000 + i})) for i in range(samples)]
    good, bad = 0, []
    for _, rec in execute_many(loaded, reqs, parallel=parallel):
        try:
            assert rec["finish_reason"] == "tool_calls" and rec["tool_calls"], "no call"
            for call in rec["tool_calls"]:
                check_call(call)
            good += 1
        except Exception as e:  # noqa: BLE001 - the failure is the figure
            bad.append(f"{type(e).__name__}: {rec['text'][:80]!r}")
    return good, samples, bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--weights", default=None)
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    loaded = load(args.model, device="cpu", weights=args.weights)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; model {args.model} ({loaded.weights}), "
          f"vocabulary {loaded.config.vocab_size:,}")
    print("| library | tokenizer index s | schema compile ms | mask per token ms: median, mean |\n|---|---|---|---|")
    for name, fig in (("llguidance", llguidance_figures(loaded)), ("xgrammar", xgrammar_figures(loaded))):
        if fig is None:
            print(f"| {name} | not installed | | |")
        else:
            print(f"| {name} | {fig['index_s']:.2f} | {1000 * fig['compile_s']:.2f} | "
                  f"{fig['mask_ms']:.3f}, {fig['mean_ms']:.3f} ({fig['tokens']} tokens) |")
    print("\n| batch | plain tok/s | JSON Schema tok/s | cost of the mask |\n|---|---|---|---|")
    for batch in (1, 8):
        rates = {True: [], False: []}
        for r in range(args.repeats):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                rates[constrained].append(decode_rate(loaded, batch, constrained, args.tokens))
        plain, masked = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"| {batch} | {plain:.1f} | {masked:.1f} | {100 * (1 - masked / plain):.1f}% |", flush=True)
    good, n, bad = validity(loaded, args.samples, parallel=16)
    print(f"\nsampled at temperature 1: {good}/{n} parse and validate against the schema")
    for b in bad[:5]:
        print("  failed:", b)
    good, n, bad = tool_validity(loaded, args.samples, parallel=16)
    print(f"required tool calls sampled at temperature 1: {good}/{n} made, parsed and validated")
    for b in bad[:5]:
        print("  failed:", b)


if __name__ == "__main__":
    main()
