"""The boundary between attention and the KV engines.

Attention hands a layer's store the new K/V rows and the queries of one block and gets the attention
output back (`LayerStore.attend`). The default `attend` appends, asks for the rows the block may read
and runs scaled-dot-product attention over them; an engine that can attend on its own representation
overrides it. Attention never asks which engine it talks to.

Logical positions (what RoPE and masks use) and physical storage are separate: a store knows the
logical range [base, end) it retains; where those rows live is its own business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Sequence

import torch
import torch.nn.functional as F

from larqlpy.kernels.attention import attend_one

if TYPE_CHECKING:
    from larqlpy.engines.spec import OptionSpec


@dataclass(frozen=True)
class LayerGeometry:
    index: int
    window: int | None  # rows a query sees, itself included; None on global layers
    n_kv_heads: int
    head_dim: int
    # the model's measured key statistics for this layer (larqlpy.calibration), for codecs that use them
    key_calibration: object = field(default=None, compare=False, repr=False)

    @property
    def kind(self) -> str:
        return "global" if self.window is None else "sliding"

    @property
    def row_bytes_f32(self) -> int:
        """Bytes of one position's K and V rows in f32."""
        return 2 * self.n_kv_heads * self.head_dim * 4

    def read_start(self, q_start: int) -> int:
        """First logical position a block of queries starting at `q_start` may read."""
        return 0 if self.window is None else max(0, q_start - self.window + 1)


QUERY_TILE = 256  # prefill queries attended per tile
CELL_POSITIONS = 64  # saved states cut each layer's rows into cells of this many positions


@dataclass(frozen=True)
class AttentionParams:
    scale: float  # query_pre_attn_scalar ** -0.5


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
              window: int | None, p: AttentionParams) -> torch.Tensor:
    """Causal (optionally sliding) attention of a query block over rows [k_start, k_start + N).

    q: (H, T, D); k, v: (Hkv, N, D) -> (H, T, D). Query heads are grouped onto their KV head.
    """
    n_heads, t, d = q.shape
    n_kv, n = k.shape[0], k.shape[1]
    if t == 1 and k_start + n - 1 == q_start and q.device.type == "cpu" and q.dtype == torch.float32:
        return attend_one(q, k, v, p.scale)  # a decode step over exactly its visible rows: no mask
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
    out = F.scaled_dot_product_attention(qg, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=p.scale)
    return out.reshape(n_heads, t, d)


class LayerStore:
    """One layer's K/V rows for one sequence. Subclasses implement storage; `attend` is shared."""

    def __init__(self, geometry: LayerGeometry, device: torch.device):
        self.geometry = geometry
        self.device = device
        self.end = 0  # logical position after the newest row

    # -- storage, per engine -------------------------------------------------------------------
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

    def release(self) -> None:
        """Drop rows no later query can read. Exact engines that keep everything do nothing."""

    def meta(self) -> dict:
        """What a saved state must match to be restored into this store, beyond the geometry."""
        return {}

    # -- persistence: saved as cells of CELL_POSITIONS positions -------------------------------
    def row_sets(self) -> dict:
        """Named `Rows` this store keeps, with the cell state and precision they are saved as."""
        raise NotImplementedError

    def export(self) -> list[tuple[dict, dict]]:
        """(cell meta, field -> numpy array) for every retained cell, oldest first."""
        out = []
        for name, (rows, state, precision) in self.row_sets().items():
            for lo in range(rows.base - rows.base % CELL_POSITIONS, rows.end, CELL_POSITIONS):
                a, b = max(lo, rows.base), min(lo + CELL_POSITIONS, rows.end)
                if a < b:
                    vals = rows.read(a, b)
                    out.append(({"set": name, "start": a, "n": b - a, "state": state, "precision": precision},
                                {k: v.contiguous().cpu().numpy() for k, v in vals.items()}))
        return out

    def set_end(self, name: str, end: int) -> int:
        """Where row set `name` ends when the layer ends at `end` (a set of the first N positions ends early)."""
        return end

    def restore(self, end: int, records: list[tuple[dict, dict]]) -> None:
        """Refill from `export()`'s records (already checksummed). Raises ValueError if inconsistent."""
        sets = self.row_sets()
        layer_end = end
        for name, (rows, state, precision) in sets.items():
            end = self.set_end(name, layer_end)
            mine = sorted((r for r in records if r[0]["set"] == name), key=lambda r: r[0]["start"])
            pos = mine[0][0]["start"] if mine else (end if rows.keep is not None else 0)
            base = pos
            for meta, arrays in mine:
                if meta["start"] != pos or meta["state"] != state or meta["precision"] != precision:
                    raise ValueError(f"layer {self.geometry.index}: cell at {meta['start']} does not fit "
                                     f"({meta['state']} {meta['precision']}, expected {state} {precision} at {pos})")
                if set(arrays) != set(rows.fields):
                    raise ValueError(f"layer {self.geometry.index}: cell at {pos} has fields {sorted(arrays)}")
                pos += meta["n"]
            if pos != end or (rows.keep is None and base != 0) or (rows.keep is not None and end - base > rows.keep):
                raise ValueError(f"layer {self.geometry.index}: saved rows [{base}, {pos}) do not fit end {end}")
            rows.restore(base, end, [(m["start"], {k: torch.from_numpy(a.copy()) for k, a in arr.items()})
                                     for m, arr in mine])
        self.end = layer_end

    def can_trim(self, end: int) -> bool:
        """Whether the store can forget positions >= end and still serve a query at `end`."""
        main = self.row_sets()["main"][0]
        return end <= self.end and main.base <= self.geometry.read_start(end)

    def trim(self, end: int) -> None:
        for name, (rows, _, _) in self.row_sets().items():
            rows.trim(max(rows.base, end) if rows.keep is not None else self.set_end(name, end))
        self.end = end

    # -- the one dispatch point attention calls ------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: AttentionParams) -> torch.Tensor:
        """Append this block's rows and attend its queries (H, T, D) over what they may read."""
        q_start, t = self.end, q.shape[1]
        self.append(k, v)
        start = self.geometry.read_start(q_start)
        keys, values = self.read(start, q.dtype)
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
        self.release()
        return out


