"""A model directory's files without torch: the safetensors index, tensor headers, zero-copy float32
arrays straight from a file's pages, and the fingerprint states and calibrations are checked
against."""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

from larqlpy.errors import LarqlError
from larqlpy.model.config import ModelConfig
from larqlpy.model.families import read_raw_config
from larqlpy.model.tensors import block_weights, layers_name, top_weights

# Where the text decoder lives: text-only checkpoints, the original multimodal one, transformers >= 4.52's;
# GPT-2's, saved by transformers or as OpenAI's checkpoints name them (no prefix).
PREFIXES = ("model.", "language_model.model.", "model.language_model.")
GPT2_PREFIXES = ("transformer.", "")

Wanted = dict[str, tuple[str, tuple[int, ...]]]  # ours -> (HF name, shape)


def open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except Exception as e:  # safetensors reports truncation and bad headers as its own error types
        raise LarqlError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file holding it, from the index for sharded checkpoints."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LarqlError(f"{index}: malformed index ({e})") from None
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise LarqlError(f"{path}: shard {shard.name} listed in the index is missing")
        return files
    if single.is_file():
        return {name: single for name in open_safetensors(single).keys()}
    raise LarqlError(f"{path}: no model.safetensors or model.safetensors.index.json")


def wanted_tensors(path: Path, cfg: ModelConfig, files: dict[str, Path], views: bool = False) -> Wanted:
    """The tensors the decoder takes, by our names; refuses a checkpoint that lacks one. views: name
    each as a safetensors file holds it, a view of a stored tensor where the family's files fuse or
    transpose it (`stored_as`)."""
    top = top_weights(cfg)
    prefixes = GPT2_PREFIXES if cfg.layout == "gpt2" else PREFIXES
    embed = top["embed_tokens"][0]
    prefix = next((p for p in prefixes if p + embed in files), None)
    if prefix is None:
        raise LarqlError(f"{path}: missing tensor {embed} (looked under {', '.join(repr(p) for p in prefixes)})")
    wanted: Wanted = {ours: (prefix + name, shape(cfg)) for ours, (name, shape) in top.items()}
    if not cfg.tie_word_embeddings:  # the head sits beside the decoder: lm_head.weight
        wanted["lm_head"] = (prefix.removesuffix("model.").removesuffix("transformer.") + "lm_head.weight",
                             (cfg.vocab_size, cfg.hidden_size))
    for i in range(cfg.num_hidden_layers):
        for ours, (hf, shape) in block_weights(cfg, i).items():
            wanted[f"layers.{i}.{ours}"] = (f"{prefix}{layers_name(cfg)}{i}.{hf}", shape(cfg))
    if views:
        wanted = {ours: (stored_as(cfg, hf), shape) for ours, (hf, shape) in wanted.items()}
    missing = [base for base in (view_of(hf)[0] for hf, _ in wanted.values()) if base not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LarqlError(f"{path}: missing tensor {missing[0]}{more}")
    return wanted


CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def stored_as(cfg: ModelConfig, hf: str) -> str:
    """A tensor's name as a safetensors file holds it: `hf`, or a view of a stored tensor, `BASE@SPEC`
    (view_of): GPT-2's Conv1D matrices transposed, Granite-MoE's experts as rows of its fused 3-D tensors."""
    if cfg.layout == "gpt2" and hf.endswith(CONV1D):
        return hf + "@T"
    fused = cfg.moe.hf_fused if cfg.moe is not None else None
    if ".experts." in hf and cfg.moe.hf_interleaved:
        return _interleaved(hf)
    if fused is None or ".experts." not in hf:
        return hf
    block, rest = hf.split(".experts.")
    j, which, _ = rest.split(".")
    n = cfg.moe.intermediate_size
    rows = {"gate": f",r0:{n}", "up": f",r{n}:{2 * n}", "down": ""}[which]
    return f"{block}.{fused[1] if which == 'down' else fused[0]}.weight@e{j}{rows}"


def _interleaved(hf: str) -> str:
    """GPT-OSS: an expert's gate, up or down (weight or bias) as a view of its layer's fused tensors,
    (experts, inputs, outputs) with gate and up interleaved: gate the even outputs, up the odd."""
    block, rest = hf.split(".experts.")
    j, which, kind = rest.split(".")
    fused = "down_proj" if which == "down_proj" else "gate_up_proj"
    suffix = "_bias" if kind == "bias" else ""
    spec = f"e{j}" + ("" if suffix else ",T") + {"gate_proj": ",r0::2", "up_proj": ",r1::2", "down_proj": ""}[which]
    return f"{block}.experts.{fused}{suffix}@{spec}"


def view_of(name: str) -> tuple[str, int | None, bool, tuple[int, int, int] | None]:
    """`BASE@SPEC` -> (BASE, expert index or None, transposed, (rows lo, hi, step) or None); SPEC lists,
    in the order applied, eJ (the outermost index J), T (transposed), rLO:HI (rows LO to HI) or
    rLO::STEP (every STEP-th row from LO)."""
    base, _, spec = name.partition("@")
    expert, transposed, rows = None, False, None
    for part in filter(None, spec.split(",")):
        if part == "T":
            transposed = True
        elif part[0] == "e":
            expert = int(part[1:])
        elif "::" in part:
            lo, step = part[1:].split("::")
            rows = (int(lo), None, int(step))
        else:
            lo, hi = part[1:].split(":")
            rows = (int(lo), int(hi), 1)
    return base, expert, transposed, rows


def view_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    _, expert, transposed, rows = view_of(name)
    shape = shape[1:] if expert is not None else shape
    shape = shape[::-1] if transposed else shape
    return (len(range(shape[0])[rows[0]:rows[1]:rows[2]]), *shape[1:]) if rows else tuple(shape)


def view_array(name: str, a):
    """The view `name` of its base tensor `a` (numpy or torch): zero-copy unless transposed or strided."""
    _, expert, transposed, rows = view_of(name)
    a = a[expert] if expert is not None else a
    a = a.T if transposed else a
    return a[rows[0]:rows[1]:rows[2]] if rows else a


SAMPLE = 1 << 20  # bytes the fingerprint reads from each end of each weight file
IGNORED = (".rotary_emb.inv_freq",)  # buffers some checkpoints saved beside the weights: nothing to load
GPT2_IGNORED = (".attn.bias", ".attn.masked_bias")  # GPT-2's causal mask buffers, in OpenAI's files


def unused_tensors(files: dict[str, Path], wanted: Wanted, cfg: ModelConfig) -> list[str]:
    """The tensors of the decoder's part of the files (under its prefix, and its head) that the
    family does not take: weights of another family, or more layers than config.json says. Other
    parts of a multimodal checkpoint (a vision tower) lie outside the prefix."""
    used = {view_of(hf)[0] for hf, _ in wanted.values()}
    prefix = wanted["embed_tokens"][0].removesuffix(top_weights(cfg)["embed_tokens"][0])
    head = prefix.removesuffix("model.").removesuffix("transformer.") + "lm_head.weight"
    ignored = IGNORED + (GPT2_IGNORED if cfg.layout == "gpt2" else ())
    left = tuple(prefix + p for p in cfg.ignored)  # what the family leaves (DeepSeek-V3's MTP layers)
    extra = [n for n in files if (n.startswith(prefix) or n == head) and n not in used and not n.endswith(ignored)
             and not (left and n.startswith(left))]
    return sorted(n for n in extra if not (n == head and cfg.tie_word_embeddings))  # a tied head's own copy


class Checkpoint:
    """The safetensors files behind a model: headers checked against the wanted shapes, and the
    fingerprint of config + headers + a sample of each file's bytes (what a saved state, a key
    calibration and a packed-weight cache must match)."""

    def __init__(self, path: Path, cfg: ModelConfig, allow_unused_tensors: bool = False):
        self.path, self.cfg = path, cfg
        self.files = weight_files(path)
        self.fused = self.stand_ins()  # a tensor read from others (its parts): name -> the parts' names
        self.files.update({name: self.files[parts[0]] for name, parts in self.fused.items()})
        self.wanted = wanted_tensors(path, cfg, self.files, views=True)
        self.unused = unused_tensors({n: self.files[n] for n in self.stored()}, self.wanted, cfg)
        self.files.update({hf: self.files[view_of(hf)[0]] for hf, _ in self.wanted.values()})
        if self.unused and not allow_unused_tensors:
            names = ", ".join(self.unused[:3]) + (", ..." if len(self.unused) > 3 else "")
            raise LarqlError(f"{path}: {len(self.unused):,} tensors of its weight files are not used by its family "
                             f"({cfg.model_type}: {names}), so its config.json may not describe these weights; "
                             "pass `allow_unused_tensors` to load it anyway")
        self.handles = {f: open_safetensors(f) for f in sorted({self.files[p] for hf, _ in self.wanted.values()
                                                                for p in self.fused.get(view_of(hf)[0], [hf])})}
        hasher = hashlib.sha256(json.dumps(read_raw_config(path), sort_keys=True).encode())
        self.dtypes: dict[str, str] = {}
        for ours, (hf, shape) in self.wanted.items():
            base, expert, _, _ = view_of(hf)
            full, dtype = self.header(base)
            if expert is not None and expert >= full[0]:  # a fused tensor of too few experts
                raise LarqlError(f"{path}: tensor {base} holds {full[0]} experts, expected {cfg.moe.num_experts}")
            got = view_shape(hf, full)
            if got != shape:
                raise LarqlError(f"{path}: tensor {hf} has shape {list(got)}, expected {list(shape)}")
            self.dtypes[ours] = dtype
            hasher.update(f"{hf}:{dtype}:{list(got)}".encode())
        for f in self.handles:  # the bytes themselves: a sample from each end of every file, and its size
            size = f.stat().st_size
            with open(f, "rb") as fh:
                hasher.update(fh.read(SAMPLE))
                fh.seek(max(0, size - SAMPLE))
                hasher.update(fh.read(SAMPLE))
            hasher.update(f"{f.name}:{size}".encode())
        self.fingerprint = hasher.hexdigest()[:16]
        self._maps: dict[Path, MappedSafetensors] = {}

    def stand_ins(self) -> dict[str, tuple[str, ...]]:
        """Tensors read from parts of others (weights/mxfp4_checkpoint.py): none in plain files."""
        return {}

    def stored(self) -> list[str]:
        """Every tensor of the weight files once, a fused one (`fused`) in place of its parts."""
        parts = {p for ps in self.fused.values() for p in ps}
        return [n for n in self.files if "@" not in n and n not in parts]

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """A stored tensor's (shape, safetensors dtype), from its file's header."""
        f = self.files[name]
        info = (self.handles.get(f) or open_safetensors(f)).get_slice(name)
        return tuple(info.get_shape()), info.get_dtype()

    def mapped(self, ours: str) -> np.ndarray:
        """A float32 tensor as a zero-copy array over its file's pages (private copy-on-write)."""
        hf = self.wanted[ours][0]
        f = self.files[hf]
        if f not in self._maps:
            self._maps[f] = MappedSafetensors(f)
        base = view_of(hf)[0]
        a = self._maps[f].array(base)
        return a if base == hf else np.ascontiguousarray(view_array(hf, a))  # a transposed view copied


DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}


