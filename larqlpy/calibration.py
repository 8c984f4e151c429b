"""Key calibration: per layer and KV head, the keys' mean and a per-channel scale, measured once on a
fixed text and saved beside the model (weights/calibration_file.py); the codec engines' `calib=on`
and `calib=auto` (codec/v1's default). `ensure` measures it the first time a request's engine wants
one the model lacks (every entry point, through prepare.py), and caches it: beside the weights, or
under ~/.cache/larqlpy when their folder is read-only.

Why it helps: Gemma 3's keys share a large common component (0.4-0.86 of their length) and carry
energy in channels the queries hardly read, so a codec that quantizes raw keys spends its bits on
what scores never see. Quantizing y = (k - mean) * scale instead, with
scale_c = (E[q_c^2] / Var[k_c])^(1/4), balances the key's energy against the query's per channel:
that is the diagonal transform minimising E|y|^2 * E|q / scale|^2, i.e. the expected score error of
an isotropic quantizer of y (engines/stores/calibration.py has the algebra the codecs use). The
first SKIP positions (attention sinks, BOS) are left out of the statistics: they are outliers the
`sink` option keeps exact.

Measured on the 270M (docs/codec.md): KL at 4/4 bits 0.17 -> 0.04 with a calibration from
larqlpy/data/calibration.txt, a text unrelated to the long.txt it is measured on.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import torch

from larqlpy.engines import EngineSpec, build_provider, new_state
from larqlpy.engines.stores.base import QueryTap
from larqlpy.engines.stores.calibration import KeyCalibration
from larqlpy.errors import LarqlError
from larqlpy.decode.stream import prefill
from larqlpy.weights import calibration_file
from larqlpy.weights.calibration_file import FORMAT

TEXT = Path(__file__).resolve().parent / "data" / "calibration.txt"
SKIP = 4  # leading positions left out of the statistics (sinks)
EPS = 1e-3  # variance floor, relative to the mean channel's: a dead channel must not blow a scale up


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
    if len(ids) < SKIP + 64:
        raise LarqlError(f"calibration text too short: {len(ids)} tokens, need at least {SKIP + 64}")
    state = new_state(EngineSpec(), model.geometries(), torch.device(model.device))
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
            **({"files_digest": loaded.files_digest} if loaded.files_digest else {}),
            "mean_share": ",".join(f"{x:.4f}" for x in shares)}
    return cals, meta


_MEASURING = threading.Lock()  # a server's requests: one measures, the others wait and use it


def ensure(loaded, spec: EngineSpec) -> str | None:
    """Give `loaded` its key calibration when `spec`'s engine wants one and the model has none (or a
    stale or damaged one): measured once, saved, and from then on read at load. Returns a note
    saying what it did, or None."""
    model = loaded.model
    if model.key_calibration is not None or not build_provider(spec).wants_calibration():
        return None
    with _MEASURING:
        if model.key_calibration is not None:
            return None
        why = f" ({model.calibration_problem})" if model.calibration_problem else ""
        t0 = time.perf_counter()
        cals, meta = calibrate(loaded)
        path = calibration_file.save_somewhere(loaded.home, loaded.fingerprint, cals, meta)
        model.key_calibration, model.calibration_problem = cals, None
        note = (f"measured the key calibration{why} over {int(meta['tokens']):,} tokens in "
                f"{time.perf_counter() - t0:.1f} s; cached at {path}")
        return note
