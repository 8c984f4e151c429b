"""Key calibration: per layer and KV head, the keys' mean and a per-channel scale, measured once on a
fixed text and saved beside the model (weights/calibration_file.py); the codec engines' `calib=on`
and `calib=auto` (codec/v1's default). `ensure` measures it the first time a request's engine wants
one the model lacks (every entry point, through pipeline/prepare.py), and caches it: beside the weights, or
under ~/.cache/larqlpy when their folder is read-only.

Why it helps: Gemma 3's keys share a large common component (0.4-0.86 of their length) and carry
energy in channels the queries hardly read, so a codec that quantizes raw keys spends its bits on
what scores never see. Quantizing y = (k - m_p) * scale instead, with
scale_c = (E[q_c^2] / Var[k_c - m_p,c])^(1/4), balances the key's energy against the query's per
channel: that is the diagonal transform minimising E|y|^2 * E|q / scale|^2, i.e. the expected score
error of an isotropic quantizer of y (engines/stores/calibration.py has the algebra the codecs
use). A mean may be taken before RoPE and turned to each row's position (m_p = R(p) mean): a
common part of the keys (Qwen2's key bias) is fixed before RoPE and spins after it, so one mean
after RoPE leaves most of it in the rows. Per KV head the mean is fixed, turning, or both, as
measured attention on the calibration text prefers. The first SKIP positions (attention sinks, BOS) are left
out of the statistics: they are outliers the `sink` option keeps exact.

What it buys, per model and width: docs/codec.md ("Key calibration").
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
from larqlpy.kernels.kvcodec.rowcodec import TurboQuantCodec
from larqlpy.model.decoder import prefill
from larqlpy.weights import calibration_file
from larqlpy.weights.calibration_file import FORMAT
from larqlpy.weights.loader import LoadedModel

TEXT = Path(__file__).resolve().parent / "data" / "calibration.txt"
SKIP = 4  # leading positions left out of the statistics (sinks)
# the queries that choose each head's mean, the codes' width, and the newest rows left exact (as
# codec/v1's default recent tier reads them): the mean that matters is the one for the older rows
JUDGE_FROM, EVERY, JUDGE_BITS, JUDGE_RECENT = 128, 8, 3, 16
EPS = 1e-3  # variance floor, relative to the mean channel's: a dead channel must not blow a scale up


def _scales(q2: torch.Tensor, resid: torch.Tensor) -> torch.Tensor:
    """q2: (D,) mean squared query per channel; resid: (N, D) keys less their mean -> (D,) scale,
    geometric mean 1."""
    var = (resid.double() ** 2).mean(0)
    var = var + EPS * var.mean()
    q2 = q2.double() + EPS * q2.double().mean()
    s = (q2 / var) ** 0.25
    return s / s.log().mean().exp()


class _Queries:
    """Per KV head, the queries' squared channels summed (positions from SKIP on) and their count;
    and every EVERY-th position's queries from JUDGE_FROM on, which judge each head's mean."""

    def __init__(self, n_kv_heads: int, head_dim: int):
        self.q2 = torch.zeros(n_kv_heads, head_dim, dtype=torch.float64)
        self.count = 0
        self.kept: list[tuple[int, torch.Tensor]] = []  # (position, (H, D) queries)
        self.params = None

    def __call__(self, store, q, p):
        hkv = store.geometry.n_kv_heads
        qq = q[:, max(0, SKIP - store.end):].double() ** 2  # (H, T', D)
        self.q2 += qq.reshape(hkv, -1, qq.shape[-1]).sum(1).cpu()
        self.count += qq.shape[0] // hkv * qq.shape[1]
        self.params = p
        for j in range(q.shape[1]):
            if store.end + j >= JUDGE_FROM and (store.end + j) % EVERY == 0:
                self.kept.append((store.end + j, q[:, j].float().cpu()))


def _unturned(k: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Keys (Hkv, N, D) at positions SKIP.. with RoPE undone (rotate-half layout)."""
    ang = torch.arange(SKIP, SKIP + k.shape[1]).float()[:, None] * freq.cpu()[None, :]
    cos, sin = ang.cos().double(), ang.sin().double()
    half = k.shape[-1] // 2
    a, b = k[..., :half], k[..., half:]
    return torch.cat((a * cos + b * sin, b * cos - a * sin), dim=-1)


