"""A safetensors directory whose experts are MXFP4, as OpenAI publishes GPT-OSS (config.json's
`quantization_config` with `quant_method` "mxfp4"), read on the experts' own codes.

Each fused expert tensor X (gate_up_proj, down_proj) is a pair, as transformers' integrations/mxfp4.py
reads it (`convert_moe_packed_tensors`): X_blocks, uint8 (experts, rows, inputs / 32, 16), two E2M1
values a byte, input 2i in the low nibble and 2i + 1 in the high; X_scales, uint8 (experts, rows,
inputs / 32), each block's E8M0 exponent e, the block's values times 2^(e - 127). The rows are the
matrix's outputs, gate_up_proj's gate and up interleaved (gate the even rows), so X stands for the
float tensor transformers dequantizes to, (experts, inputs, outputs), and each expert's matrix is
the same view of it as of a float checkpoint (checkpoint.stored_as).

A block is relaid as a GGUF MXFP4 block (the exponent byte, then input j in the low nibble of byte j
and input j + 16 in the high, as llama.cpp's converter does; the same exponent), so the codes,
values and kernels are the .gguf route's (kernels/weights/gguf_lowbit.py): `weights` native runs them
(the file's nibbles as indices into the "fp4" table and its exponent bytes, 4.25 bits a weight,
unpacked at every load, nothing kept on disk) with the bf16 / f16 matrices on their own bits; f32,
bf16, int8 and int4 take the experts' exact float32 values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.gguf_blocks import LAYOUTS, packed_width, tiled_arrays, unpack, unpack_tiled, values
from larqlpy.kernels.weights.qweight import PackedWeight
from larqlpy.model.config import ModelConfig
from larqlpy.model.families import read_raw_config
from larqlpy.weights.checkpoint import Checkpoint, MappedSafetensors, view_array, view_of
from larqlpy.weights.native_file import NativeFile

MXFP4 = "MXFP4"  # the dtype an expert tensor read from blocks and scales has (as a GGUF names the type)
FLOAT16 = {"BF16": "bf16", "F16": "f16"}  # matrices `native` runs on their own bits (PackedWeight kinds)


def open_checkpoint(path: Path, cfg: ModelConfig, allow_unused_tensors: bool = False) -> Checkpoint:
    """A directory's weights: MXFP4 experts where config.json says so, else plain safetensors."""
    quant = read_raw_config(path).get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        return MXFP4Checkpoint(path, cfg, allow_unused_tensors)
    return Checkpoint(path, cfg, allow_unused_tensors)


def as_gguf_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's (rows, groups, 16) nibbles and (rows, groups) exponents as GGUF MXFP4 blocks, (rows,
    groups * 17) bytes."""
    pairs = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)  # input order
    out = np.empty((*scales.shape, 17), np.uint8)
    out[..., 0] = scales
    out[..., 1:] = pairs[..., :16] | (pairs[..., 16:] << 4)
    return out.reshape(len(out), -1)


class MXFP4Checkpoint(Checkpoint):
    """A directory of safetensors files whose fused expert tensors are MXFP4 block / scale pairs,
    each read as the float tensor it stands for (dtype "MXFP4")."""

    def stand_ins(self) -> dict[str, tuple[str, ...]]:
        fused = {}
        for name in self.files:
            base, _, kind = name.rpartition("_")
            other = f"{base}_{'scales' if kind == 'blocks' else 'blocks'}"
            if kind in ("blocks", "scales") and other not in self.files:
                raise LarqlError(f"{self.path}: tensor {name} has no {other} beside it (MXFP4 stores both)")
            if kind == "blocks":
                fused[base] = (name, other)
        return fused

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """A fused tensor's shape as the float tensor it stands for, (experts, inputs, outputs), its
        blocks and scales checked to fit each other."""
        if name not in self.fused:
            return super().header(name)
        blocks, scales = self.fused[name]
        (bshape, btype), (sshape, stype) = Checkpoint.header(self, blocks), Checkpoint.header(self, scales)
        if (btype, stype) != ("U8", "U8"):
            raise LarqlError(f"{self.path}: {blocks} and {scales} are {btype} and {stype}, expected U8 "
                             "(MXFP4 nibbles and exponents)")
        if len(bshape) != 4 or bshape[-1] != 16 or sshape != bshape[:-1]:
            raise LarqlError(f"{self.path}: {blocks} has shape {list(bshape)} and {scales} {list(sshape)}, expected "
                             "(experts, rows, blocks, 16) and (experts, rows, blocks)")
        return (bshape[0], 32 * bshape[2], bshape[1]), MXFP4

    def blocks(self, hf: str) -> np.ndarray:
        """An expert matrix's rows (a view `BASE@eJ,T[,rows]` of a fused tensor) as GGUF MXFP4 blocks:
        its outputs are the stored rows, so the view's transpose is already so."""
        base, expert, _, rows = view_of(hf)
        parts = []
        for name in self.fused[base]:
            f = self.files[name]
            if f not in self._maps:
                self._maps[f] = MappedSafetensors(f)
            a = self._maps[f].array(name)[expert]
            parts.append(a[rows[0]:rows[1]:rows[2]] if rows else a)
        return as_gguf_blocks(*parts)

    def mapped(self, ours: str) -> np.ndarray:
        """An MXFP4 expert matrix as its exact float32 values, else as Checkpoint.mapped."""
        if self.dtypes[ours] != MXFP4:
            return super().mapped(ours)
        hf, shape = self.wanted[ours]
        u, scale, _, zero, _ = unpack(self.blocks(hf), MXFP4, shape)
        return values(u, scale, None, zero)

    def native(self, gather: bool = True) -> "MXFP4Codes":
        """The matrices as `weights` native runs them (gather: as GGUFCheckpoint.native's, unused)."""
        return MXFP4Codes(self)


