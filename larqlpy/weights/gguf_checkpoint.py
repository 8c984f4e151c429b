"""A GGUF file's tensors as the decoder takes them (what weights/checkpoint.py's Checkpoint is for a
directory of safetensors files), read from a private mapping of the file: float32 ones zero-copy,
quantized matrices unpacked into integer codes (kernels/weights/gguf_blocks.py) for `weights` native, or
dequantized by gguf-py for the other formats. The file itself, its metadata cache: gguf_file.py."""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from larqlpy.errors import LarqlError
from larqlpy.files import is_gguf
from larqlpy.kernels.weights.gguf_blocks import (HALF_SCALES, LAYOUTS, TWO_LEVEL, BlockRows, packed_width, tiled_arrays,
                                                 unpack_tiled)
from larqlpy.kernels.weights.packing import fill_byte
from larqlpy.kernels.weights.qweight import TILE, PackedWeight
from larqlpy.kernels.weights.simd import PLANES, TABLES
from larqlpy.model.config import ModelConfig
from larqlpy.weights.checkpoint import Checkpoint, view_of, wanted_tensors
from larqlpy.weights.gguf_check import refuse_unused, unused_tensors
from larqlpy.weights.gguf_file import GGUFFile
from larqlpy.weights.mxfp4_checkpoint import MXFP4, open_checkpoint

CHUNK_BYTES = 16 << 20  # of a matrix's blocks unpacked at a time (GGUFCodes._chunks)
FLOAT16 = {"F16": "f16", "BF16": "bf16"}  # 16-bit float matrices: run on their own bits (PackedWeight kinds)


