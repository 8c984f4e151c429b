"""The one dispatch point between attention and the KV engines: a layer's block of rows, for every
sequence in the batch, to the stores (engines/stores/base.py's protocol), gathered where stores can
be attended together -- decode steps over float rows in one kernel call (`LayerStore.decode_rows`),
branches of one prompt through their family's one call (`LayerStore.attend_family`) -- and never by
asking which engine a store belongs to."""

from __future__ import annotations

from typing import Sequence

import torch

from larqlpy.engines.stores.base import AttentionParams, LayerStore
from larqlpy.kernels.attention.decode import attend_rows, takes


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stores: Sequence[LayerStore], sizes: list[int],
                 p: AttentionParams, stepped: Sequence[bool] = ()) -> torch.Tensor:
    """One layer of one block: each sequence's rows (q (H, T, D), k, v (Hkv, T, D), `sizes` rows
    each, laid end to end) to its own store -- the model's one call into the engines per layer.
    Decode steps whose store says where its rows are (`decode_rows`) are attended together in one
    kernel call, and released; those of one family (`family`: branches of one prompt) through the
    family's one call (`attend_family`); every other block, and every store that attends on its own
    terms, through `store.attend`. A `stepped` sequence's rows are attended one after another, each as a
    decode step of its own (speculative decoding verifies proposals with the numbers plain decode
    would give them). k, v None: a layer that reads an earlier layer's rows (shared K/V), each
    store attending over its source's (`_reading`)."""
    if k is None:
        return _reading(q, stores, sizes, p, stepped)
    if any(stepped):
        return _stepwise(q, k, v, stores, sizes, p, stepped)
    decode = takes(q)
    one = len(stores) == 1
    ks, vs = ((k,), (v,)) if one else (k.split(sizes, dim=1), v.split(sizes, dim=1))  # views, one call each
    outs, steps, lo = [], [], 0  # steps: (index in outs, row in q, store, its rows)
    families: dict = {}  # family -> [(index in outs, row in q, store)]
    for store, n, kn, vn in zip(stores, sizes, ks, vs):
        rows = store.decode_rows(kn, vn) if decode and n == 1 else None
        family = store.family() if decode and n == 1 and rows is None and not one else None
        if family is not None:
            families.setdefault(family, []).append((len(outs), lo, store))
            outs.append(None)
        elif rows is None:
            qn = q if one else q[:, lo:lo + n].contiguous()
            outs.append(store.attend(qn, kn if one else kn.contiguous(), vn if one else vn.contiguous(), p))
        else:
            steps.append((len(outs), lo, store, rows))
            outs.append(None)
        lo += n
    if len(families) == 1 and len(outs) == len(next(iter(families.values()))):  # n choices of one prompt
        return _attend_family(next(iter(families.values())), q, k, v, p)
    for members in families.values():
        got = _attend_family(members, q, k, v, p)
        for j, m in enumerate(members):
            outs[m[0]] = got[:, j:j + 1]
    if steps:
        qs = q if len(steps) == len(outs) else q[:, [s[1] for s in steps]]  # (H, steps, D)
        got = attend_rows(qs.transpose(0, 1), [s[3] for s in steps], p.scale, p.softcap or 0.0,
                          (k, v), [s[1] for s in steps], p.sink_logits).transpose(0, 1)
        for _, _, store, _ in steps:
            store.done()
        if len(steps) == len(outs):
            return got
        for j, (at, _, _, _) in enumerate(steps):
            outs[at] = got[:, j:j + 1]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _reading(q: torch.Tensor, stores: Sequence[LayerStore], sizes: list[int], p: AttentionParams,
             stepped: Sequence[bool]) -> torch.Tensor:
    """A layer storing nothing: each sequence's queries over its store's source's rows, a `stepped`
    sequence's one step at a time (engines/stores/shared.py)."""
    outs, lo = [], 0
    for i, (store, n) in enumerate(zip(stores, sizes)):
        steps = [(r, r + 1) for r in range(lo, lo + n)] if stepped and stepped[i] else [(lo, lo + n)]
        outs += [store.attend(q[:, a:b].contiguous(), None, None, p) for a, b in steps]
        lo += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _attend_family(members: list, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   p: AttentionParams) -> torch.Tensor:
    """A family's steps (members: (index in outs, row in q, store)) in its one call -> (H, B, D)."""
    rows = [m[1] for m in members]
    if rows == list(range(rows[0], rows[0] + len(rows))):  # one run of columns: views, no gather
        cols = slice(rows[0], rows[0] + len(rows))
        qf, kf, vf = q[:, cols], k[:, cols], v[:, cols]
    else:
        at = torch.tensor(rows)
        qf, kf, vf = (x.index_select(1, at) for x in (q, k, v))
    return members[0][2].attend_family([m[2] for m in members], qf, kf, vf, p)


def _stepwise(q, k, v, stores, sizes, p, stepped) -> torch.Tensor:
    """attend_block with the `stepped` sequences' rows taken as successive decode steps, after the
    others' block (each sequence's output in its own place): those whose store says where every
    step reads (`decode_steps`) in one kernel call together, the others one step at a time."""
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    plain = [i for i, s in enumerate(stepped) if not s]
    outs: list = [None] * len(sizes)
    if plain:
        cols = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in plain])
        got = attend_block(q[:, cols], k[:, cols], v[:, cols], [stores[i] for i in plain],
                           [sizes[i] for i in plain], p)
        at = 0
        for i in plain:
            outs[i], at = got[:, at:at + sizes[i]], at + sizes[i]
    together, spans = [], []  # sequences attended in the one call, and every step's span
    kernel = takes(q)
    for i in (i for i, s in enumerate(stepped) if s):
        got = stores[i].decode_steps(k[:, bounds[i]:bounds[i + 1]], v[:, bounds[i]:bounds[i + 1]]) \
            if kernel else None
        if got is None:
            outs[i] = torch.cat([attend_block(q[:, r:r + 1].contiguous(), k[:, r:r + 1].contiguous(),
                                              v[:, r:r + 1].contiguous(), [stores[i]], [1], p)
                                 for r in range(bounds[i], bounds[i + 1])], dim=1)
        else:
            together.append(i)
            spans += got
    if together:
        cols = [r for i in together for r in range(bounds[i], bounds[i + 1])]
        qs = q if len(cols) == q.shape[1] else q[:, cols]
        got = attend_rows(qs.transpose(0, 1), spans, p.scale, p.softcap or 0.0, (k, v), cols,
                          p.sink_logits).transpose(0, 1)
        at = 0
        for i in together:
            stores[i].done()
            outs[i], at = got[:, at:at + sizes[i]], at + sizes[i]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