class MappedSafetensors:
    """Tensors straight from a safetensors file's pages (a private copy-on-write mapping): loading
    costs no copy, and processes that load the same file share its page cache."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (n,) = struct.unpack_from("<Q", self.map, 0)
        self.header = json.loads(bytes(self.map[8:8 + n]))
        self.data = 8 + n
        self.path = path

    def array(self, name: str) -> np.ndarray:
        info = self.header[name]
        lo, hi = info["data_offsets"]
        if self.data + hi > len(self.map):
            raise LarqlError(f"{self.path}: truncated: tensor {name} runs past the end of the file")
        dt = np.dtype(DTYPES[info["dtype"]])
        return np.frombuffer(self.map, dtype=dt, count=(hi - lo) // dt.itemsize,
                             offset=self.data + lo).reshape(info["shape"])


def check_finite(file: Path, name: str, a: np.ndarray) -> None:
    """Refuse a weight tensor holding NaN or an infinity, naming it. (max and min propagate NaN and
    show an infinity: two passes at memory speed.)"""
    if a.size and not (np.isfinite(a.max()) and np.isfinite(a.min())):
        bad = int(np.size(a) - np.isfinite(a).sum())
        raise LarqlError(f"{file}: tensor {name} holds {bad:,} non-finite values (NaN or infinity)")
