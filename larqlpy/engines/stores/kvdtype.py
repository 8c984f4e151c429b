"""Exact K/V rows in their kept dtype (engines.geometry.KV_DTYPES) as torch and numpy see them.

numpy has no bfloat16: bf16 rows leave for a state file or the spill file as their uint16 bits and
come back as the same bits, never through a numeric conversion."""

from __future__ import annotations

import warnings

import numpy as np
import torch

TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(kv_dtype: str) -> torch.dtype:
    return TORCH[kv_dtype]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy holds them (bf16: its bits as uint16)."""
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`to_numpy`'s array back as a tensor of `dtype`, sharing its memory; ValueError when the array
    holds another dtype (a saved state made under another kv_dtype)."""
    want = np.dtype(np.uint16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
    if a.dtype != want:
        raise ValueError(f"rows saved as {a.dtype}, expected {want}")
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def readonly_tensor(a: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor over mmap'd bytes (only ever read from), without torch's non-writable warning; of
    `dtype` when the bytes are exact rows (bf16 ones are stored as their bits)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a) if dtype is None else from_numpy(a, dtype)