class GGUFCheckpoint:
    """A GGUF file's tensors under the names and shapes the decoder takes: what weights/checkpoint.py's
    Checkpoint is for a directory of safetensors files. A file holding tensors its architecture does
    not take is refused, as a directory is, unless `allow_unused_tensors`."""

    def __init__(self, file: GGUFFile, cfg: ModelConfig, allow_unused_tensors: bool = False):
        self.file, self.cfg, self.path = file, cfg, file.path
        self.raw_config = json.loads((file.dir / "config.json").read_text())
        self.names: dict[str, tuple[str, bool]] = {}  # HF name -> (gguf name, stored as 1 + w)
        for name in file.tensors:
            hf = file.arch.hf_name(name)
            if hf is not None:
                self.names[hf[0]] = (name, hf[1])
        # a view's stored tensor is there too (Gemma 4's experts: rows of a fused gate|up, gguf_gemma4)
        self.files = {name: file.path for hf in self.names for name in (hf, view_of(hf)[0])}
        self.wanted = wanted_tensors(file.path, cfg, self.files)
        self.unused = unused_tensors(file.tensors, file.arch, {hf for hf, _ in self.wanted.values()})
        if self.unused and not allow_unused_tensors:
            refuse_unused(file.path, file.arch, self.unused)
        self.handles = {file.path: None}
        self.dtypes: dict[str, str] = {}
        for ours, (hf, shape) in self.wanted.items():
            name, plus_one = self.names[hf]
            qtype, got, _, _ = file.tensors[name]
            if got != shape:
                raise LarqlError(f"{file.path}: tensor {name} has shape {list(got)}, expected {list(shape)}")
            moved = plus_one or (file.arch.permuted_qk and name.split(".")[2:3] in (["attn_q"], ["attn_k"]))
            self.dtypes[ours] = "F32" if qtype == "F32" and not moved else qtype
        self.fingerprint = file.fingerprint
        with open(file.path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes (or float32 values), zero-copy over the file's pages."""
        qtype, shape, offset, nbytes = self.file.tensors[name]
        if qtype == "F32":
            return np.frombuffer(self.map, np.float32, nbytes // 4, offset).reshape(shape)
        return np.frombuffer(self.map, np.uint8, nbytes, offset)

    def mapped(self, ours: str) -> np.ndarray:
        """A weight as float32 in the HF layout: zero-copy where the file holds it so, else a copy."""
        hf = self.wanted[ours][0]
        name, plus_one = self.names[hf]
        qtype, shape, _, _ = self.file.tensors[name]
        a = self.raw(name)
        if qtype != "F32":
            try:
                a = dequantize(a, GGMLQuantizationType[qtype]).astype(np.float32, copy=False)
            except Exception as e:
                raise LarqlError(f"{self.path}: cannot dequantize {name} ({qtype}: {e})") from None
            a = a.reshape(shape)
        return self.file.arch.hf_values(name, a, self.raw_config, plus_one)

    def float_fallback(self) -> dict | None:
        """The matrices `native` reads as float32 because their type has no codes here (gguf-py
        dequantizes them at load), and what that costs a decoded token: their float32 bytes against
        the file's (an untied embedding, gathered one row a token, left out of both); None if none."""
        untied, types, count, held, f32 = "lm_head" in self.wanted, {}, 0, 0, 0
        for ours, (hf, shape) in self.wanted.items():
            name, plus_one = self.names[hf]
            qtype, _, _, nbytes = self.file.tensors[name]
            if len(shape) != 2 or plus_one or qtype == "F32" or qtype in LAYOUTS or qtype in FLOAT16:
                continue
            types[qtype] = types.get(qtype, 0) + 1
            count += 1
            if not (untied and ours == "embed_tokens"):
                held, f32 = held + nbytes, f32 + 4 * int(np.prod(shape))
        if not count:
            return None
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(types.items()))
        return {"tensors": count, "types": types, "file_bytes_per_token": held, "f32_bytes_per_token": f32,
                "text": f"{count} matrices ({kinds}) read as float32, no codes for their type: "
                        f"{f32 / 1e6:.1f} MB a token where the file holds {held / 1e6:.1f} MB"}

    def native(self, gather: bool = True) -> "GGUFCodes":
        """The quantized matrices as codes; gather: an untied embedding stays in the file's blocks."""
        return GGUFCodes(self, gather)

    def release(self, name: str, rows: int) -> None:
        """Drop the file's pages behind a tensor's first `rows` rows, copied out (unpacked into codes):
        the process keeps only what it runs on. From the tensor's start each time: reading the next
        rows maps pages around them, behind as well as ahead. A page shared with rows still to read
        is read again from the file when they are."""
        _, shape, offset, nbytes = self.file.tensors[name]
        lo = offset // mmap.PAGESIZE * mmap.PAGESIZE
        self.map.madvise(mmap.MADV_DONTNEED, lo, offset + rows * (nbytes // matrix_shape(shape)[0]) - lo)


class GGUFCodes:
    """The quantized matrices of a GGUF packed as their own integer codes (what
    weights/native_file.NativeFile gives for a converted directory), unpacked from the block bytes
    when asked for."""

    def __init__(self, ckpt: GGUFCheckpoint, gather: bool = True):
        self.ckpt, self.gather = ckpt, gather
        # 3-D and quantized: DeepSeek's per-head attn_k_b / attn_v_b, packed as one matrix of every head's rows
        self.matrices = {hf for hf, (name, plus_one) in ckpt.names.items() if not plus_one and (
            (ckpt.file.tensors[name][0] in (*LAYOUTS, *FLOAT16) and len(ckpt.file.tensors[name][1]) == 2) or
            (ckpt.file.tensors[name][0] in LAYOUTS and len(ckpt.file.tensors[name][1]) == 3))}

    def _chunks(self, name: str, rows: np.ndarray) -> list[tuple[int, int]]:
        """Row ranges to unpack at a time, each's file pages dropped before the next is read, so a
        large matrix (a tied embedding) is never held both as the file's blocks and as codes. A
        matrix whose rows are permuted (llama's q, k) goes whole."""
        _, shape, _, nbytes = self.ckpt.file.tensors[name]
        shape = matrix_shape(shape)
        if not np.array_equal(rows, np.arange(shape[0])):
            return [(0, shape[0])]
        step = max(TILE, CHUNK_BYTES // max(1, nbytes // shape[0]) // TILE * TILE)
        return [(r0, min(r0 + step, shape[0])) for r0 in range(0, shape[0], step)]

    def kind(self, hf: str) -> tuple:
        """What must match for matrices to share one packed whole: (zero, bits, group, affine, whether
        the scales are two-level), at the width they are packed at."""
        qtype = self.ckpt.file.tensors[self.ckpt.names[hf][0]][0]
        if qtype in FLOAT16:
            return (qtype,)
        _, _, _, group, zero, affine = LAYOUTS[qtype]
        bits, base = packed_width(qtype)
        return zero - base, bits, group, affine, qtype in TWO_LEVEL

    def table(self, hf: str) -> PackedWeight | BlockRows:
        """A matrix only gathered from (an untied embedding): left in the file's blocks (`gather`),
        else packed."""
        if not self.gather:
            return self.pack([hf])
        name = self.ckpt.names[hf][0]
        qtype, shape, _, _ = self.ckpt.file.tensors[name]
        return self.pack([hf]) if qtype in FLOAT16 else BlockRows(self.ckpt.raw(name), qtype, shape)

    def pack(self, hfs: list[str]) -> PackedWeight:
        """Matrices of one kind stacked in this order as one PackedWeight, each unpacked from its
        blocks straight into the tiled layout (rows un-permuted on the way: llama's q and k)."""
        file, config = self.ckpt.file, self.ckpt.raw_config
        names = [self.ckpt.names[hf][0] for hf in hfs]
        qtype, first, _, _ = file.tensors[names[0]]
        k = first[-1]
        if qtype in FLOAT16:
            return self._pack_16bit(names, FLOAT16[qtype])
        _, _, _, _, zero, affine = LAYOUTS[qtype]
        bits, base = packed_width(qtype)  # one kind stacks: every part's width is the first's
        zero -= base
        n = sum(matrix_shape(file.tensors[name][1])[0] for name in names)
        halves = all(file.tensors[name][0] in HALF_SCALES for name in names)  # MXFP4 stacks beside Q5_0
        codes, scale, minimum, outer, seen = tiled_arrays(qtype, n, k)  # K-quants: the file's integer scales
        lo = 0
        for name in names:
            qtype, shape, _, _ = file.tensors[name]
            shape = matrix_shape(shape)
            rows = file.arch.restore(name, np.arange(shape[0]), config)  # destination row i takes source row rows[i]
            raw = self.ckpt.raw(name)
            for r0, r1 in self._chunks(name, rows):
                unpack_tiled(raw, qtype, shape, rows[r0:r1], lo + r0, codes, scale, minimum, seen, (bits, base), outer)
                self.ckpt.release(name, r1)  # copied out: the file's pages behind it are not kept
            lo += shape[0]
        if n % TILE and not PLANES[bits] and bits not in TABLES:  # padding: the zero code (3, 5, 6 bits, tables: 0)
            codes[-1, :, n % TILE:TILE, :] = fill_byte(bits, zero)
        finite = ((outer & 0x7C00) != 0x7C00).all() if outer is not None else \
            np.isfinite(scale).all() and np.isfinite(minimum).all()
        if not finite:
            raise LarqlError(f"{self.ckpt.path}: {' / '.join(names)} hold non-finite scales (NaN or infinity)")
        return PackedWeight.from_tiled(codes, (n, k), scale, minimum if affine else None, zero, bits,
                                       int(seen[:, 0].min()), int(seen[:, 1].max()), halves=halves, outer=outer)

    def _pack_16bit(self, names: list[str], kind: str) -> PackedWeight:
        """float16 / bfloat16 matrices stacked as their bits, rows un-permuted (llama's q and k)."""
        parts = []
        for name in names:
            _, shape, _, _ = self.ckpt.file.tensors[name]
            rows = self.ckpt.file.arch.restore(name, np.arange(shape[0]), self.ckpt.raw_config)
            parts.append(self.ckpt.raw(name).view(np.uint16).reshape(shape)[rows])
            self.ckpt.release(name, shape[0])
        return PackedWeight.from_16bit(np.concatenate(parts) if len(parts) > 1 else parts[0], kind)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor's (rows, inputs): a 3-D one's outer dims as rows (heads x rows each)."""
    return int(np.prod(shape[:-1])), int(shape[-1])


def checkpoint(path: Path, cfg: ModelConfig, allow_unused_tensors: bool = False) -> Checkpoint | GGUFCheckpoint:
    """The weights behind a model path: a GGUF file's tensors, or a directory's safetensors files."""
    if is_gguf(path):
        return GGUFCheckpoint(GGUFFile(path), cfg, allow_unused_tensors)
    return open_checkpoint(path, cfg, allow_unused_tensors)


def default_weights(ckpt: Checkpoint | GGUFCheckpoint) -> str:
    """What the files hold: a GGUF's own codes, or MXFP4 experts' (native); bf16 for a checkpoint
    whose matrices are all bfloat16 (its norms may be float32); float32 otherwise."""
    if isinstance(ckpt, GGUFCheckpoint) or MXFP4 in ckpt.dtypes.values():
        return "native"
    matrices = [ckpt.dtypes[ours] for ours, (_, shape) in ckpt.wanted.items() if len(shape) == 2]
    return "bf16" if all(d == "BF16" for d in matrices) else "f32"
