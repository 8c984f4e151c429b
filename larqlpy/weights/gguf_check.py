"""A GGUF's header checked as one step, before anything is built from it (config.json, the tokenizer,
the tensor table): every size, count, index and offset the rest of weights/ reads, refused here in
one line naming its key and value -- not met later as a ZeroDivisionError, an IndexError, a
MemoryError or, worse, as a model that runs and is wrong (token types zipped short, a tensor read
off its alignment). Two checks stand elsewhere: merges naming tokens outside the vocabulary, met
by `tokenizers` as it builds the BPE (gguf_tokenizer.py names the merge: in Rust the check is
free), and tensors the architecture does not take, which need the config and can be allowed
(unused_tensors, refused by gguf_checkpoint.py and convert-gguf)."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from larqlpy.errors import LarqlError
from larqlpy.weights.gguf_archs import ROPE_FREQS, Arch, Meta, llama3_rope
from larqlpy.weights.gguf_deepseek import LOG_MUL, SIGMOID
from larqlpy.weights.gguf_pretok import unknown
from larqlpy.weights.gguf_tokenizer import SENTENCEPIECE_IDS

# Sane upper bounds, each a few times the largest open model's (hidden 16,384, FFN 53,248, 10M
# context, 262k vocabulary, head_dim 256): past them a header is damaged, not a model.
MAX_EMBEDDING = 1 << 16
MAX_FFN = 1 << 18
MAX_CONTEXT = 1 << 24
MAX_VOCAB = 1 << 21
MAX_HEAD_DIM = 1 << 12
MAX_EXPERTS = 1 << 12  # published MoEs have up to a few hundred
# what an architecture's config reads beyond the common ones (gpt2's context: its position table's rows)
EXTRA_SIZES = {"gemma3": ("attention.sliding_window",), "gemma4": ("attention.sliding_window",),
               "gpt2": ("context_length",), "gpt-oss": ("attention.sliding_window", "expert_feed_forward_length")}
LAYERED = ("gemma4",)  # the architectures whose feed_forward_length and head_count_kv may be one a layer
ALWAYS_EXPERTS = ("qwen3moe", "granitemoe", "gpt-oss")
YARN = ("gpt-oss", "deepseek2")  # the architectures whose rope.scaling.type is yarn (read by their config)
INTEGERS = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
            GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}


class Reader(gguf.GGUFReader):
    """gguf-py's reader, with each tensor's place checked before gguf-py maps its bytes: gguf-py takes
    an offset off the alignment as it is (a float32 norm read shifted by a value), and fails on one
    past the end in numpy's words."""

    def __init__(self, src: Path):
        self.src = src
        super().__init__(str(src))

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        """gguf-py's own step on a plain array over the map: a memmap's Python-level slicing hooks,
        run per vocabulary entry, were most of a header read (7.7 s against 2.1 s for 151k tokens)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        arr = plain[offset:offset + dtype.itemsize * int(count)].view(dtype)[:int(count)]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # gguf-py's own step, after the metadata
        check_places(self.src, start_offs, fields, int(self.alignment), len(self.data))
        super()._build_tensors(start_offs, fields)


def check_places(src: Path, start: int, fields: list, alignment: int, size: int) -> None:
    """Each tensor's data: a known type, at an offset on general.alignment, wholly inside the file."""
    for field in fields:
        _, name, _, dims, dtype, offset = field.parts
        name = bytes(name).decode("utf-8", "replace")
        at = int(offset[0])
        if at % alignment:
            raise LarqlError(f"{src}: tensor {name} is at data offset {at}, not a multiple of "
                             f"general.alignment ({alignment})")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(dtype[0]))]
        except (ValueError, KeyError):
            raise LarqlError(f"{src}: tensor {name} has type {int(dtype[0])}, not a GGML type") from None
        end = start + at + math.prod(int(d) for d in dims) * type_size // block
        if end > size:
            raise LarqlError(f"{src}: truncated or damaged: tensor {name} (data offset {at}) runs to byte "
                             f"{end:,}, past the end of the file ({size:,} bytes)")


