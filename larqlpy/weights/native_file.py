"""MODEL/native.safetensors: a GGUF's quantized matrices as integer codes (convert/native.py), written
by the converter beside the float32 checkpoint and read by `weights` native.

Row-major and layout-free (codes (out, in) uint8, scale / minimum (out, groups) float32): the tiled
layout the kernels read is built from it at load and kept in the packed-weight cache, so a change of
layout never asks for a reconversion. The header records each matrix's GGUF type, zero point and code
width, the matrices native runs as float32 and the checkpoint fingerprint the codes belong to.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.gguf_blocks import packed_width
from larqlpy.kernels.weights.qweight import PackedWeight

FILE = "native.safetensors"
FORMAT = "larqlpy-native/1"


def write(path: Path, codes: dict[str, tuple], floats: dict[str, str], fingerprint: str) -> None:
    """codes: HF name -> (u, scale, minimum or None, zero, bits, GGUF type name); floats: HF name ->
    GGUF type of the matrices kept as float32."""
    tensors, matrices = {}, {}
    for name, (u, scale, minimum, zero, bits, qtype) in codes.items():
        tensors[f"{name}.codes"], tensors[f"{name}.scale"] = np.ascontiguousarray(u), np.ascontiguousarray(scale)
        if minimum is not None:
            tensors[f"{name}.minimum"] = np.ascontiguousarray(minimum)
        matrices[name] = {"type": qtype, "zero": int(zero), "bits": int(bits)}
    save_file(tensors, str(path), metadata={"format": FORMAT, "fingerprint": fingerprint,
                                            "matrices": json.dumps(matrices), "floats": json.dumps(floats)})


class NativeFile:
    """The codes of one model directory, checked to belong to its checkpoint."""

    def __init__(self, model_dir: Path, fingerprint: str):
        self.path = model_dir / FILE
        if not self.path.is_file():
            raise LarqlError(f"{model_dir}: no native weights ({FILE}); convert the GGUF again (`convert_gguf`) "
                             "to write them beside the checkpoint")
        try:
            self.handle = safe_open(str(self.path), framework="numpy")
            meta = self.handle.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT}")
            self.matrices: dict[str, dict] = json.loads(meta["matrices"])
            self.floats: dict[str, str] = json.loads(meta["floats"])
        except Exception as e:  # truncated, garbled or foreign: safetensors and json say so their own way
            raise LarqlError(f"{self.path}: not readable native weights ({str(e).splitlines()[0]}); "
                             "convert the GGUF again (`convert_gguf`)") from None
        if meta.get("fingerprint") != fingerprint:
            raise LarqlError(f"{self.path}: written for other weights than this checkpoint's; "
                             "convert the GGUF again (`convert_gguf`)")

    def kind(self, name: str) -> tuple:
        """What must match for matrices to share one packed whole: (zero, bits, group, affine)."""
        m = self.matrices[name]
        k = self.handle.get_slice(f"{name}.codes").get_shape()[1]
        groups = self.handle.get_slice(f"{name}.scale").get_shape()[1]
        bits, base = packed_width(m["type"])
        return m["zero"] - base, bits, k // max(1, groups), f"{name}.minimum" in self.handle.keys()

    def table(self, name: str) -> PackedWeight:
        """A matrix only gathered from (an untied embedding), packed as any other."""
        return self.pack([name])

    def pack(self, names: list[str]) -> PackedWeight:
        """Matrices of one kind stacked in this order as one PackedWeight, at the GGUF types' own
        width (gguf_blocks.packed_width: a .gguf run directly packs the same)."""
        parts = [self.codes(n) for n in names]
        cat = [np.concatenate([p[f] for p in parts]) if parts[0][f] is not None else None for f in range(3)]
        bits, base = packed_width(self.matrices[names[0]]["type"])  # one kind stacks: the first's width
        if bits == parts[0][4]:
            return PackedWeight.from_codes(*cat, parts[0][3], bits)
        return PackedWeight.from_codes(cat[0] - np.uint8(base), *cat[1:], parts[0][3] - base, bits)

    def codes(self, name: str) -> tuple:
        """(u, scale, minimum or None, zero, bits) of one matrix."""
        m = self.matrices[name]
        try:
            u, scale = self.handle.get_tensor(f"{name}.codes"), self.handle.get_tensor(f"{name}.scale")
            minimum = self.handle.get_tensor(f"{name}.minimum") if f"{name}.minimum" in self.handle.keys() else None
        except Exception as e:
            raise LarqlError(f"{self.path}: cannot read {name} ({str(e).splitlines()[0]})") from None
        if u.dtype != np.uint8 or u.ndim != 2 or scale.shape[0] != u.shape[0] or u.shape[1] % scale.shape[1]:
            raise LarqlError(f"{self.path}: {name} has codes {list(u.shape)} and scales {list(scale.shape)} "
                             "that do not fit")
        return u, scale.astype(np.float32, copy=False), minimum, m["zero"], m["bits"]