def _joint(k: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k (N, D) at positions SKIP.. -> (a, b), each (D,), the least-squares fit k_p = a + R(p) b."""
    n, d = k.shape
    half = d // 2
    ang = torch.arange(SKIP, SKIP + n).double()[:, None] * freq.cpu().double()[None, :]  # (N, half)
    cos, sin = ang.cos().T, ang.sin().T  # (half, N)
    one, zero = torch.ones_like(cos), torch.zeros_like(cos)
    # per pair: k1 = a1 + b1 cos - b2 sin, k2 = a2 + b2 cos + b1 sin; unknowns (a1, a2, b1, b2)
    rows1 = torch.stack((one, zero, cos, -sin), -1)
    rows2 = torch.stack((zero, one, sin, cos), -1)
    x = torch.cat((rows1, rows2), 1)  # (half, 2N, 4)
    y = torch.cat((k[:, :half].T, k[:, half:].T), 1)[..., None]  # (half, 2N, 1)
    sol = torch.linalg.lstsq(x, y).solution[..., 0]  # (half, 4)
    return torch.cat((sol[:, 0], sol[:, 1])), torch.cat((sol[:, 2], sol[:, 3]))


def _candidates(k: torch.Tensor, q2: torch.Tensor, freq: torch.Tensor) -> list[KeyCalibration]:
    """One head's calibrations to choose from, k (1, N, D) at positions SKIP..: the mean fixed,
    turning with RoPE, or both (the least-squares sum of the two)."""
    t = _unturned(k, freq).mean(1)
    zero = torch.zeros_like(t)
    a, b = _joint(k[0], freq)
    out = []
    for mean, turning in ((k.mean(1), None), (zero, t), (a[None], b[None])):
        m = KeyCalibration.of(mean, torch.ones_like(mean), turning, freq).means(SKIP, k.shape[1]).double()
        out.append(KeyCalibration.of(mean, _scales(q2, (k - m)[0])[None], turning, freq))
    return out


def _attention_kl(cal: KeyCalibration, k: torch.Tensor, queries: _Queries, head: int, geometry,
                  codec: TurboQuantCodec) -> float:
    """Mean KL(exact || keys through `codec` under `cal`) of the kept queries of one KV head;
    k (1, N, D) from position 0, the first SKIP rows exact (as sinks are)."""
    kq = k.clone()
    y = cal.apply(k[:, SKIP:], SKIP)
    kq[:, SKIP:] = cal.undo(codec.decode(codec.encode(y[0])).view_as(y), SKIP)
    total = 0.0
    for pos, q in queries.kept:
        group = q.shape[0] // geometry.n_kv_heads
        qh, lo = q[head * group:(head + 1) * group], geometry.read_start(pos)
        near = max(lo, pos + 1 - JUDGE_RECENT)  # codec/v1's recent tier: these rows are read nearly exact
        seen = torch.cat((kq[0, lo:near], k[0, near:pos + 1]))
        exact = torch.log_softmax(queries.params.logits(qh @ k[0, lo:pos + 1].T), -1)
        approx = torch.log_softmax(queries.params.logits(qh @ seen.T), -1)
        total += (exact.exp() * (exact - approx)).sum(-1).mean().item()
    return total / max(len(queries.kept), 1)


def _layer(store, queries: _Queries, freq: torch.Tensor) -> tuple[KeyCalibration, float]:
    """A layer's calibration: per head, the candidate (_candidates) that codes its keys with the
    smallest attention error on the calibration text; and the layer's share of key energy in the
    mean, |m_p|^2 / E|k|^2 (averaged over KV heads)."""
    k_all = store.read(0, torch.float32)[0].cpu().float()
    q2 = queries.q2 / max(queries.count, 1)
    codec = TurboQuantCodec(k_all.shape[-1], JUDGE_BITS, torch.device("cpu"))
    means, scales, turning = [], [], []
    for h in range(k_all.shape[0]):
        k = k_all[h:h + 1, SKIP:].double()
        best = min(_candidates(k, q2[h], freq),
                   key=lambda c: _attention_kl(c, k_all[h:h + 1], queries, h, store.geometry, codec))
        means.append(best.mean[0])
        scales.append(best.scale[0])
        turning.append(best.turning[0] if best.turning is not None else torch.zeros_like(best.mean[0]))
    cal = KeyCalibration.of(torch.stack(means), torch.stack(scales), torch.stack(turning), freq)
    k = k_all[:, SKIP:].double()
    m = cal.means(SKIP, k.shape[1]).double().expand_as(k)
    return cal, (m.pow(2).sum(-1) / k.pow(2).sum(-1)).mean().item()


@torch.inference_mode()
def measure(model, ids: list[int]) -> tuple[list[KeyCalibration], list[float]]:
    """Run `ids` through the model (exact rows) and measure every layer's calibration; also each
    layer's share of key energy in the mean, |m_p|^2 / E|k|^2 (averaged over KV heads)."""
    if model.cfg.mla is not None:  # its keys are latent rows, RoPE on their tail only: not what this models
        raise LarqlError(f"{model.cfg.model_type}: no key calibration for multi-head latent attention's rows "
                         "(use calib=off)")
    if len(ids) < JUDGE_FROM + 64:
        raise LarqlError(f"calibration text too short: {len(ids)} tokens, need at least {JUDGE_FROM + 64}")
    state = new_state(EngineSpec(), model.geometries(), torch.device(model.device))
    queries = [_Queries(s.geometry.n_kv_heads, s.geometry.head_dim) for s in state.layers]
    stores = state.layers
    state.layers = [QueryTap(s, sq) for s, sq in zip(stores, queries)]
    prefill(model, state, ids, 1024)
    out, shares = [], []
    for store, sq in zip(stores, queries):
        cal, share = _layer(store, sq, model.rope_freq(store.geometry.index).cpu())
        out.append(cal)
        shares.append(share)
    return out, shares


def calibrate(loaded: LoadedModel, text: str | None = None) -> tuple[list[KeyCalibration], dict]:
    """Measure on `text` (default: the packaged calibration text); returns (layers, metadata)."""
    text = TEXT.read_text() if text is None else text
    ids = loaded.tokenizer.encode(text)
    if loaded.config.learned_positions:  # GPT-2: no position past its table's
        ids = ids[:loaded.config.max_position_embeddings]
    cals, shares = measure(loaded.model, ids)
    meta = {"format": FORMAT, "tokens": str(len(ids)), "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "model_fingerprint": loaded.fingerprint, "weights": loaded.weights,
            **({"files_digest": loaded.files_digest} if loaded.files_digest else {}),
            "mean_share": ",".join(f"{x:.4f}" for x in shares)}
    return cals, meta


_MEASURING = threading.Lock()  # a server's requests: one measures, the others wait and use it


def ensure(loaded: LoadedModel, spec: EngineSpec) -> str | None:
    """Give `loaded` its key calibration when `spec`'s engine wants one and the model has none (or a
    stale or damaged one): measured once, saved, and from then on read at load. Returns a note
    saying what it did, or None."""
    model, provider = loaded.model, build_provider(spec)
    if model.key_calibration is not None or not provider.wants_calibration():
        return None
    if model.cfg.mla is not None and provider.options.get("calib") != "on":
        return None  # calib=auto: MLA's latent rows go uncalibrated (`measure` refuses calib=on)
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