class QueryTap:
    """A layer store wrapped for a measurement: `on_query(store, q, p)` sees each block's queries
    before the store attends as usual; everything else is the store's."""

    def __init__(self, store: LayerStore, on_query):
        self.store, self.on_query = store, on_query

    def __getattr__(self, name):
        return getattr(self.store, name)

    def attend(self, q, k, v, p):
        self.on_query(self.store, q, p)
        return self.store.attend(q, k, v, p)


class EngineState:
    """All layers' stores for one sequence, plus the logical position counter."""

    def __init__(self, identity: str, options: dict, stores: Sequence[LayerStore], extras: Sequence = ()):
        self.identity = identity
        self.options = dict(options)
        self.layers = list(stores)
        self.extras = list(extras)  # shared buffers (e.g. a codec's decode scratch), each with nbytes()
        self.max_chunk: int | None = None  # an engine that must act between blocks caps the block size
        self.last_logits: torch.Tensor | None = None  # logits of the newest processed position

    @property
    def position(self) -> int:
        return self.layers[0].end if self.layers else 0

    def resident_bytes(self) -> int:
        return sum(s.resident_bytes() for s in self.layers) + sum(e.nbytes() for e in self.extras)

    def resident_by_kind(self) -> dict[str, int]:
        """Rows' bytes per layer kind, plus shared buffers under "scratch" when there are any."""
        out: dict[str, int] = {}
        for s in self.layers:
            out[s.geometry.kind] = out.get(s.geometry.kind, 0) + s.resident_bytes()
        if self.extras:
            out["scratch"] = sum(e.nbytes() for e in self.extras)
        return out

    def retained_rows(self) -> int:
        return sum(end - base for base, end in (s.retained() for s in self.layers))

    def report(self) -> dict:
        """Engine-specific figures (e.g. cell transitions) for --stats and --json."""
        out: dict = {}
        for e in self.extras:
            if hasattr(e, "report"):
                out.update(e.report())
        return out


class Provider:
    """A continuation provider: an identity string, declared options, and a store per layer."""

    identity: ClassVar[str]
    summary: ClassVar[str]
    exact: ClassVar[bool] = True

    def __init__(self, options: dict):
        self.options = dict(options)

    @classmethod
    def option_specs(cls) -> tuple["OptionSpec", ...]:
        """The options this provider declares; anything else is refused."""
        return ()

    @classmethod
    def residency_variants(cls) -> tuple[tuple[tuple[str, object], ...], ...]:
        """Option sets `larqlpy residency` shows when no engine is named."""
        return ((),)

    @classmethod
    def hint(cls) -> str:
        """A one-line suggestion added to option refusals (e.g. a recommended configuration)."""
        return ""

    @classmethod
    def check_options(cls, options: dict, where: str) -> None:
        """Cross-option checks after each value parsed; raise LarqlError to refuse."""

    def check_geometry(self, geometries: Sequence[LayerGeometry]) -> None:
        """Refuse a model this provider cannot serve, before any row is stored."""

    def make_store(self, geometry: LayerGeometry, device: torch.device) -> LayerStore:
        raise NotImplementedError

    def new_state(self, geometries: Sequence[LayerGeometry], device: torch.device) -> EngineState:
        self.check_geometry(geometries)
        return EngineState(self.identity, self.options, [self.make_store(g, device) for g in geometries])

    def retained_rows(self, geometry: LayerGeometry, positions: int) -> int:
        """Rows the store holds after `positions` positions: the accounting residency reports."""
        raise NotImplementedError

    def row_bytes(self, geometry: LayerGeometry) -> int:
        return geometry.row_bytes_f32

    def layer_bytes(self, geometry: LayerGeometry, positions: int) -> int:
        """Bytes one layer's store holds after `positions` positions (what residency reports)."""
        return self.retained_rows(geometry, positions) * self.row_bytes(geometry)
