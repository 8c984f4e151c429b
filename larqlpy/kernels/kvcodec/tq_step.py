"""A codec layer's decode step written in one call: the step's keys calibrated, then its K and V
rows encoded straight into a claimed row of each code set (the main codes and the recent tier),
for one sequence's KV heads or for a family's branches at one position (branch after branch).
The bits are those of calibration.KeyCalibration.apply and turboquant.encode (tested)."""

from __future__ import annotations

import numpy as np
from numba import njit

from larqlpy.kernels import jitcache
from larqlpy.kernels.jitcache import FASTMATH
from larqlpy.kernels.kvcodec import turboquant
from larqlpy.kernels.kvcodec.turboquant import encode_row


@njit(cache=True, error_model="numpy")
def calibrate_rows(k, mean, scale, turning, cs, out):  # pragma: no cover - jitted
    """A decode step's keys k (Hkv, B, D) (B branches at one position, or one sequence) -> out:
    (k - m_p) * scale, op for op what calibration.KeyCalibration.apply computes in torch (so a
    step's codes are a block's; no fastmath). cs: the [cos | sin] row of the step's position (1, D),
    turning (Hkv, D), both empty when no head turns."""
    hkv, nb, d = k.shape
    half = d // 2
    for h in range(hkv):
        for b in range(nb):
            for i in range(d):
                m = mean[h, i]
                if turning.shape[0]:
                    c, s_ = cs[0, i % half], cs[0, half + i % half]
                    a, t = turning[h, i % half], turning[h, half + i % half]
                    m = (a * c - t * s_) + m if i < half else (t * c + a * s_) + m
                out[h, b, i] = (k[h, b, i] - m) * scale[h, i]


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def append_step(k, v, cal, sgn, sets, slots):  # pragma: no cover - jitted
    """K and V rows (Hkv, B, D) f32 of one position (B branches of one prompt, or one sequence) ->
    row slots[i] of each code set sets[i]: (K boundaries, K bits, V boundaries, V bits, K norms
    (B * Hkv, cap), K codes (B * Hkv, cap, bytes), V norms, V codes), branch b's KV head h at
    b * Hkv + h. Keys are calibrated first (`calibrate_rows`, called: its own exact arithmetic) when
    cal (its mean, scale, turning and [cos | sin] row) has a mean."""
    hkv, nb, d = k.shape
    keys = k
    if cal[0].shape[0]:
        keys = np.empty_like(k)
        calibrate_rows(k, cal[0], cal[1], cal[2], cal[3], keys)
    x, idx = np.empty(d, np.float32), np.empty(d, np.int32)
    for i in range(len(sets)):
        kb, kbits, vb, vbits, kn, kc, vn, vc = sets[i]
        slot = slots[i]
        for b in range(nb):
            for h in range(hkv):
                r = b * hkv + h
                kn[r, slot] = encode_row(keys[h, b], sgn, kb, kbits, x, idx, kc[r, slot])
                vn[r, slot] = encode_row(v[h, b], sgn, vb, vbits, x, idx, vc[r, slot])

jitcache.tie(globals(), turboquant, jitcache)
