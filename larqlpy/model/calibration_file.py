"""`kv_calibration.safetensors` beside the weights: the model's key calibration (one
engines.stores.calibration.KeyCalibration per layer), its metadata, and every check on reading it."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from larqlpy.engines.stores.calibration import KeyCalibration
from larqlpy.errors import LarqlError

FILE = "kv_calibration.safetensors"
FORMAT = "larqlpy-kv-calibration/1"


def save(model_dir: str | Path, cals: list[KeyCalibration], meta: dict) -> Path:
    """Write the calibration into the model directory (atomically)."""
    path = Path(model_dir) / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    tensors = {}
    for i, c in enumerate(cals):
        tensors[f"layers.{i}.key_mean"] = c.mean
        tensors[f"layers.{i}.key_scale"] = c.scale
    try:
        save_file(tensors, str(tmp), metadata={k: str(v) for k, v in meta.items()})
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise LarqlError(f"{path}: cannot write the calibration ({e.strerror or e})") from None
    return path


def summary(model_dir: str | Path) -> str:
    """One line for `info`: what the directory's calibration file says (nothing is validated)."""
    path = Path(model_dir) / FILE
    if not path.exists():
        return "none (`calibrate` writes one; codec calib=on needs it)"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:
        return f"{FILE}: unreadable (rerun `calibrate`)"
    shares = [float(x) for x in meta.get("mean_share", "").split(",") if x]
    share = f", mean share of key energy {min(shares):.2f}-{max(shares):.2f}" if shares else ""
    return f"{FILE} ({meta.get('tokens', '?')} tokens{share})"


def load(model_dir: str | Path, n_layers: int, n_kv_heads: int, head_dim: int,
         fingerprint: str | None = None) -> list[KeyCalibration] | None:
    """The model directory's calibration, checked against the model's shape (and, given one, the
    fingerprint of the weights it was measured on); None when there is none."""
    path = Path(model_dir) / FILE
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != FORMAT:
                raise LarqlError(f"{path}: not a larqlpy key calibration (format {meta.get('format')!r}); "
                                 "rerun `calibrate`")
            if fingerprint is not None and meta.get("model_fingerprint", fingerprint) != fingerprint:
                raise LarqlError(f"{path}: measured on other weights (fingerprint {meta['model_fingerprint']}, "
                                 f"these {fingerprint}); rerun `calibrate`")
            out = []
            for i in range(n_layers):
                pair = []
                for what in ("key_mean", "key_scale"):
                    name = f"layers.{i}.{what}"
                    if name not in names:
                        raise LarqlError(f"{path}: missing tensor {name}; rerun `calibrate`")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != (n_kv_heads, head_dim) or t.dtype != torch.float32:
                        raise LarqlError(f"{path}: tensor {name} is {t.dtype} {list(t.shape)}, expected float32 "
                                         f"{[n_kv_heads, head_dim]}; rerun `calibrate`")
                    pair.append(t)
                if not (torch.isfinite(pair[0]).all() and torch.isfinite(pair[1]).all() and (pair[1] > 0).all()):
                    raise LarqlError(f"{path}: layer {i} holds non-finite or non-positive values; rerun `calibrate`")
                out.append(KeyCalibration.of(*pair))
            if any(n.startswith(f"layers.{n_layers}.") for n in names):
                raise LarqlError(f"{path}: calibrated for more than {n_layers} layers; rerun `calibrate`")
    except LarqlError:
        raise
    except Exception as e:  # safetensors reports bad headers and truncation as its own error types
        raise LarqlError(f"{path}: not a readable calibration file ({str(e).splitlines()[0]})") from None
    return out
