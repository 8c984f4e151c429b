"""Prefill and decode tokens/s of larqlpy beside transformers on the same weights, in one run.

Also the bandwidth each achieves (weight bytes read per decoded token x tokens/s) against what this
machine's memory delivers to a plain streaming read. Prints ratios; asserts nothing.

    python bench/decode.py --model models/gemma-3-270m [--repeats 3] [--decode 64] [--prefill 1500]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


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


def larqlpy_runner(path: Path, engine: str):
    from larqlpy.engines import build_provider, parse_engine_spec
    from larqlpy.generate import GenerationConfig, prefill
    from larqlpy.model.loader import load

    loaded = load(path, device="cpu")
    provider = build_provider(parse_engine_spec(continuation=engine))
    model = loaded.model

    def prefill_only(ids):
        state = provider.new_state(model.geometries(), loaded.device)
        prefill(model, state, ids, GenerationConfig().prefill_chunk)
        return state

    def decode(ids, n):
        state = prefill_only(ids)
        tok = torch.tensor([ids[-1]])
        t0 = time.perf_counter()
        for _ in range(n):
            logits = model(tok, state)
            tok = logits[-1].argmax().reshape(1)
        return time.perf_counter() - t0

    params = sum(p.numel() for p in model.parameters())
    return loaded, prefill_only, decode, params


def transformers_runner(path: Path):
    from transformers import DynamicCache, Gemma3ForCausalLM

    hf = Gemma3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    @torch.inference_mode()
    def prefill_only(ids):
        cache = DynamicCache(config=hf.config)
        hf(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache

    @torch.inference_mode()
    def decode(ids, n):
        cache = prefill_only(ids)
        tok = torch.tensor([[ids[-1]]])
        t0 = time.perf_counter()
        for _ in range(n):
            out = hf(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - t0

    return prefill_only, decode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=1500)
    ap.add_argument("--engine", default="canonical/v1")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    path = Path(args.model)

    loaded, ours_prefill, ours_decode, params = larqlpy_runner(path, args.engine)
    hf_prefill, hf_decode = transformers_runner(path)
    tok = loaded.tokenizer
    long_ids = tok.encode((ROOT / "larqlpy" / "data" / "long.txt").read_text())[: args.prefill]
    short_ids = tok.encode("The history of the printing press begins")
    weight_bytes = params * 4  # float32; the tied LM head is read once per token, the embedding row is noise

    bw = stream_bandwidth()
    rows = []
    for name, pre, dec in (("larqlpy", ours_prefill, ours_decode), ("transformers", hf_prefill, hf_decode)):
        dec(short_ids, 4)  # warm-up
        pre(long_ids[:64])
        t_pre = median_time(lambda: pre(long_ids), args.repeats)
        t_dec = statistics.median(dec(short_ids, args.decode) for _ in range(args.repeats))
        rows.append((name, len(long_ids) / t_pre, args.decode / t_dec))

    print(f"model {path}  params {params:,}  weights read per token {weight_bytes / 1e9:.3f} GB  "
          f"threads {torch.get_num_threads()}  engine {args.engine}")
    print(f"stream read bandwidth {bw:.2f} GB/s  -> decode ceiling {bw * 1e9 / weight_bytes:.2f} tok/s")
    print(f"{'':14}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode GB/s':>13}{'of ceiling':>12}")
    for name, p, d in rows:
        print(f"{name:14}{p:15.1f}{d:14.2f}{d * weight_bytes / 1e9:13.2f}{d * weight_bytes / 1e9 / bw:12.0%}")
    (_, p0, d0), (_, p1, d1) = rows
    print(f"ratio larqlpy/transformers: prefill {p0 / p1:.2f}x  decode {d0 / d1:.2f}x "
          f"(prompt {len(long_ids)} tokens, {args.decode} decode steps, median of {args.repeats})")


if __name__ == "__main__":
    main()
