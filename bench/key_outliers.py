"""Key-outlier techniques in a proxy (docs/codec.md, "Keys that carry outliers").

Per layer, the attention KL of the model's real queries (every 4th of the last 256 positions of
1,536 of long.txt) against keys through TurboQuant codes of BITS under each key transform: plain
codes, the calibration (fixed mean, query-aware scale), the mean before RoPE, 2 or 4 outlier
channels per head kept exact (on top of the calibration), and keys one bit wider. Statistics come
from positions 4..1280 of the same text; the sink row and the newest 16 rows are exact. Layers are
summed (TOTAL). Sliding windows are not applied: meant for global-attention models (Qwen2, Llama).

    python bench/key_outliers.py models/qwen2.5-coder-0.5b-instruct 3
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from larqlpy.model.decoder import prefill
from larqlpy.engines import EngineSpec, new_state
from larqlpy.engines.stores.base import QueryTap
from larqlpy.kernels.kvcodec.turboquant_torch import TorchCodec
from larqlpy.weights.loader import load

ROOT = Path(__file__).resolve().parent.parent
N, STATS_END, FIRST_QUERY, RECENT = 1536, 1280, 1280, 16


def scales(q2, var):
    var, q2 = var + 1e-3 * var.mean(), q2 + 1e-3 * q2.mean()
    s = (q2 / var) ** 0.25
    return s / s.log().mean().exp()


def turn(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def transforms(kh, qh, cos, sin):
    """name -> (y to code, scale, mean per row, exact channels or None, extra bits)."""
    cal = slice(4, STATS_END)
    q2 = (qh[:, cal] ** 2).mean((0, 1))
    mean = kh[cal].mean(0)
    s0 = scales(q2, ((kh[cal] - mean) ** 2).mean(0))
    fixed = mean[None].expand_as(kh)
    one = torch.ones_like(s0)
    out = {"plain": (kh, one, torch.zeros_like(kh), None, 0), "calib": ((kh - mean) * s0, s0, fixed, None, 0)}
    pre = turn(kh, cos, -sin)[cal].mean(0)
    turned = turn(pre[None].expand_as(kh), cos, sin)
    s1 = scales(q2, ((kh - turned)[cal] ** 2).mean(0))
    out["mean_before_rope"] = ((kh - turned) * s1, s1, turned, None, 0)
    energy = q2 * ((kh[cal] - mean) ** 2).mean(0)
    for n in (2, 4):
        out[f"calib+{n}_exact_channels"] = ((kh - mean) * s0, s0, fixed, energy.topk(n).indices, 0)
    out["calib_keys_one_bit_wider"] = ((kh - mean) * s0, s0, fixed, None, 1)
    return out


def attention_kl(kh, kq, qh, scale):
    total, count = 0.0, 0
    for t in range(FIRST_QUERY, N, 4):
        kk = kq[:t + 1].clone()
        kk[max(0, t - RECENT + 1):] = kh[max(0, t - RECENT + 1):t + 1]
        exact = ((qh[:, t] @ kh[:t + 1].T) * scale).log_softmax(-1)
        approx = ((qh[:, t] @ kk.T) * scale).log_softmax(-1)
        total += (exact.exp() * (exact - approx)).sum(-1).mean().item()
        count += 1
    return total / count


def main() -> None:
    path, bits = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    loaded = load(path, device="cpu", key_calibration=False)
    m = loaded.model
    ids = loaded.tokenizer.encode((ROOT / "larqlpy" / "data" / "long.txt").read_text())[:N]
    state = new_state(EngineSpec(), m.geometries(), torch.device("cpu"))
    qs = [[] for _ in state.layers]
    stores = state.layers
    state.layers = [QueryTap(s, lambda st, q, p, i=i: qs[i].append(q.clone())) for i, s in enumerate(stores)]
    with torch.inference_mode():
        prefill(m, state, ids, 256)
    d = stores[0].geometry.head_dim
    codecs = {b: TorchCodec(d, b, torch.device("cpu")) for b in (bits, bits + 1)}
    total: dict[str, float] = {}
    for layer, store in enumerate(stores):
        cos, sin = m.ropes[store.geometry.kind].tables(0, N, torch.float32)
        k = store.read(0, torch.float32)[0].float()
        q = torch.cat(qs[layer], 1).float()
        group = q.shape[0] // k.shape[0]
        row: dict[str, float] = {}
        for h in range(k.shape[0]):
            kh, qh = k[h], q[h * group:(h + 1) * group]
            for name, (y, s, mean, exact, extra) in transforms(kh, qh, cos, sin).items():
                y2 = y.clone()
                if exact is not None:
                    y2[:, exact] = 0
                n_, c_ = codecs[bits + extra].encode(y2)
                y2 = codecs[bits + extra].decode(n_, c_).reshape(y.shape)
                if exact is not None:
                    y2[:, exact] = y[:, exact]
                kq = y2 / s + mean
                kq[0] = kh[0]  # the sink
                row[name] = row.get(name, 0.0) + attention_kl(kh, kq, qh, m.cfg.attention_scale) / k.shape[0]
        print(layer, " ".join(f"{n}={x:.4f}" for n, x in row.items()), flush=True)
        for n, x in row.items():
            total[n] = total.get(n, 0.0) + x
    print("TOTAL", " ".join(f"{n}={x:.4f}" for n, x in total.items()))


if __name__ == "__main__":
    main()
