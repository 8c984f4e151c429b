"""The TurboQuant codec in torch: the same operations, in the same order, as the numba kernels, so
it runs on CUDA and (for tests) on CPU with the same codes and values."""

from __future__ import annotations

import torch

from larqlpy.kernels.kvcodec import tqformat
from larqlpy.kernels.kvcodec import turboquant as tq


class TorchCodec:
    def __init__(self, d: int, bits: int, device: torch.device):
        tqformat.check_dim(d)
        tqformat.check_bits(bits)
        c, b = tq.codebook(bits)
        self.d, self.bits, self.device = d, bits, device
        self.signs = torch.from_numpy(tq.signs(d)).to(device)
        self.centroids = torch.from_numpy(c).to(device)
        self.boundaries = torch.from_numpy(b).to(device)
        self.shifts = torch.arange(8, device=device, dtype=torch.int64) * bits
        self.byte_shifts = torch.arange(bits, device=device, dtype=torch.int64) * 8

    def fwht(self, v: torch.Tensor) -> torch.Tensor:
        """Unnormalised Walsh-Hadamard butterfly over the last dim, stage by stage like `fwht`."""
        n, d = v.shape
        h = 1
        while h < d:
            pairs = v.view(n, d // (2 * h), 2, h)
            a, b = pairs[:, :, 0], pairs[:, :, 1]
            v = torch.stack((a + b, a - b), dim=2).view(n, d)
            h *= 2
        return v

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (n, d) -> norms (n,) f32, codes (n, d*bits/8) u8."""
        x = x.float()
        norms = x.double().pow(2).sum(-1).sqrt().float()
        inv = torch.where(norms > 0, 1.0 / norms, torch.ones_like(norms))
        v = self.fwht((x * inv[:, None]) * self.signs)
        idx = torch.bucketize(v, self.boundaries)  # count of boundaries strictly below each value
        return norms, self.pack(idx)

    def pack(self, idx: torch.Tensor) -> torch.Tensor:
        n, d = idx.shape
        if self.bits == 4:
            pairs = idx.view(n, d // 2, 2)
            return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
        if self.bits == 8:
            return idx.to(torch.uint8)
        words = (idx.view(n, d // 8, 8) << self.shifts).sum(-1)  # disjoint bits: sum == or
        return ((words[..., None] >> self.byte_shifts) & 0xFF).view(n, -1).to(torch.uint8)

    def unpack_values(self, codes: torch.Tensor) -> torch.Tensor:
        """codes (n, nbytes) -> centroid values (n, d)."""
        n = codes.shape[0]
        c = codes.to(torch.int64)
        if self.bits == 4:
            idx = torch.stack((c & 0xF, c >> 4), dim=-1).view(n, self.d)
        elif self.bits == 8:
            idx = c
        else:
            words = (c.view(n, self.d // 8, self.bits) << self.byte_shifts).sum(-1)
            idx = ((words[..., None] >> self.shifts) & ((1 << self.bits) - 1)).view(n, self.d)
        return self.centroids[idx]

    def decode(self, norms: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        v = self.fwht(self.unpack_values(codes))
        return v * self.signs * (norms / self.d)[:, None]