class MXFP4Codes(NativeFile):
    """What weights/native_file.NativeFile gives for a converted GGUF, from the checkpoint itself:
    the MXFP4 experts as their codes (the relaid blocks unpacked straight into the tiled layout, as a
    .gguf's are), bf16 / f16 matrices as their bits; float32 ones stay out (they load as float32)."""

    def __init__(self, ckpt: MXFP4Checkpoint):  # no file of codes to open: NativeFile's reading is not used
        self.ckpt, self.path = ckpt, ckpt.path
        zero, bits = LAYOUTS[MXFP4][4], LAYOUTS[MXFP4][2]
        self.shapes = {hf: shape for ours, (hf, shape) in ckpt.wanted.items()
                       if len(shape) == 2 and ckpt.dtypes[ours] in (MXFP4, *FLOAT16)}
        self.matrices = {hf: {"type": ckpt.dtypes[ours], "zero": zero, "bits": bits}
                         for ours, (hf, _) in ckpt.wanted.items() if hf in self.shapes}

    def kind(self, name: str) -> tuple:
        qtype = self.matrices[name]["type"]
        if qtype in FLOAT16:
            return (qtype,)
        bits, base = packed_width(qtype)
        return LAYOUTS[qtype][4] - base, bits, LAYOUTS[qtype][3], False

    def pack(self, names: list[str]) -> PackedWeight:
        qtype = self.matrices[names[0]]["type"]
        if qtype not in FLOAT16:
            return self._pack_blocks(names)
        return PackedWeight.from_16bit(np.concatenate([self._bits(n) for n in names]), FLOAT16[qtype])

    def _pack_blocks(self, names: list[str]) -> PackedWeight:
        """MXFP4 matrices stacked in this order, each's relaid blocks unpacked into the tiled layout at
        the type's packed width (its table's indices, the exponent bytes as its scales)."""
        n, k = sum(self.shapes[name][0] for name in names), self.shapes[names[0]][1]
        bits, _ = packed_width(MXFP4)
        codes, scale, minimum, _, seen = tiled_arrays(MXFP4, n, k)
        lo = 0
        for name in names:
            rows = self.shapes[name][0]
            unpack_tiled(self.ckpt.blocks(name), MXFP4, self.shapes[name], np.arange(rows), lo, codes, scale, minimum,
                         seen, (bits, 0))
            lo += rows
        return PackedWeight.from_tiled(codes, (n, k), scale, None, LAYOUTS[MXFP4][4], bits, int(seen[:, 0].min()),
                                       int(seen[:, 1].max()))

    def _bits(self, name: str) -> np.ndarray:
        """A float16 / bfloat16 matrix's bits, (out, in) uint16."""
        base = view_of(name)[0]
        with safe_open(str(self.ckpt.files[name]), framework="pt") as f:
            t = view_array(name, f.get_tensor(base)).contiguous()
        return t.view(torch.int16).numpy().view(np.uint16)
