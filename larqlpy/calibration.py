"""Key calibration: per layer and KV head, the keys' mean and a per-channel scale, measured once on a
fixed text and saved beside the model (`kv_calibration.safetensors`); the codec engines' `calib=on`.

Why it helps: Gemma 3's keys share a large common component (0.4-0.86 of their length) and carry
energy in channels the queries hardly read, so a codec that quantizes raw keys spends its bits on
what scores never see. Quantizing y = (k - mean) * scale instead, with
scale_c = (E[q_c^2] / Var[k_c])^(1/4), balances the key's energy against the query's per channel:
that is the diagonal transform minimising E|y|^2 * E|q / scale|^2, i.e. the expected score error of
an isotropic quantizer of y. Reconstruction is plain algebra -- k' = y' / scale + mean, and
q . k' = (q / scale) . y' + q . mean -- so nothing else changes. The first SKIP positions (attention
sinks, BOS) are left out of the statistics: they are outliers the `sink` option keeps exact.

Measured on the 270M (docs/codec.md): KL at 4/4 bits 0.17 -> 0.04 with a calibration from
larqlpy/data/calibration.txt, a text unrelated to the long.txt it is measured on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from larqlpy.errors import LarqlError

FILE = "kv_calibration.safetensors"
FORMAT = "larqlpy-kv-calibration/1"
TEXT = Path(__file__).resolve().parent / "data" / "calibration.txt"
SKIP = 4  # leading positions left out of the statistics (sinks)
EPS = 1e-3  # variance floor, relative to the mean channel's: a dead channel must not blow a scale up


@dataclass(frozen=True)
class KeyCalibration:
    """One layer's: mean and scale are (Hkv, D) float32; digest names them (saved with states)."""

    mean: torch.Tensor
    scale: torch.Tensor
    digest: str

    @classmethod
    def of(cls, mean: torch.Tensor, scale: torch.Tensor) -> "KeyCalibration":
        mean, scale = mean.float().contiguous(), scale.float().contiguous()
        h = hashlib.sha256(mean.numpy().tobytes() + scale.numpy().tobytes()).hexdigest()[:16]
        return cls(mean, scale, h)

    def to(self, device: torch.device) -> "KeyCalibration":
        return KeyCalibration(self.mean.to(device), self.scale.to(device), self.digest)

    def apply(self, k: torch.Tensor) -> torch.Tensor:
        """Keys (Hkv, N, D) -> what the codes hold: (k - mean) * scale."""
        return (k.float() - self.mean[:, None]) * self.scale[:, None]

    def undo(self, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decoded codes (Hkv, N, D) -> keys: y / scale + mean (into `out` when given; it may be y)."""
        return torch.div(y, self.scale[:, None], out=out).add_(self.mean[:, None])


def require_calibration(geometries, who: str) -> None:
    """Refuse, in one line, an engine asked to use a key calibration the model does not have."""
    if any(g.key_calibration is None for g in geometries):
        raise LarqlError(f"{who} needs the model's key calibration (kv_calibration.safetensors beside the "
                         "weights); run `larqlpy calibrate MODEL_DIR`")


def _scales(q2: torch.Tensor, k: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """q2: (D,) mean squared query per channel; k: (N, D) keys -> (D,) scale, geometric mean 1."""
    var = ((k.double() - mean.double()) ** 2).mean(0)
    var = var + EPS * var.mean()
    q2 = q2.double() + EPS * q2.double().mean()
    s = (q2 / var) ** 0.25
    return s / s.log().mean().exp()


class _QuerySquares:
    """Per KV head, the queries' squared channels summed (positions from SKIP on), and their count."""

    def __init__(self, n_kv_heads: int, head_dim: int):
        self.q2 = torch.zeros(n_kv_heads, head_dim, dtype=torch.float64)
        self.count = 0

    def __call__(self, store, q, p):
        hkv = store.geometry.n_kv_heads
        qq = q[:, max(0, SKIP - store.end):].double() ** 2  # (H, T', D)
        self.q2 += qq.reshape(hkv, -1, qq.shape[-1]).sum(1).cpu()
        self.count += qq.shape[0] // hkv * qq.shape[1]


@torch.inference_mode()
def measure(model, ids: list[int]) -> tuple[list[KeyCalibration], list[float]]:
    """Run `ids` through the model (exact rows) and measure every layer's calibration; also each
    layer's share of key energy in the mean, |mean|^2 / E|k|^2 (averaged over KV heads)."""
    from larqlpy.engines import EngineSpec, build_provider
    from larqlpy.engines.base import QueryTap
    from larqlpy.generate import prefill

    if len(ids) < SKIP + 64:
        raise LarqlError(f"calibration text too short: {len(ids)} tokens, need at least {SKIP + 64}")
    state = build_provider(EngineSpec()).new_state(model.geometries(), torch.device(model.device))
    squares = [_QuerySquares(s.geometry.n_kv_heads, s.geometry.head_dim) for s in state.layers]
    stores = state.layers
    state.layers = [QueryTap(s, sq) for s, sq in zip(stores, squares)]
    prefill(model, state, ids, 1024)
    out, shares = [], []
    for store, sq in zip(stores, squares):
        k, _ = store.read(SKIP, torch.float32)
        k = k.cpu().double()
        mean = k.mean(1)
        q2 = sq.q2 / max(sq.count, 1)
        scale = torch.stack([_scales(q2[h], k[h], mean[h]) for h in range(k.shape[0])])
        out.append(KeyCalibration.of(mean, scale))
        shares.append((mean.pow(2).sum(-1) / k.pow(2).sum(-1).mean(-1)).mean().item())
    return out, shares


def calibrate(loaded, text: str | None = None) -> tuple[list[KeyCalibration], dict]:
    """Measure on `text` (default: the packaged calibration text); returns (layers, metadata)."""
    text = TEXT.read_text() if text is None else text
    ids = loaded.tokenizer.encode(text)
    cals, shares = measure(loaded.model, ids)
    meta = {"format": FORMAT, "tokens": str(len(ids)), "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "model_fingerprint": loaded.fingerprint, "weights": loaded.weights,
            "mean_share": ",".join(f"{x:.4f}" for x in shares)}
    return cals, meta


def save(model_dir: str | Path, cals: list[KeyCalibration], meta: dict) -> Path:
    """Write `kv_calibration.safetensors` into the model directory (atomically)."""
    from safetensors.torch import save_file

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
    """One line for `larqlpy info`: what the directory's calibration file says (nothing is validated)."""
    from safetensors import safe_open

    path = Path(model_dir) / FILE
    if not path.exists():
        return "none (`larqlpy calibrate` writes one; codec calib=on needs it)"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:
        return f"{FILE}: unreadable (rerun `larqlpy calibrate`)"
    shares = [float(x) for x in meta.get("mean_share", "").split(",") if x]
    share = f", mean share of key energy {min(shares):.2f}-{max(shares):.2f}" if shares else ""
    return f"{FILE} ({meta.get('tokens', '?')} tokens{share})"


def load(model_dir: str | Path, n_layers: int, n_kv_heads: int, head_dim: int,
         fingerprint: str | None = None) -> list[KeyCalibration] | None:
    """The model directory's calibration, checked against the model's shape (and, given one, the
    fingerprint of the weights it was measured on); None when there is none."""
    from safetensors import safe_open

    path = Path(model_dir) / FILE
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = set(f.keys())
            if meta.get("format") != FORMAT:
                raise LarqlError(f"{path}: not a larqlpy key calibration (format {meta.get('format')!r}); "
                                 "rerun `larqlpy calibrate`")
            if fingerprint is not None and meta.get("model_fingerprint", fingerprint) != fingerprint:
                raise LarqlError(f"{path}: measured on other weights (fingerprint {meta['model_fingerprint']}, "
                                 f"these {fingerprint}); rerun `larqlpy calibrate`")
            out = []
            for i in range(n_layers):
                pair = []
                for what in ("key_mean", "key_scale"):
                    name = f"layers.{i}.{what}"
                    if name not in names:
                        raise LarqlError(f"{path}: missing tensor {name}; rerun `larqlpy calibrate`")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != (n_kv_heads, head_dim) or t.dtype != torch.float32:
                        raise LarqlError(f"{path}: tensor {name} is {t.dtype} {list(t.shape)}, expected float32 "
                                         f"{[n_kv_heads, head_dim]}; rerun `larqlpy calibrate`")
                    pair.append(t)
                if not (torch.isfinite(pair[0]).all() and torch.isfinite(pair[1]).all() and (pair[1] > 0).all()):
                    raise LarqlError(f"{path}: layer {i} holds non-finite or non-positive values; rerun `larqlpy calibrate`")
                out.append(KeyCalibration.of(*pair))
            if any(n.startswith(f"layers.{n_layers}.") for n in names):
                raise LarqlError(f"{path}: calibrated for more than {n_layers} layers; rerun `larqlpy calibrate`")
    except LarqlError:
        raise
    except Exception as e:  # safetensors reports bad headers and truncation as its own error types
        raise LarqlError(f"{path}: not a readable calibration file ({str(e).splitlines()[0]})") from None
    return out

