"""Decode on a CUDA GPU: larqlpy at each weight format and KV engine beside transformers, one run.

No weights reach a GPU machine here (nothing can be downloaded there, and what travels to it is
small), so each model is its real shape with random weights, written by transformers at bfloat16:
decode's speed depends on the shapes, not the values (greedy ids never stop: EOS is ignored). The
tokenizer is the tests' tiny one. Prints the GPU, a device-to-device copy's bandwidth, and for
every runner prefill and decode tokens/s, decode's bytes read per token x tokens/s against that
bandwidth, and the ratio to transformers (measured first, in the same run). Asserts nothing.

    python bench/gpu.py [--shapes qwen2.5-0.5b,llama-3-8b] [--weights bf16,int8,int4] [--context 1024]
    python bench/gpu.py --shapes qwen2.5-0.5b --engines "canonical/v1,window/v1,codec/v1 bits=4"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
import transformers  # noqa: E402
from decode import hf_bytes_per_token, larqlpy_bytes_per_token  # noqa: E402
from tiny import write_tokenizer  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from larqlpy.model.decoder import prefill  # noqa: E402
from larqlpy.engines import build_provider, parse_engine_spec  # noqa: E402
from larqlpy.weights.loader import load  # noqa: E402

SHAPES = {  # the published configs' shapes
    "qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
        max_position_embeddings=32768, rms_norm_eps=1e-6)),
    "llama-3-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=5e5,
        max_position_embeddings=8192, rms_norm_eps=1e-5)),
}


DEVICE = "cuda"  # --device cpu: a dry run of the bench itself


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def copy_bandwidth(nbytes: int) -> float:
    """GB/s of a device-to-device copy, bytes read plus written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    b.copy_(a)
    return 2 * nbytes / statistics.median(timed(lambda: b.copy_(a)) for _ in range(5)) / 1e9


def write_model(shape: str, where: Path):
    config_cls, model_cls, kw = SHAPES[shape]
    where.mkdir(parents=True, exist_ok=True)
    write_tokenizer(where)
    cfg = getattr(transformers, config_cls)(**kw, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                                            attention_bias=shape.startswith("qwen"))
    with torch.device(DEVICE):
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(str(where), safe_serialization=True)
    return model


class Larqlpy:
    def __init__(self, path: Path, weights: str, engine: str):
        self.loaded = load(path, device=DEVICE, dtype="bfloat16", weights=weights)
        name, *options = engine.split()  # "codec/v1 bits=4"
        self.provider = build_provider(parse_engine_spec(continuation=name, options=options))
        self.name = f"larqlpy {weights} {engine}"
        self.bytes_per_token = larqlpy_bytes_per_token(self.loaded)

    @torch.inference_mode()
    def run(self, ids, n) -> tuple[float, float]:
        state = self.provider.new_state(self.loaded.model.geometries(), self.loaded.device)
        box = {}
        t_prefill = timed(lambda: box.setdefault("logits", prefill(self.loaded.model, state, ids, 4096)))
        tok = box["logits"][-1].argmax().reshape(1)

        def steps():
            nonlocal tok
            for _ in range(n):
                tok = self.loaded.model(tok, state)[-1].argmax().reshape(1)
        return t_prefill, timed(steps)


class Transformers:
    def __init__(self, hf):
        self.hf, self.name = hf, "transformers bf16"
        self.bytes_per_token = hf_bytes_per_token(hf)

    @torch.inference_mode()
    def run(self, ids, n) -> tuple[float, float]:
        cache, box = DynamicCache(config=self.hf.config), {}
        x = torch.tensor([ids], device=DEVICE)
        t_prefill = timed(lambda: box.setdefault("out", self.hf(x, past_key_values=cache, use_cache=True,
                                                               logits_to_keep=1)))
        tok = box["out"].logits[:, -1].argmax(-1, keepdim=True)

        def steps():
            nonlocal tok
            for _ in range(n):
                tok = self.hf(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return t_prefill, timed(steps)


def measure(r, ids, args, bandwidth: float, ref: float | None) -> float:
    """Median prefill and decode of `args.repeats` runs after a warm-up; prints the row."""
    r.run(ids[:64], 4)  # compiles, allocator pools
    runs = [r.run(ids, args.decode) for _ in range(args.repeats)]
    p, d = (statistics.median(x[i] for x in runs) for i in (0, 1))
    gbs = r.bytes_per_token * args.decode / d / 1e9
    print(f"{r.name:<34}{args.context / p:>14.0f}{args.decode / d:>14.1f}{gbs:>8.0f}{gbs / bandwidth:>9.2f}"
          f"{(ref or d) / d:>7.2f}", flush=True)
    return d


def bench_shape(shape: str, args, bandwidth: float) -> None:
    """One runner at a time (an 8B twice over would not fit beside a third), each printed as it ends."""
    where = Path(args.dir) / shape
    t0 = time.perf_counter()
    hf = write_model(shape, where)
    print(f"\n## {shape}: written in {time.perf_counter() - t0:.0f} s; context {args.context}, decode "
          f"{args.decode} tokens, median of {args.repeats}", flush=True)
    print(f"{'runner':<34}{'prefill tok/s':>14}{'decode tok/s':>14}{'GB/s':>8}{'of copy':>9}{'vs hf':>7}")
    ids = [2] + [7 + (i * 37) % 280 for i in range(args.context - 1)]
    ref = measure(Transformers(hf), ids, args, bandwidth, None)
    del hf
    torch.cuda.empty_cache() if DEVICE == "cuda" else None
    for weights in args.weights.split(","):
        for engine in args.engines.split(","):
            t0 = time.perf_counter()
            try:
                r = Larqlpy(where, weights, engine)
            except Exception as e:  # a format this path cannot take is a row, not the end of the bench
                print(f"larqlpy {weights} {engine}: {type(e).__name__}: {e}", flush=True)
                continue
            print(f"(loaded {r.name} in {time.perf_counter() - t0:.0f} s)", flush=True)
            measure(r, ids, args, bandwidth, ref)
            del r
            torch.cuda.empty_cache() if DEVICE == "cuda" else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama-3-8b")
    ap.add_argument("--weights", default="f32,bf16,int8,int4", help="f32: the file's floats cast to bfloat16")
    ap.add_argument("--engines", default="canonical/v1", help="comma-separated, options after a space")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/larqlpy-cuda-bench")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device")
    bandwidth = copy_bandwidth(4 << 30 if DEVICE == "cuda" else 1 << 28)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
    print(f"{name}, torch {torch.__version__}; device-to-device copy {bandwidth:.0f} GB/s")
    for shape in args.shapes.split(","):
        bench_shape(shape, args, bandwidth)


if __name__ == "__main__":
    main()
