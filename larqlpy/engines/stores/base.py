"""The boundary between attention and the KV engines: a layer's store (a sequence's state, all its
layers' stores: state.py).

Attention hands a layer's store the new K/V rows and the queries of one block and gets the attention
output back (`LayerStore.attend`). The default `attend` appends, asks for the rows the block may read
and runs scaled-dot-product attention over them; an engine that can attend on its own representation
overrides it. Attention never asks which engine it talks to.

Logical positions (what RoPE and masks use) and physical storage are separate: a store knows the
logical range [base, end) it retains; where those rows live is its own business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.kernels.attention.decode import Span, attend_one, takes

QUERY_TILE = 256  # prefill queries attended per tile
NO_SINKS = np.zeros(0, np.float32)


@dataclass(frozen=True)
class AttentionParams:
    scale: float  # the queries' scale (query_pre_attn_scalar ** -0.5 on Gemma, head_dim ** -0.5 elsewhere)
    softcap: float | None = None  # Gemma 2: scores -> tanh(scores / cap) * cap before the softmax
    # GPT-OSS: a learned logit per query head (H,) float32 joined to every softmax: it takes probability
    # mass and has no value row. Every attention path takes it (the kernels as `sink_logits`).
    sinks: torch.Tensor | None = field(default=None, compare=False)

    @property
    def sink_logits(self) -> np.ndarray:
        """The sinks as the numba kernels take them: (H,) float32, or (0,) for none."""
        return NO_SINKS if self.sinks is None else self.sinks.numpy()

    def logits(self, scores: torch.Tensor) -> torch.Tensor:
        """Raw q.k scores -> what the softmax takes."""
        s = scores * self.scale
        return s if self.softcap is None else torch.tanh(s / self.softcap) * self.softcap


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
              window: int | None, p: AttentionParams) -> torch.Tensor:
    """Causal (optionally sliding) attention of a query block over rows [k_start, k_start + N).

    q: (H, T, D); k, v: (Hkv, N, D) -> (H, T, D). Query heads are grouped onto their KV head.
    """
    n_heads, t, d = q.shape
    n_kv, n = k.shape[0], k.shape[1]
    if t == 1 and k_start + n - 1 == q_start and takes(q):
        return attend_one(q, k, v, p.scale, p.softcap or 0.0, p.sink_logits)  # a step over exactly its rows
    plain = p.softcap is None and p.sinks is None
    if t > 1 and window is None and plain and q.device.type == "cpu" and k_start + n == q_start + t:
        return causal_parts(q, k, v, q_start - k_start, p.scale)
    group = n_heads // n_kv
    qg = q.reshape(1, n_kv, group * t, d)  # one matmul per KV head; 4-D lets torch pick its flash kernel
    mask = None
    if t > 1 or k_start + n - 1 != q_start:  # a single query over exactly its own rows needs no mask
        q_pos = torch.arange(q_start, q_start + t, device=q.device)
        k_pos = torch.arange(k_start, k_start + n, device=q.device)
        rel = q_pos[:, None] - k_pos[None, :]  # (T, N)
        allowed = rel >= 0
        if window is not None:
            allowed &= rel < window
        mask = torch.zeros(t, n, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
        mask = mask.repeat(group, 1)  # (G*T, N)
    if not plain:  # SDPA has no softcapping and no sinks: the scores in full
        s = p.logits(qg[0] @ k.transpose(1, 2))  # (Hkv, G*T, N)
        if mask is not None:
            s = s + mask
        if p.sinks is not None:  # one more column per query head, dropped after the softmax
            sink = p.sinks.to(s).reshape(n_kv, group, 1).expand(n_kv, group, t).reshape(n_kv, group * t, 1)
            s = torch.cat((s, sink), dim=-1)
        w = torch.softmax(s.float(), dim=-1)
        out = (w[..., :n] if p.sinks is not None else w).to(q.dtype) @ v
        return out.reshape(n_heads, t, d)
    out = F.scaled_dot_product_attention(qg, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=p.scale)
    return out.reshape(n_heads, t, d)


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, log-sum-exp, ...)


def causal_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """Causal attention of T queries over `past` rows every one of them sees, then their own T rows
    (k, v: (Hkv, past + T, D)), with no mask to build or read: the past through torch's CPU flash
    kernel as one product per KV head, the own rows as its causal square, the two joined by their
    log-sum-exps: cheaper than one masked call at long lengths (docs/codec.md has the figures)."""
    n_heads, t, d = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    own_k, own_v = (x[:, past:].repeat_interleave(group, 0)[None] for x in (k, v))
    own, own_lse = _FLASH(q[None], own_k, own_v, 0.0, True, scale=scale)[:2]
    if past == 0:
        return own[0]
    seen, seen_lse = _FLASH(q.reshape(1, n_kv, group * t, d), k[None, :, :past], v[None, :, :past], 0.0, False,
                            scale=scale)[:2]
    a, b = own_lse[0], seen_lse.reshape(n_heads, t)
    top = torch.maximum(a, b)
    wa, wb = torch.exp(a - top)[..., None], torch.exp(b - top)[..., None]
    out = (own[0].float() * wa + seen.reshape(n_heads, t, d).float() * wb) / (wa + wb)
    return out.to(q.dtype)


class LayerStore:
    """One layer's K/V rows for one sequence: the protocol every engine's store implements.

    Required: append, read, retained, resident_bytes. Optional, with defaults: release (keep
    everything), meta (nothing extra), persistence (export / restore: refused; trim: not possible).
    `attend` is shared."""

    def __init__(self, geometry: LayerGeometry, device: torch.device):
        self.geometry = geometry
        self.device = device
        self.end = 0  # logical position after the newest row

    # -- storage -------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Take rows for positions [end, end + T); k, v: (Hkv, T, D)."""
        raise NotImplementedError

    def read(self, start: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for positions [start, end) as (Hkv, N, D) tensors of `dtype`."""
        raise NotImplementedError

    def retained(self) -> tuple[int, int]:
        """Logical range (base, end) of the rows this store holds."""
        raise NotImplementedError

    def resident_bytes(self) -> int:
        """Bytes of the buffers this store holds now, counted from the allocations themselves."""
        raise NotImplementedError

    def reserve(self, positions: int) -> None:
        """Allocate now what the store will hold after `positions` positions (a batch reserves each
        sequence's KV on admission). Stores that manage their own memory do nothing."""

    def release(self) -> None:
        """After a block: drop rows no later query can read. Exact engines that keep everything do nothing."""

    def meta(self) -> dict:
        """What a saved state must match to be restored into this store, beyond the geometry."""
        return {}

    # -- persistence (state files save each layer as cells of positions) -----------------------
    def export(self) -> list[tuple[dict, dict]]:
        """(cell meta, field -> numpy array) for every retained cell, oldest first."""
        raise NotImplementedError(f"{type(self).__name__} cannot be saved")

    def restore(self, end: int, records: list[tuple[dict, dict]]) -> None:
        """Refill from `export()`'s records (already checksummed). Raises ValueError if inconsistent."""
        raise NotImplementedError(f"{type(self).__name__} cannot be restored")

    def can_trim(self, end: int) -> bool:
        """Whether the store can forget positions >= end and still serve a query at `end`."""
        return False

    def trim(self, end: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be trimmed")

    def keep_rollback(self, n: int) -> None:
        """From now on keep what a trim back `n` positions needs (speculative decoding rolls back the
        proposals it rejects), still retaining, after the trim, what a store that never took them
        would. Stores that keep every row need nothing."""

    forks = False  # whether `fork` can make this store a branch of another

    def borrows(self) -> bool:
        """Whether some of its rows are another state's (a branch's shared prompt): such a state is
        not kept past its request, its memory being partly another's."""
        return False

    def fork(self, other: "LayerStore") -> None:
        """Become a branch of `other`, a fresh store's twin holding a prompt (n choices of one
        prompt): as if this store had taken the same rows, sharing them where it can."""
        raise NotImplementedError(f"{type(self).__name__} cannot fork")

    # -- what attention calls: Block.attend, the one dispatch point ----------------------------
    def decode_rows(self, k: torch.Tensor, v: torch.Tensor) -> Span | tuple[Span, ...] | None:
        """A decode step (one query, float32 on the CPU) in two halves, so that many sequences' steps
        are attended in one kernel call: store the step's k, v (Hkv, 1, D) and say where the float32
        rows its query reads are (a `Span`, or spans read in order: here the rows `read` gives; a
        store whose buffers the kernel can read in place may instead reserve the step's row and let
        the kernel write it);
        the caller attends them, then calls `done()`. A store that attends in its own way (on
        codes) returns None and is called through `attend`."""
        self.append(k, v)
        keys, values = self.read(self.geometry.read_start(self.end - 1), torch.float32)
        return Span(keys, values, 0, keys.shape[1])

    def decode_steps(self, k: torch.Tensor, v: torch.Tensor) -> list | None:
        """Several successive decode steps of one sequence (k, v (Hkv, n, D), a speculative
        verification's rows) attended in one kernel call: their rows stored or reserved, and each
        step's `decode_rows` answer, in order; the caller attends them, then calls `done()`.
        None (the default): each step goes through `decode_rows` or `attend` on its own."""
        return None

    def family(self) -> object | None:
        """What a decode step of this store shares with others' (branches of one prompt at one
        position, reading its rows): steps of one family are attended in one call (`attend_family`).
        None: attended on its own."""
        return None

    def attend_family(self, stores: Sequence["LayerStore"], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      p: AttentionParams) -> torch.Tensor:
        """Decode steps of a family (`family`, this store first): q (H, B, D), k, v (Hkv, B, D), one
        step each -> (H, B, D). By default each attends alone."""
        return torch.cat([s.attend(*(x[:, i:i + 1].contiguous() for x in (q, k, v)), p) for i, s in enumerate(stores)],
                         dim=1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttentionParams) -> torch.Tensor:
        """Append this block's rows and attend its queries (H, T, D) over what they may read."""
        q_start = self.end
        self.append(k, v)
        out = self.attend_read(q, q_start, p)
        self.done()
        return out

    # -- layers that read this store's rows (shared K/V: engines/stores/shared.py) --------------
    readers = 0  # later layers attending over this store's rows: `done` leaves the release to the last

    def done(self) -> None:
        """A block attended: release, unless later layers still read this block's rows (the last of
        them releases, engines/stores/shared.py)."""
        if not self.readers:
            self.release()

    def attend_read(self, q: torch.Tensor, q_start: int, p: AttentionParams) -> torch.Tensor:
        """Queries (H, T, D) at positions from `q_start` over the rows they may read, appending
        nothing: this store's own block, or a later layer's that reads its rows. An engine that
        attends on its own representation may override it."""
        t = q.shape[1]
        start = self.geometry.read_start(q_start)
        keys, values = self.read(start, q.dtype)
        if start + keys.shape[1] > q_start + t:  # a later layer's step of a block this store took whole
            keys, values = keys[:, :q_start + t - start], values[:, :q_start + t - start]
        if t <= QUERY_TILE:
            out = attention(q, keys, values, q_start, start, self.geometry.window, p)
        else:  # tiles of queries read only the rows they can see: skips the causal / out-of-window work
            outs = []
            for a in range(0, t, QUERY_TILE):
                b = min(t, a + QUERY_TILE)
                lo, hi = self.geometry.read_start(q_start + a) - start, q_start + b - start
                outs.append(attention(q[:, a:b], keys[:, lo:hi], values[:, lo:hi], q_start + a, start + lo,
                                      self.geometry.window, p))
            out = torch.cat(outs, dim=1)
        return out


class QueryTap:
    """A layer store wrapped for a measurement: `on_query(store, q, p)` sees each block's queries
    before the store attends as usual; everything else is the store's."""

    def __init__(self, store: LayerStore, on_query):
        self.store, self.on_query = store, on_query

    def __getattr__(self, name):
        return getattr(self.store, name)

    def decode_rows(self, k, v):
        return None  # every query goes through attend, where the tap sees it

    def decode_steps(self, k, v):
        return None

    def family(self):
        return None  # attended alone, through attend

    def attend(self, q, k, v, p):
        self.on_query(self.store, q, p)
        return self.store.attend(q, k, v, p)