def check_header(src: Path, m: Meta) -> None:
    """Everything the config and the tokenizer read from the metadata, before either is built."""
    _sizes(src, m)
    if m.arch == "gemma4":
        _gemma4(src, m)
    _rope(src, m)
    _vocabulary(src, m)


def _show(v) -> str:
    if isinstance(v, list):
        return f"a list of {len(v):,} values"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(src: Path, m: Meta, key: str, lo: int, hi: int, why: str = "", optional: bool = False) -> int | None:
    """An integer key, within [lo, hi]; None where an optional one is absent."""
    if key not in m.reader.fields:
        if optional:
            return None
        raise LarqlError(f"{src}: {key} is missing (a {m.arch} GGUF must have it)")
    v = m.get(key)
    if type(v) is not int:  # bool is an int's subclass, and no size
        raise LarqlError(f"{src}: {key} is {_show(v)}: expected an integer")
    if not lo <= v <= hi:
        raise LarqlError(f"{src}: {key} is {v}: expected {lo} to {hi}{why}")
    return v


def _sizes(src: Path, m: Meta) -> None:
    a = m.arch + "."
    tensors = len(m.reader.tensors)
    # First: a config builds lists block_count long, and every block holds several tensors.
    blocks = _int(src, m, a + "block_count", 1, tensors - 1, f" (below the file's {tensors:,} tensors)")
    hidden = _int(src, m, a + "embedding_length", 1, MAX_EMBEDDING)
    _layered(src, m, a + "feed_forward_length", 1, MAX_FFN, blocks)
    heads = _int(src, m, a + "attention.head_count", 1, hidden, f" (at most {a}embedding_length)")
    for kv in _layered(src, m, a + "attention.head_count_kv", 1, heads, blocks, f" (at most {a}attention.head_count)",
                       optional=True):
        if heads % kv:
            raise LarqlError(f"{src}: {a}attention.head_count_kv is {kv}: it must divide "
                             f"{a}attention.head_count ({heads})")
    if _int(src, m, a + "attention.key_length", 1, MAX_HEAD_DIM, optional=True) is None and hidden % heads:
        raise LarqlError(f"{src}: {a}attention.head_count is {heads}: it must divide {a}embedding_length "
                         f"({hidden}) when {a}attention.key_length is absent")
    _int(src, m, a + "context_length", 1, MAX_CONTEXT, optional=True)
    for key in EXTRA_SIZES.get(m.arch, ()):
        _int(src, m, a + key, 1, MAX_CONTEXT)
    _experts(src, m)
    if m.arch == "deepseek2":
        _mla(src, m)


