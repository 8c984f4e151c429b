"""Row codecs: how one head vector of length d is stored, behind one interface the codec engines use.

- `TurboQuantCodec`: f32 norm + Lloyd-Max indices after a randomized Hadamard rotation (2, 3, 4, 5,
  6 or 8 bits).
  On CPU it runs the numba kernels (and can attend on codes directly); elsewhere the torch twin.
- `Int4GroupCodec`: the seed article's scheme -- symmetric INT4, one scale per group of 32 values
  (stored as float16, as llama.cpp's q4_0 does): 4.5 bits per value at d = 256.
"""

from __future__ import annotations

import numpy as np
import torch

from larqlpy.kernels.kvcodec import tqformat
from larqlpy.kernels.kvcodec import turboquant as tq
from larqlpy.kernels.kvcodec.turboquant_torch import TorchCodec

CodeSpan = tuple[dict[str, np.ndarray], int, int]  # whole (Hkv, capacity, ...) buffers, first row, rows


class RowCodec:
    fields: dict[str, tuple[tuple[int, ...], torch.dtype]]
    fused = False  # can score queries and accumulate values on the stored form

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def decode(self, f: dict[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def row_bytes(self) -> int:
        return sum(int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
                   for shape, dt in self.fields.values())


class TurboQuantCodec(RowCodec):
    def __init__(self, d: int, bits: int, device: torch.device):
        tqformat.check_dim(d)
        tqformat.check_bits(bits)
        self.d, self.bits, self.device = d, bits, device
        self.cpu = device.type == "cpu"
        self.fused = self.cpu
        self.fields = {"norm": ((), torch.float32), "code": ((tqformat.code_bytes(d, bits),), torch.uint8)}
        self.label = f"tq{bits}"
        self.torch = TorchCodec(d, bits, device)
        self.signs = tq.signs(d)
        self.centroids, self.boundaries = tq.codebook(bits)

    def encode(self, x):
        x = x.reshape(-1, self.d).float().contiguous()
        if not self.cpu:
            norm, code = self.torch.encode(x)
            return {"norm": norm, "code": code}
        n = x.shape[0]
        norm = torch.empty(n, dtype=torch.float32)
        code = torch.empty(n, self.fields["code"][0][0], dtype=torch.uint8)
        tq.encode(x.numpy(), self.signs, self.boundaries, self.bits, norm.numpy(), code.numpy())
        return {"norm": norm, "code": code}

    def decode(self, f, out=None):
        norm, code = f["norm"].reshape(-1), f["code"].reshape(-1, f["code"].shape[-1])
        if not self.cpu:
            return self.torch.decode(norm, code)
        out = torch.empty(norm.shape[0], self.d, dtype=torch.float32) if out is None else out
        tq.decode(np.ascontiguousarray(norm.numpy()), np.ascontiguousarray(code.numpy()), self.signs,
                  self.centroids, self.bits, out.numpy())
        return out

    # -- decode steps on the CPU: attention on codes (kernels/kvcodec/tq_attend.py) --
    def side(self, pieces: list[tuple]) -> tuple:
        """The kernel's view of code pieces (one or two read as one run), each (norms (Hkv, cap), codes
        (Hkv, cap, bytes), first row, rows), numpy buffers read in place: (piece a, piece b,
        centroids, bits)."""
        assert 1 <= len(pieces) <= 2 and all(x.flags.c_contiguous for p in pieces for x in p[:2])
        b = pieces[1] if len(pieces) == 2 else (*pieces[0][:2], 0, 0)
        return pieces[0], b, self.centroids, self.bits


class Int4GroupCodec(RowCodec):
    def __init__(self, d: int, group: int, device: torch.device):
        if group < 2 or d % group or group % 2:
            raise ValueError(f"group {group} must be even and divide head_dim {d}")
        self.d, self.group, self.device = d, group, device
        self.fields = {"scale": ((d // group,), torch.float16), "code": ((d // 2,), torch.uint8)}
        self.label = f"int4g{group}"

    def encode(self, x):
        x = x.reshape(-1, self.d).float()
        g = x.view(x.shape[0], -1, self.group)
        scale = g.abs().amax(-1).to(torch.float16)  # the scale actually stored is the one used
        s = scale.float().clamp_min(1e-8)[..., None]
        q = torch.clamp(torch.round(g / s * 7.0), -8, 7).to(torch.int16).view(x.shape[0], self.d) + 8
        code = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
        return {"scale": scale, "code": code}

    def decode(self, f, out=None):
        code = f["code"].reshape(-1, self.d // 2).to(torch.int16)
        q = torch.stack((code & 0xF, code >> 4), dim=-1).view(code.shape[0], self.d).float() - 8.0
        scale = f["scale"].reshape(code.shape[0], -1).float()
        x = (q.view(code.shape[0], -1, self.group) / 7.0 * scale[..., None]).view(code.shape[0], self.d)
        if out is not None:
            out.copy_(x)
            return out
        return x


class ExactCodec(RowCodec):
    """f32 rows as they came: what a per-layer policy stores on a layer kept exact."""

    def __init__(self, d: int, device: torch.device):
        self.d, self.device = d, device
        self.fields = {"x": ((d,), torch.float32)}
        self.label = "f32"

    def encode(self, x):
        return {"x": x.reshape(-1, self.d).float()}

    def decode(self, f, out=None):
        x = f["x"].reshape(-1, self.d)
        if out is not None:
            out.copy_(x)
            return out
        return x


def row_codec(fmt: tuple, d: int, device: torch.device) -> RowCodec:
    """The codec of a row format: ("tq", bits), ("int4g", group) or ("f32",)."""
    if fmt[0] == "tq":
        return TurboQuantCodec(d, fmt[1], device)
    if fmt[0] == "int4g":
        return Int4GroupCodec(d, fmt[1], device)
    return ExactCodec(d, device)
