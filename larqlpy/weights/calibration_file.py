"""`kv_calibration.safetensors` beside the weights: the model's key calibration (per layer, the keys'
mean and per-channel scale, each (Hkv, D) float32), its metadata, and every check on reading it.
Format 2 adds, per layer, `key_turning`: the heads' means taken before RoPE, which
engines/stores/calibration.py turns to each row's position (zero on heads whose mean is fixed).
Format 1 (every mean fixed) is still read.

A problem with the file (stale: measured on other weights; damaged) is reported, not raised: only
the engines that read the calibration refuse to run without it (engines/stores/calibration.py).
Plain numpy: `info` reads it without torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save as to_bytes

from larqlpy.errors import LarqlError
from larqlpy.files import atomic_write
from larqlpy.model.config import ModelConfig

FILE = "kv_calibration.safetensors"
FORMAT = "larqlpy-kv-calibration/2"
FORMATS = ("larqlpy-kv-calibration/1", FORMAT)
Layer = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # (mean, scale, turning mean or None)
Heads = int | list[int]  # KV heads (or head width): every layer's, or one a layer (Gemma 4's differ)


def head_shapes(cfg: ModelConfig) -> tuple[list[int], list[int]]:
    """Each layer's KV heads and head width: what its calibration tensors hold."""
    shapes = [cfg.shape(i) for i in range(cfg.num_hidden_layers)]
    return [s.kv_heads for s in shapes], [s.head_dim for s in shapes]


def save(model_dir: str | Path, layers: list, meta: dict) -> Path:
    """Write the calibration into the model directory (atomically); `layers` are (mean, scale[,
    turning]) tuples or KeyCalibrations, array-like on the CPU."""
    path = Path(model_dir) / FILE
    tensors = {}
    for i, layer in enumerate(layers):
        mean, scale, turning = (layer.mean, layer.scale, layer.turning) if hasattr(layer, "mean") \
            else (*layer, None)[:3]
        tensors[f"layers.{i}.key_mean"] = np.ascontiguousarray(mean, dtype=np.float32)
        tensors[f"layers.{i}.key_scale"] = np.ascontiguousarray(scale, dtype=np.float32)
        if turning is not None:
            tensors[f"layers.{i}.key_turning"] = np.ascontiguousarray(turning, dtype=np.float32)
    with atomic_write(path, "`calibrate`") as f:
        f.write(to_bytes(tensors, metadata={k: str(v) for k, v in meta.items()}))
    return path