def _mla(src: Path, m: Meta) -> None:
    """deepseek2's latent attention sizes and DeepSeek-MoE's routing (gguf_deepseek.py reads them)."""
    a = m.arch + "."
    _int(src, m, a + "attention.kv_lora_rank", 1, MAX_EMBEDDING)
    _int(src, m, a + "attention.q_lora_rank", 1, MAX_EMBEDDING, optional=True)
    rope = _int(src, m, a + "rope.dimension_count", 2, MAX_HEAD_DIM)
    mla = "_mla" if a + "attention.key_length_mla" in m.reader.fields else ""
    qk = _int(src, m, f"{a}attention.key_length{mla}", 1, MAX_HEAD_DIM)
    _int(src, m, f"{a}attention.value_length{mla}", 1, MAX_HEAD_DIM)
    if rope % 2 or qk <= rope:
        raise LarqlError(f"{src}: {a}rope.dimension_count is {rope}: expected an even number below "
                         f"{a}attention.key_length{mla} ({qk})")
    _int(src, m, a + "nextn_predict_layers", 0, 0, " (multi-token prediction layers are not run)", optional=True)
    count = m.get(a + "expert_count") or 0
    _int(src, m, a + "expert_shared_count", 0, MAX_EXPERTS, optional=True)
    _int(src, m, a + "leading_dense_block_count", 0, m.get(a + "block_count"), f" (at most {a}block_count)",
         optional=True)
    sigmoid = _int(src, m, a + "expert_gating_func", 1, 2, " (1 softmax, 2 sigmoid)", optional=True) == SIGMOID
    groups = _int(src, m, a + "expert_group_count", 1, max(count, 1), f" (at most {a}expert_count)", optional=True)
    _int(src, m, a + "expert_group_used_count", 1, groups or 1, f" (at most {a}expert_group_count)", optional=True)
    if groups and (count % groups or (sigmoid and count // groups < 2)):
        raise LarqlError(f"{src}: {a}expert_group_count is {groups}: it must divide {a}expert_count ({count})"
                         + (" into groups of two or more" if sigmoid else ""))
    _number(src, m, a + "expert_weights_scale", zero=True)
    if m.get(a + "expert_weights_norm") and not sigmoid:
        raise LarqlError(f"{src}: {a}expert_weights_norm is true with softmax gating: DeepSeek-V2's router does "
                         "not renormalize (not supported)")


def _layered(src: Path, m: Meta, key: str, lo: int, hi: int, blocks: int, why: str = "",
             optional: bool = False) -> list[int]:
    """An integer key, or where the architecture reads one a layer (LAYERED), a list of block_count."""
    v = m.get(key)
    if not (isinstance(v, list) and m.arch in LAYERED):
        one = _int(src, m, key, lo, hi, why, optional)
        return [] if one is None else [one]
    if len(v) != blocks:
        raise LarqlError(f"{src}: {key} holds {len(v):,} values for {blocks} layers (one a layer)")
    bad = next((x for x in v if type(x) is not int or not lo <= x <= hi), None)
    if bad is not None:
        raise LarqlError(f"{src}: {key} holds {_show(bad)}: expected integers {lo} to {hi}{why}")
    return v


def _gemma4(src: Path, m: Meta) -> None:
    """What gemma4's config reads beyond the common keys (gguf_gemma4.gemma4_config), in the forms it
    takes: layer types, head widths, shared K/V layers, MLP widths, per-layer KV heads, RoPE."""
    a, n = m.arch + ".", m.get(m.arch + ".block_count")
    pattern = m.get(a + "attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n or any(type(x) is not bool for x in pattern):
        raise LarqlError(f"{src}: {a}attention.sliding_window_pattern is {_show(pattern)}: expected {n} booleans "
                         "(one a layer: sliding or not)")
    wide = _int(src, m, a + "attention.key_length", 1, MAX_HEAD_DIM)
    d = _int(src, m, a + "attention.key_length_swa", 1, MAX_HEAD_DIM, optional=True) or wide
    for key, want in (("attention.value_length", wide), ("attention.value_length_swa", d),
                      ("rope.dimension_count_swa", d)):
        if m.get(a + key, want) != want:
            raise LarqlError(f"{src}: {a}{key} is {_show(m.get(a + key))}: expected {want}, the head width of its "
                             "layers (values as wide as keys, sliding heads turned whole)")
    shared = _int(src, m, a + "attention.shared_kv_layers", 0, n - 1, f" (below {n} layers)", optional=True) or 0
    _int(src, m, a + "embedding_length_per_layer_input", 0, MAX_EMBEDDING, optional=True)
    _number(src, m, a + "rope.freq_base_swa")
    _number(src, m, a + "final_logit_softcapping")
    ffn = m.get(a + "feed_forward_length")
    tail = set(ffn[n - shared:]) if isinstance(ffn, list) else set()
    if isinstance(ffn, list) and (set(ffn[:n - shared]) != {ffn[0]} or not tail <= {ffn[0], 2 * ffn[0]}
                                  or len(tail) > 1):
        raise LarqlError(f"{src}: {a}feed_forward_length is {_show(ffn)}: expected one width, twice it on the last "
                         f"{shared} layers at most (use_double_wide_mlp)")
    kv = m.get(a + "attention.head_count_kv")
    if isinstance(kv, list) and any(len({kv[i] for i in range(n) if pattern[i] == s}) > 1 for s in (True, False)):
        raise LarqlError(f"{src}: {a}attention.head_count_kv is {_show(kv)}: expected one value for the sliding layers "
                         "and one for the global ones")
    freqs = m.tensor(ROPE_FREQS)
    if freqs is not None:
        v = freqs.data.reshape(-1) if freqs.tensor_type.name == "F32" else None
        turned = int((v == 1.0).sum()) if v is not None else 0
        if v is None or v.shape != (wide // 2,) or not turned or (v[:turned] != 1.0).any() or (v[turned:] < 1e29).any():
            raise LarqlError(f"{src}: {ROPE_FREQS} ({freqs.tensor_type.name}, {freqs.n_elements:,} values) is not a "
                             f"proportional RoPE for a head of {wide} (1 for the turned pairs, then 1e30)")


def _experts(src: Path, m: Meta) -> None:
    """A mixture of experts' sizes: qwen3moe and granitemoe always have them, llama where expert_count
    says (Mixtral)."""
    a = m.arch + "."
    if m.arch not in ALWAYS_EXPERTS and not m.get(a + "expert_count"):
        return
    count = _int(src, m, a + "expert_count", 1, MAX_EXPERTS)
    _int(src, m, a + "expert_used_count", 1, count, f" (at most {a}expert_count)")
    if m.arch in ("qwen3moe", "deepseek2", "gemma4"):
        _int(src, m, a + "expert_feed_forward_length", 1, MAX_FFN)


def _number(src: Path, m: Meta, key: str, below: float = math.inf, zero: bool = False) -> float | None:
    """An optional finite number, above 0 (or 0, where `zero`) and below `below`."""
    v = m.get(key)
    if v is None:
        return None
    if type(v) not in (int, float) or not (0 < v or (zero and v == 0)) or not v < below:
        raise LarqlError(f"{src}: {key} is {_show(v)}: expected a number above {'or at ' if zero else ''}0"
                         + ("" if math.isinf(below) else f" and below {below:g}"))
    return v


def _rope(src: Path, m: Meta) -> None:
    a = m.arch + "."
    _number(src, m, a + "rope.freq_base")
    _number(src, m, a + "attention.layer_norm_rms_epsilon", below=1.0)
    _number(src, m, a + "attention.layer_norm_epsilon", below=1.0)  # LayerNorm's (starcoder2, gpt2)
    for key in ("embedding_scale", "residual_scale", "attention.scale", "logit_scale"):  # Granite's multipliers
        _number(src, m, a + key, below=1e6)
    factor = _number(src, m, a + "rope.scaling.factor", zero=True)  # 0: no scaling
    kind = m.get(a + "rope.scaling.type")
    if kind not in (None, "none", "linear") and factor and not (kind == "yarn" and m.arch in YARN):
        raise LarqlError(f"{src}: {a}rope.scaling.type is {_show(kind)}: not supported (linear is)")
    if kind == "yarn" and factor and m.arch == "deepseek2":  # gpt-oss defaults it
        _int(src, m, a + "rope.scaling.original_context_length", 1, MAX_CONTEXT)
    for key in (LOG_MUL, "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow"):
        _number(src, m, a + key, zero=True)
    if m.arch == "gemma4" and kind not in (None, "none") and factor not in (None, 0, 1):
        raise LarqlError(f"{src}: {a}rope.scaling.type is {_show(kind)}: not supported on gemma4 (its RoPE is "
                         "proportional on global layers)")
    tensor = m.tensor(ROPE_FREQS)
    if tensor is not None and m.arch == "llama":
        head_dim = m.arch_key("attention.key_length") or m.arch_key("embedding_length") // \
            m.arch_key("attention.head_count")  # (sizes checked above)
        if tensor.tensor_type.name != "F32" or \
                llama3_rope(tensor.data, m.arch_key("rope.freq_base", 10000.0), int(head_dim)) is None:
            raise LarqlError(f"{src}: {ROPE_FREQS} ({tensor.tensor_type.name}, {tensor.n_elements:,} values) is "
                             f"not Llama 3's RoPE scaling for a head of {head_dim} (its form is the one supported)")


def _strings(src: Path, m: Meta, key: str) -> list[str]:
    f = m.reader.fields.get(key)
    if f is None:
        raise LarqlError(f"{src}: {key} is missing (a model GGUF must have it)")
    if f.types != [GGUFValueType.ARRAY, GGUFValueType.STRING]:
        raise LarqlError(f"{src}: {key} is {_show(m.get(key))}: expected a list of strings")
    return m.get(key)


def _vocabulary(src: Path, m: Meta) -> None:
    tokens = _strings(src, m, "tokenizer.ggml.tokens")
    n = len(tokens)
    if not 1 <= n <= MAX_VOCAB:
        raise LarqlError(f"{src}: tokenizer.ggml.tokens holds {n:,} tokens: expected 1 to {MAX_VOCAB:,}")
    _int(src, m, f"{m.arch}.vocab_size", n, MAX_VOCAB, " (at least the tokens' count)", optional=True)
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        f = m.reader.fields.get(key)
        if f is not None and (f.types[0] != GGUFValueType.ARRAY or len(f.data) != n):
            raise LarqlError(f"{src}: {key} has {len(f.data):,} entries for the {n:,} of tokenizer.ggml.tokens "
                             "(one a token)")
    f = m.reader.fields.get("tokenizer.ggml.token_type")
    if f is not None and f.types[-1] not in INTEGERS:
        raise LarqlError(f"{src}: tokenizer.ggml.token_type is a list of {f.types[-1].name}: expected integers")
    model = m.get("tokenizer.ggml.model")
    if model == "llama" and m.arch == "gemma3":
        ids = dict(SENTENCEPIECE_IDS)  # what the tokenizer takes where the file names none
    elif model == "gemma4" and m.arch == "gemma4":
        ids = {}
        _strings(src, m, "tokenizer.ggml.merges")
    elif model == "gpt2":
        ids = {}
        pre = m.get("tokenizer.ggml.pre", "default")
        if (why := unknown(pre)) is not None:
            raise LarqlError(f"{src}: tokenizer.ggml.pre is {_show(pre)}: {why}")
        # Each merge naming tokens of the vocabulary is checked by `tokenizers` as it builds the BPE
        # (gguf_tokenizer.byte_level_bpe names the first at fault): in Python here, 150k merges cost
        # 90 ms, more than this whole check may.
        _strings(src, m, "tokenizer.ggml.merges")
    else:
        raise LarqlError(f"{src}: tokenizer.ggml.model is {_show(model)} on {m.arch}: not supported "
                         "(byte-level BPE, gpt2, Gemma's SentencePiece and Gemma 4's BPE are)")
    ids.update({k: m.get(k) for k in m.reader.fields if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")})
    for key, i in ids.items():
        if type(i) is not int or not 0 <= i < n:
            raise LarqlError(f"{src}: {key} is {_show(i)}: outside the vocabulary "
                             f"(tokenizer.ggml.tokens holds {n:,})")


def unused_tensors(names, arch: Arch, used: set[str]) -> list[str]:
    """The file's tensors its architecture does not take (by their GGUF names): another family's
    (a Qwen2 relabelled llama keeps 3 biases a layer nobody reads), or more layers than block_count."""
    return sorted(n for n in names if ((hf := arch.hf_name(n)) is None or hf[0] not in used)
                  and n not in arch.in_config)


def refuse_unused(src: Path, arch: Arch, unused: list[str]) -> None:
    names = ", ".join(unused[:3]) + (", ..." if len(unused) > 3 else "")
    raise LarqlError(f"{src}: {len(unused):,} tensors of the file are not used by its architecture "
                     f"(general.architecture {arch.name!r}: {names}), so its metadata may not describe these "
                     "weights; pass `allow_unused_tensors` to load it anyway")
