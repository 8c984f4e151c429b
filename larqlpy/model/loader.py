"""Load a Hugging Face-layout Gemma 3 directory: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from larqlpy.model import calibration_file
from larqlpy.errors import LarqlError
from larqlpy.kernels.qweight import PackedPart, PackedWeight, check_format, stack
from larqlpy.model.config import Gemma3Config, read_config
from larqlpy.model.gemma3 import Block, Gemma3
from larqlpy.model.tokenizer import Tokenizer

BLOCK_WEIGHTS = {
    # ours: (HF name under model.layers.{i}., shape as a function of the config)
    "q_proj": ("self_attn.q_proj.weight", lambda c: (c.num_attention_heads * c.head_dim, c.hidden_size)),
    "k_proj": ("self_attn.k_proj.weight", lambda c: (c.kv_dim, c.hidden_size)),
    "v_proj": ("self_attn.v_proj.weight", lambda c: (c.kv_dim, c.hidden_size)),
    "o_proj": ("self_attn.o_proj.weight", lambda c: (c.hidden_size, c.num_attention_heads * c.head_dim)),
    "q_norm": ("self_attn.q_norm.weight", lambda c: (c.head_dim,)),
    "k_norm": ("self_attn.k_norm.weight", lambda c: (c.head_dim,)),
    "gate_proj": ("mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    "up_proj": ("mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size)),
    "down_proj": ("mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
    "input_layernorm": ("input_layernorm.weight", lambda c: (c.hidden_size,)),
    "post_attention_layernorm": ("post_attention_layernorm.weight", lambda c: (c.hidden_size,)),
    "pre_feedforward_layernorm": ("pre_feedforward_layernorm.weight", lambda c: (c.hidden_size,)),
    "post_feedforward_layernorm": ("post_feedforward_layernorm.weight", lambda c: (c.hidden_size,)),
}
# Where the text decoder lives: text-only checkpoints, the original multimodal one, transformers >= 4.52's.
PREFIXES = ("model.", "language_model.model.", "model.language_model.")


@dataclass
class LoadedModel:
    path: Path
    config: Gemma3Config
    model: Gemma3
    tokenizer: Tokenizer
    fingerprint: str  # config + weight file headers: what a saved state must match
    weights: str = "f32"  # f32 | bf16 | int8 | int4: the precision the matrices run at

    def held_weights(self) -> list:
        """Every weight as the model holds it: float tensors, packed matrices (not nn.Parameters), and
        the stacked matrix behind packed q|k|v and gate|up once."""
        m = self.model
        held = [m.embed_tokens, m.norm] + [getattr(b, n) for b in m.layers for n in BLOCK_WEIGHTS]
        return list({id(w): w for w in (w.whole if isinstance(w, PackedPart) else w for w in held)}.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take on their device (packed matrices at their packed size)."""
        return sum(w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size() for w in self.held_weights())

    @property
    def device(self) -> torch.device:
        return self.model.device


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
        return {name: single for name in _open(single).keys()}
    raise LarqlError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors reports truncation and bad headers as its own error types
        raise LarqlError(f"{file}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def load(path: str | Path, device: str = "auto", dtype: str = "float32", weights: str = "f32",
         key_calibration: bool = True) -> LoadedModel:
    """Load a model directory. device: auto|cpu|cuda; dtype: float32|bfloat16 (activations);
    weights: f32|bf16|int8|int4 -- the matrices (embedding / tied LM head included) are packed at load;
    key_calibration: read kv_calibration.safetensors when the directory has one (model/calibration_file.py)."""
    path = Path(path)
    check_format(weights)
    cfg = read_config(path)
    tokenizer = Tokenizer.from_dir(path, cfg)
    dev = resolve_device(device)
    tdtype = resolve_dtype(dtype)
    files = weight_files(path)
    prefix = next((p for p in PREFIXES if p + "embed_tokens.weight" in files), None)
    if prefix is None:
        raise LarqlError(f"{path}: missing tensor embed_tokens.weight (looked under {', '.join(PREFIXES)})")

    wanted: dict[str, tuple[str, tuple[int, ...]]] = {
        "embed_tokens": (prefix + "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
        "norm": (prefix + "norm.weight", (cfg.hidden_size,)),
    }
    for i in range(cfg.num_hidden_layers):
        for ours, (hf, shape) in BLOCK_WEIGHTS.items():
            wanted[f"layers.{i}.{ours}"] = (f"{prefix}layers.{i}.{hf}", shape(cfg))
    missing = [hf for hf, _ in wanted.values() if hf not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LarqlError(f"{path}: missing tensor {missing[0]}{more}")

    model = Gemma3(cfg, device=dev, dtype=tdtype)
    handles = {f: _open(f) for f in sorted(set(files[hf] for hf, _ in wanted.values()))}
    maps: dict[Path, _MappedFile] = {}
    hasher = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    pending: dict[str, torch.Tensor] = {}  # float32 matrices to pack once all are read
    for ours, (hf, shape) in wanted.items():
        handle = handles[files[hf]]
        info = handle.get_slice(hf)
        got = tuple(info.get_shape())
        if got != shape:
            raise LarqlError(f"{path}: tensor {hf} has shape {list(got)}, expected {list(shape)}")
        hasher.update(f"{hf}:{info.get_dtype()}:{list(got)}".encode())
        packed = weights != "f32" and len(shape) == 2
        if info.get_dtype() == "F32" and (packed or (dev.type == "cpu" and tdtype == torch.float32)):
            tensor = maps.setdefault(files[hf], _MappedFile(files[hf])).tensor(hf)  # zero-copy, shared pages
        else:
            try:
                tensor = handle.get_tensor(hf)
            except Exception as e:
                raise LarqlError(f"{files[hf]}: cannot read tensor {hf} ({str(e).splitlines()[0]})") from None
        owner, _, attr = ours.rpartition(".")
        module = model.get_submodule(owner)
        if packed:  # quantized on the CPU from float32 below, then moved: the same codes on every device
            pending[ours] = tensor
        else:
            setattr(module, attr, torch.nn.Parameter(tensor.to(device=dev, dtype=tdtype), requires_grad=False))
    for i in range(cfg.num_hidden_layers if pending else 0):
        block = model.layers[i]
        for names in Block.SHARED_INPUT:  # one stacked matrix per group: one kernel call in decode
            parts = stack([pending.pop(f"layers.{i}.{n}") for n in names], weights, f"layers.{i}.{'|'.join(names)}")
            whole = parts[0].whole.to(dev)
            for n, part in zip(names, parts):
                block._parameters.pop(n)
                setattr(block, n, PackedPart(whole, part.lo, part.hi))
    for ours, tensor in pending.items():
        owner, _, attr = ours.rpartition(".")
        module = model.get_submodule(owner)
        module._parameters.pop(attr)
        setattr(module, attr, PackedWeight.quantize(tensor.float(), weights, ours).to(dev))
    for f in handles:  # the bytes themselves: a sample from each end of every file, and its size
        size = f.stat().st_size
        with open(f, "rb") as fh:
            hasher.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            hasher.update(fh.read(1 << 20))
        hasher.update(f"{f.name}:{size}".encode())
    fingerprint = hasher.hexdigest()[:16]
    if key_calibration:
        model.key_calibration = calibration_file.load(path, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                                 fingerprint)
    return LoadedModel(path, cfg, model, tokenizer, fingerprint, weights)


class _MappedFile:
    """float32 tensors straight from a safetensors file's pages (a private copy-on-write mapping):
    loading costs no copy, and processes that load the same file share its page cache."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (n,) = struct.unpack_from("<Q", self.map, 0)
        self.header = json.loads(bytes(self.map[8:8 + n]))
        self.data = 8 + n
        self.path = path

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]
        lo, hi = info["data_offsets"]
        if self.data + hi > len(self.map):
            raise LarqlError(f"{self.path}: truncated: tensor {name} runs past the end of the file")
        t = torch.frombuffer(self.map, dtype=torch.float32, count=(hi - lo) // 4, offset=self.data + lo)
        return t.view(*info["shape"])


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LarqlError("`device` cuda: no CUDA device available")
    if device not in ("cpu", "cuda"):
        raise LarqlError(f"`device`: expected auto, cpu or cuda, got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise LarqlError(f"`dtype`: expected float32 or bfloat16, got {dtype!r}")
    return table[dtype]


def describe(path: str | Path) -> dict:
    """What `larqlpy info` shows, read from config.json and the safetensors headers (no weights loaded)."""
    path = Path(path)
    cfg = read_config(path)
    files = weight_files(path)
    params, dtypes = 0, set()
    for f in sorted(set(files.values())):
        h = _open(f)
        for name in h.keys():
            if files.get(name) != f:
                continue
            s = h.get_slice(name)
            n = 1
            for d in s.get_shape():
                n *= d
            params += n
            dtypes.add(s.get_dtype())
    g, l = cfg.rope_global, cfg.rope_local
    scaling = "" if g.rope_type == "default" else f" ({g.rope_type} x{g.factor:g})"
    return {
        "model_type": "gemma3_text" if cfg.weight_prefix == "model." else "gemma3 (text part)",
        "parameters": params, "dtypes": ",".join(sorted(dtypes)), "layers": cfg.num_hidden_layers,
        "layer_kinds": ["sliding" if cfg.is_sliding(i) else "global" for i in range(cfg.num_hidden_layers)],
        "hidden_size": cfg.hidden_size, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "sliding_window": cfg.sliding_window, "vocab_size": cfg.vocab_size,
        "rope": f"global {g.theta:g}{scaling}, local {l.theta:g}",
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "key_calibration": calibration_file.summary(path),
    }
