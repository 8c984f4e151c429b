"""Load a Hugging Face-layout model directory of any supported family: config.json, safetensors (single
or sharded), tokenizer,
the key calibration; low-bit weight formats come packed from the packed-weight cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from larqlpy.engines.stores.calibration import KeyCalibration
from larqlpy.errors import LarqlError
from larqlpy.kernels.qweight import PackedPart, PackedWeight, check_format, stack
from larqlpy.model import calibration_file, packed_cache
from larqlpy.model.config import ModelConfig
from larqlpy.model.decoder import Block, Decoder
from larqlpy.model.families import read_config
from larqlpy.model.files import Checkpoint, block_weights, check_finite
from larqlpy.model.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer
    fingerprint: str  # config + weight file headers: what a saved state must match
    weights: str = "f32"  # f32 | bf16 | int8 | int4: the precision the matrices run at
    packed_from: str | None = None  # low-bit formats: "cache" or "built" (model/packed_cache.py)

    def held_weights(self) -> list:
        """Every weight as the model holds it: float tensors, packed matrices (not nn.Parameters), and
        the stacked matrix behind packed q|k|v and gate|up once."""
        m = self.model
        held = [m.embed_tokens, m.norm, m.head] + [getattr(b, n) for b in m.layers for n in block_weights(m.cfg)]
        return list({id(w): w for w in (w.whole if isinstance(w, PackedPart) else w for w in held)}.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights take on their device (packed matrices at their packed size)."""
        return sum(w.nbytes if isinstance(w, PackedWeight) else w.numel() * w.element_size() for w in self.held_weights())

    @property
    def device(self) -> torch.device:
        return self.model.device


def load(path: str | Path, device: str = "auto", dtype: str = "float32", weights: str = "f32",
         key_calibration: bool = True) -> LoadedModel:
    """Load a model directory. device: auto|cpu|cuda; dtype: float32|bfloat16 (activations);
    weights: f32|bf16|int8|int4 -- the matrices (embedding / tied LM head included) packed, from the
    packed-weight cache after the first load; key_calibration: read kv_calibration.safetensors when
    the directory has one (a stale or damaged one is reported on the model, not raised).
    Every weight read is checked finite; a NaN or infinity is refused naming its tensor."""
    path = Path(path)
    check_format(weights)
    dev = resolve_device(device)
    tdtype = resolve_dtype(dtype)
    cfg = read_config(path)
    tokenizer = Tokenizer.from_dir(path, cfg)
    ckpt = Checkpoint(path, cfg)
    model = Decoder(cfg, device=dev, dtype=tdtype)
    matrices = {ours for ours, (_, shape) in ckpt.wanted.items() if len(shape) == 2} if weights != "f32" else set()
    packed_from = None
    handles: dict[Path, object] = {}
    if matrices:
        packed, packed_from = packed_cache.load_or_build(path, weights, ckpt.fingerprint,
                                                         lambda: _pack(ckpt, handles, cfg, weights))
        _install_packed(model, packed, dev)
    for ours, (hf, _) in ckpt.wanted.items():
        if ours in matrices:
            continue
        if ckpt.dtypes[ours] == "F32" and dev.type == "cpu" and tdtype == torch.float32:
            tensor = _float32(ckpt, handles, ours)  # zero-copy from the file's pages, shared between processes
        else:
            tensor = _read_tensor(handles, ckpt.files[hf], hf)
            check_finite(ckpt.files[hf], hf, tensor.float().numpy())
        owner, _, attr = ours.rpartition(".")
        setattr(model.get_submodule(owner), attr,
                torch.nn.Parameter(tensor.to(device=dev, dtype=tdtype), requires_grad=False))
    if key_calibration:
        pairs, model.calibration_problem = calibration_file.read(
            path, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, ckpt.fingerprint)
        if pairs is not None:
            model.key_calibration = [KeyCalibration.of(torch.from_numpy(m), torch.from_numpy(s)) for m, s in pairs]
    return LoadedModel(path, cfg, model, tokenizer, ckpt.fingerprint, weights, packed_from)


def _read_tensor(handles: dict, file: Path, hf: str) -> torch.Tensor:
    """A tensor in any safetensors dtype (bf16 and f16 included), copied into memory."""
    try:
        if file not in handles:
            handles[file] = safe_open(str(file), framework="pt")
        return handles[file].get_tensor(hf)
    except Exception as e:
        raise LarqlError(f"{file}: cannot read tensor {hf} ({str(e).splitlines()[0]})") from None


def _float32(ckpt: Checkpoint, handles: dict, ours: str) -> torch.Tensor:
    """A weight as float32, checked finite: zero-copy when the file holds float32."""
    hf = ckpt.wanted[ours][0]
    file = ckpt.files[hf]
    a = ckpt.mapped(ours) if ckpt.dtypes[ours] == "F32" else _read_tensor(handles, file, hf).float().numpy()
    check_finite(file, hf, a)
    return torch.from_numpy(a)


def _pack(ckpt: Checkpoint, handles: dict, cfg: ModelConfig, fmt: str) -> dict[str, PackedWeight]:
    """Every matrix packed from float32 on the CPU (the same codes on every device): q|k|v and
    gate|up stacked into one matrix each, so decode calls one kernel per group."""
    out = {name: PackedWeight.quantize(_float32(ckpt, handles, name), fmt, name)
           for name in ("embed_tokens", "lm_head") if name in ckpt.wanted}
    for i in range(cfg.num_hidden_layers):
        for names in Block.SHARED_INPUT:
            key = f"layers.{i}.{'|'.join(names)}"
            out[key] = stack([_float32(ckpt, handles, f"layers.{i}.{n}") for n in names], fmt, key)[0].whole
        for n in ("o_proj", "down_proj"):
            key = f"layers.{i}.{n}"
            out[key] = PackedWeight.quantize(_float32(ckpt, handles, key), fmt, key)
    return out


def _install_packed(model: Decoder, packed: dict[str, PackedWeight], dev: torch.device) -> None:
    for name in ("embed_tokens", "lm_head"):
        if name in packed:
            model._parameters.pop(name)
            setattr(model, name, packed[name].to(dev))
    for i, block in enumerate(model.layers):
        for names in Block.SHARED_INPUT:  # parts of one stacked matrix: each a row range of the whole
            whole = packed[f"layers.{i}.{'|'.join(names)}"].to(dev)
            lo = 0
            for n in names:
                rows = getattr(block, n).shape[0]
                block._parameters.pop(n)
                setattr(block, n, PackedPart(whole, lo, lo + rows))
                lo += rows
        for n in ("o_proj", "down_proj"):
            block._parameters.pop(n)
            setattr(block, n, packed[f"layers.{i}.{n}"].to(dev))


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