def fallback_dir(fingerprint: str) -> Path:
    """Where a model's calibration goes when its own folder is read-only: ~/.cache/larqlpy, by the
    fingerprint of its weights."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "larqlpy" / "calibration" / fingerprint


def save_somewhere(model_dir: str | Path, fingerprint: str, layers: list, meta: dict) -> Path:
    """`save` beside the weights, or into `fallback_dir` when that folder cannot be written."""
    if os.access(model_dir, os.W_OK):
        try:
            return save(model_dir, layers, meta)
        except (OSError, LarqlError):
            pass
    home = fallback_dir(fingerprint)
    home.mkdir(parents=True, exist_ok=True)
    return save(home, layers, meta)


def read_any(model_dir: str | Path, n_layers: int, n_kv_heads: Heads, head_dim: Heads, fingerprint: str,
             files_digest: str | None = None) -> tuple[list[Layer] | None, str | None]:
    """`read` beside the weights, then in `fallback_dir`: the first usable one; else what is wrong
    with the one beside the weights."""
    pairs, problem = read(model_dir, n_layers, n_kv_heads, head_dim, fingerprint, files_digest)
    if pairs is None:
        cached, _ = read(fallback_dir(fingerprint), n_layers, n_kv_heads, head_dim, fingerprint, files_digest)
        if cached is not None:
            return cached, None
    return pairs, problem


def read(model_dir: str | Path, n_layers: int, n_kv_heads: Heads, head_dim: Heads,
         fingerprint: str | None = None, files_digest: str | None = None) -> tuple[list[Layer] | None, str | None]:
    """(the layers' (mean, scale, turning or None), None) when the directory holds a calibration that fits this model
    (and, given one, the fingerprint of the weights it was measured on); (None, None) when it holds
    none; (None, what is wrong) when the file is stale or damaged."""
    try:
        return _read(Path(model_dir) / FILE, n_layers, n_kv_heads, head_dim, fingerprint, files_digest), None
    except FileNotFoundError:
        return None, None
    except LarqlError as e:
        return None, str(e)


def _read(path: Path, n_layers: int, n_kv_heads: Heads, head_dim: Heads, fingerprint: str | None,
          files_digest: str | None) -> list[Layer]:
    if not path.exists():
        raise FileNotFoundError(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") not in FORMATS:
                raise LarqlError(f"{path}: not a larqlpy key calibration (format {meta.get('format')!r}); "
                                 "rerun `calibrate`")
            if fingerprint is not None and meta.get("model_fingerprint", fingerprint) != fingerprint:
                raise LarqlError(f"{path}: measured on other weights (fingerprint {meta['model_fingerprint']}, "
                                 f"these {fingerprint}); rerun `calibrate`")
            made = meta.get("files_digest")  # one written before it was recorded: the fingerprint alone
            if files_digest is not None and made is not None and made != files_digest:
                raise LarqlError(f"{path}: measured on other weights (the weight files changed since); "
                                 "rerun `calibrate`")
            out = []
            for i in range(n_layers):
                pair = []
                for what in ("key_mean", "key_scale", "key_turning"):
                    name = f"layers.{i}.{what}"
                    if what == "key_turning" and name not in names:
                        pair.append(None)
                        continue
                    if name not in names:
                        raise LarqlError(f"{path}: missing tensor {name}; rerun `calibrate`")
                    t = f.get_tensor(name)
                    want = [x if isinstance(x, int) else x[i] for x in (n_kv_heads, head_dim)]
                    if list(t.shape) != want or t.dtype != np.float32:
                        raise LarqlError(f"{path}: tensor {name} is {t.dtype} {list(t.shape)}, expected float32 "
                                         f"{want}; rerun `calibrate`")
                    pair.append(t)
                if not (all(np.isfinite(t).all() for t in pair if t is not None) and (pair[1] > 0).all()):
                    raise LarqlError(f"{path}: layer {i} holds non-finite or non-positive values; rerun `calibrate`")
                out.append((pair[0], pair[1], pair[2]))
            if any(n.startswith(f"layers.{n_layers}.") for n in names):
                raise LarqlError(f"{path}: calibrated for more than {n_layers} layers; rerun `calibrate`")
    except LarqlError:
        raise
    except Exception as e:  # safetensors reports bad headers and truncation as its own error types
        raise LarqlError(f"{path}: not a readable calibration file ({str(e).splitlines()[0]})") from None
    return out


def format_of(model_dir: str | Path) -> str | None:
    """The format a readable calibration file beside the weights says it has (None: no such file)."""
    try:
        with safe_open(str(Path(model_dir) / FILE), framework="numpy") as f:
            return (f.metadata() or {}).get("format")
    except Exception:  # a missing or damaged file: `read` says what is wrong with it
        return None


def summary(model_dir: str | Path, n_layers: int, n_kv_heads: Heads, head_dim: Heads, fingerprint: str) -> str:
    """One line for `info`: the calibration's tokens and key-energy shares, or what is wrong with it."""
    path = Path(model_dir) / FILE
    pairs, problem = read(model_dir, n_layers, n_kv_heads, head_dim, fingerprint)
    if problem is not None:
        return f"unusable: {problem} (engines that read it refuse to run; the others are not affected)"
    if pairs is None:
        return "none (`calibrate` writes one; codec calib=on needs it)"
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
    shares = [float(x) for x in meta.get("mean_share", "").split(",") if x]
    share = f", mean share of key energy {min(shares):.2f}-{max(shares):.2f}" if shares else ""
    return f"{FILE} ({meta.get('tokens', '?')} tokens{share})"
