"""One layer's K/V codec pair: how K and V rows become codes and come back, under an optional key
calibration. codec/v1 (for all its rows and its wider recent tier) and cells/v1 (for QUANTIZED
cells) both store rows through this one class.

Fields are named `k_<field>` and `v_<field>` (a TurboQuant row: `k_norm`, `k_code`, ...), shaped
(Hkv, N, *field_shape). On the CPU a TurboQuant pair can also attend on its codes without decoding a
row (kernels/kvcodec/tq_attend.py), reading them in place (`sides`: a branch's shared prompt rows, then
its own).
"""

from __future__ import annotations

import numpy as np
import torch

from larqlpy.engines.stores.calibration import KeyCalibration
from larqlpy.kernels.kvcodec.rowcodec import CodeSpan, RowCodec, TurboQuantCodec


def precision_label(k: RowCodec, v: RowCodec) -> str:
    """What a saved cell's precision says: tq4 (K and V at 4 bits), tq5/3 (K at 5, V at 3), f32, int4g32."""
    if k.label == v.label:
        return k.label
    if isinstance(k, TurboQuantCodec) and isinstance(v, TurboQuantCodec):
        return f"tq{k.bits}/{v.bits}"
    return f"{k.label}/{v.label}"


def precision_widths(label: str) -> tuple[int, int]:
    """tq4 -> (4, 4), tq5/3 -> (5, 3); ValueError for anything else."""
    if not label.startswith("tq"):
        raise ValueError(f"not a TurboQuant precision: {label!r}")
    k, _, v = label.removeprefix("tq").partition("/")
    return int(k), int(v or k)


class KVCodec:
    def __init__(self, k: RowCodec, v: RowCodec, calibration: KeyCalibration | None = None):
        self.codecs = {"k": k, "v": v}
        self.calibration = calibration
        self.fields = {f"{t}_{name}": spec for t, c in self.codecs.items() for name, spec in c.fields.items()}
        self.label = precision_label(k, v)
        self.fused = k.fused and v.fused  # both attend on codes

    @property
    def k(self) -> RowCodec:
        return self.codecs["k"]

    @property
    def v(self) -> RowCodec:
        return self.codecs["v"]

    def row_bytes(self, n_kv_heads: int) -> int:
        """Bytes of one position's K and V codes over all KV heads."""
        return n_kv_heads * (self.k.row_bytes + self.v.row_bytes)

    def encode(self, k: torch.Tensor, v: torch.Tensor, first: int) -> dict[str, torch.Tensor]:
        """k, v: (Hkv, T, D) at positions first.. -> fields (Hkv, T, ...); keys as (k - m_p) * scale
        under a calibration."""
        k = self.calibrate(k, first)
        return {**self._encode("k", k), **self._encode("v", v)}

    def calibrate(self, k: torch.Tensor, first: int) -> torch.Tensor:
        """Keys (Hkv, T, D) at positions first.. -> what the codes hold ((k - m_p) * scale, or k)."""
        return k if self.calibration is None else self.calibration.apply(k, first)

    def encode_into(self, keys: torch.Tensor, v: torch.Tensor, buf: dict[str, torch.Tensor], slot: int) -> None:
        """A decode step's calibrated keys (`calibrate`) and values (Hkv, 1, D) into row `slot` of a
        store's buffers: the codes `encode` gives (fused codecs write theirs in one kernel call
        instead: `code_set`)."""
        for t, x in (("k", keys), ("v", v)):
            for name, val in self._encode(t, x).items():
                buf[name][:, slot] = val[:, 0]

    def _encode(self, t: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hkv, n, _ = x.shape
        enc = self.codecs[t].encode(x.reshape(hkv * n, -1))
        return {f"{t}_{name}": val.view(hkv, n, *val.shape[1:]) for name, val in enc.items()}

    def decode(self, fields: dict[str, torch.Tensor], t: str, out: torch.Tensor, first: int) -> None:
        """Rows' `t` ("k" or "v") fields at positions first.. -> out (Hkv, N, D) f32, the calibration
        undone."""
        hkv, n, d = out.shape
        codec = self.codecs[t]
        flat = {name: fields[f"{t}_{name}"].reshape(hkv * n, *fields[f"{t}_{name}"].shape[2:]).contiguous()
                for name in codec.fields}
        direct = out.is_contiguous()  # a slice of a scratch buffer spans heads: decode beside it, then copy
        got = codec.decode(flat, out=out.view(hkv * n, d) if direct else None)
        if not direct or got.data_ptr() != out.data_ptr():
            out.copy_(got.view(hkv, n, d))
        if t == "k" and self.calibration is not None:
            self.calibration.undo(out, first, out=out)

    # -- attending on codes (fused codecs, CPU) --------------------------------------------------
    def sides(self, spans: list[CodeSpan]) -> tuple:
        """Code spans (`Rows.spans`, numpy arrays) as the fused kernel reads them: K's side, then V's
        (`TurboQuantCodec.side`), eight items."""
        out = []
        for t, codec in self.codecs.items():
            out += codec.side([(f[f"{t}_norm"], f[f"{t}_code"], first, n) for f, first, n in spans])
        return tuple(out)

    def code_set(self, arrays: dict[str, np.ndarray]) -> tuple:
        """A code set's buffers (numpy, rows first) with the codebooks that write them: where
        kernels/kvcodec/tq_step.py's one call writes a decode step's rows (fused codecs)."""
        return (self.k.boundaries, self.k.bits, self.v.boundaries, self.v.bits, arrays["k_norm"], arrays["k_code"],
                arrays["v_norm"], arrays["v_code"])
