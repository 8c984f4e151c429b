"""A mixture of experts in place of a block's MLP (Mixtral, Qwen3-MoE; model/families/), as
transformers' sparse MoE blocks compute it: a router (a linear) scores every expert, a softmax in
float32 over the scores, torch.topk picks each row's top k (ties broken as transformers' own
torch.topk breaks them), the k weights renormalized to sum to one where the family says
(`norm_topk_prob`), and each row's output is the weighted sum of its experts' SiLU-gated MLPs.

Every expert matrix is an ordinary weight (float, packed int8 / int4, a GGUF's codes) multiplied
through kernels/weights/matvec.py. One row (a decode step) runs only its k experts. Several rows (a
prefill chunk, a batch of decode steps) are grouped by expert: each chosen expert's rows gathered,
one product per expert matrix for all of them, the weighted results added back into their rows; each
expert's weights are read once per step however many rows chose it. Either way a row's experts are
added in increasing expert order, as transformers adds them, so a row comes out of a group as it
comes out alone wherever a product's numbers do not depend on the rows beside it (the packed
integer kernels; float32's few-row loop against its GEMM differs in rounding)."""

from __future__ import annotations

import numpy as np
import torch

from larqlpy.kernels.weights import qmany
from larqlpy.kernels.weights.matvec import gated, gemm_few_f32, linear, stacked
from larqlpy.kernels.weights.qweight import PackedPart
from larqlpy.model.config import MoeConfig
from larqlpy.model.routing import choose


class Experts:
    """A sparse layer's router and experts, called on a block's normed rows h (T, E) -> (T, E)."""

    def __init__(self, router, experts: list[tuple], moe: MoeConfig, activation: str, router_bias=None,
                 biases: list[tuple] | None = None, shared: tuple | None = None,
                 score_bias: torch.Tensor | None = None):
        self.router, self.experts = router, experts  # experts: (gate, up, down) matrices per expert
        self.top_k, self.norm, self.activation = moe.top_k, moe.norm_topk_prob, activation
        # GPT-OSS: the router's bias, softmax over the chosen k, each expert's (gate|up, down) biases
        # and the clamped SwiGLU (model/config.py, MoeConfig)
        self.router_bias, self.after_topk, self.biases = router_bias, moe.softmax_after_topk, biases
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha
        # DeepSeek: its way of choosing (model/routing.py), the choice-only bias, the shared experts' MLP
        self.moe, self.score_bias, self.shared = (moe if moe.topk_method != "topk" else None), score_bias, shared
        self.fused = self._fusable()

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's k weights (float32) and experts (T, k), in torch.topk's order. On the CPU in
        float32 the router's scores come from one loop whatever the rows (not torch's GEMM beyond a
        few): a row's experts and weights do not depend on the rows beside it."""
        router = self.router
        invariant = h.is_cpu and h.dtype is torch.float32 and isinstance(router, torch.Tensor) and \
            router.dtype is torch.float32
        scores = (gemm_few_f32(h, router, "numba") if invariant else linear(h, router)).float()
        if self.moe is not None:
            return choose(scores, self.moe, self.score_bias)
        if self.router_bias is not None:
            scores = scores + self.router_bias
        if self.after_topk:  # the top k of the raw scores, their softmax the weights
            top, chosen = torch.topk(scores, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        weights, chosen = torch.topk(torch.softmax(scores, dim=-1), self.top_k, dim=-1)
        if self.norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.experts[e]
        if self.biases is None and self.limit is None:
            return linear(gated(stacked(x, gate, up), self.activation), down)
        y = stacked(x, gate, up)
        if self.biases is not None:
            y = y + self.biases[e][0]
        act = clamped_swiglu(y, self.limit, self.alpha) if self.limit is not None else gated(y, self.activation)
        y = linear(act, down)
        return y if self.biases is None else y + self.biases[e][1]

    def _fusable(self) -> tuple | None:
        """Each expert's gate|up and down (and the shared experts' gate|up, where it is of their kind)
        as packed matrices a decode step runs in two calls (kernels/weights/qmany.py); None where
        they are not (float weights, biases, GPT-OSS's clamp, mixed kinds): one call per matrix."""
        if self.biases is not None or self.limit is not None:
            return None
        gate_ups, downs = [_whole(g, u) for g, u, _ in self.experts], [d for _, _, d in self.experts]
        if not (qmany.one_kind(gate_ups) and qmany.one_kind(downs)):
            return None
        shared = None if self.shared is None else _whole(*self.shared[:2])
        return gate_ups, downs, shared if qmany.one_kind([gate_ups[0], shared]) else None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 1 and self.fused is not None and h.dtype is torch.float32:
            return self.step(h, *self.route(h))
        routed = self.routed(h)
        if self.shared is None:
            return routed
        gate, up, down = self.shared  # added after the routed sum, as transformers adds them
        return routed + linear(gated(stacked(h, gate, up), self.activation), down)

    def routed(self, h: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(h)
        if h.shape[0] == 1:  # a decode step: its k experts, added in increasing expert order
            out, ids = None, chosen[0].tolist()
            for pos in sorted(range(self.top_k), key=ids.__getitem__):
                y = (self.expert(ids[pos], h) * weights[0, pos]).to(h.dtype)
                out = y if out is None else out + y
            return out
        return self.grouped(h, weights, chosen)

    def step(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """A decode step's k experts (and the shared experts) in two kernel calls: every gate|up, then
        every down, each expert's numbers those its own products give; their weighted sum in
        increasing expert order, the shared experts' output added last, as `routed` and `__call__` add."""
        gate_ups, downs, shared_gu = self.fused
        ids = chosen[0].tolist()
        order = sorted(range(self.top_k), key=ids.__getitem__)
        mats = [gate_ups[ids[p]] for p in order] + ([shared_gu] if shared_gu is not None else [])
        y = qmany.gemm_each(mats, h.contiguous().numpy(), [0] * len(mats))
        k, width = self.top_k, mats[0].shape[0]
        act = gated(torch.from_numpy(np.ascontiguousarray(y[:k, :width])), self.activation)
        d = qmany.gemm_each([downs[ids[p]] for p in order], act.numpy(), range(k))[:, :downs[0].shape[0]]
        shared = None
        if self.shared is not None:
            gate, up, down = self.shared
            gu = torch.from_numpy(np.ascontiguousarray(y[k:, :shared_gu.shape[0]])) if shared_gu is not None \
                else stacked(h, gate, up)
            shared = linear(gated(gu, self.activation), down)[0].numpy()
        w = weights[0].float().numpy()[order]  # numpy's gather: torch's indexing by a list took ~100 us
        return torch.from_numpy(qmany.weighted_sum(d, w, shared)).view(1, -1)

    def grouped(self, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert: each expert's rows gathered (in row order) and run as one block,
        its weighted output added into them; experts taken in increasing order."""
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs by expert, rows ascending within one
        rows, w = order // self.top_k, weights.reshape(-1)[order]
        out = torch.zeros_like(h)
        at = 0
        for e, n in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if n:
                idx = rows[at:at + n]
                out.index_add_(0, idx, (self.expert(e, h.index_select(0, idx)) * w[at:at + n, None]).to(h.dtype))
                at += n
        return out


def _whole(gate, up):
    """The one packed matrix gate and up are the two halves of, in order; None if they are not."""
    if isinstance(gate, PackedPart) and isinstance(up, PackedPart) and gate.whole is up.whole and gate.lo == 0 and \
            gate.hi == up.lo and up.hi == gate.whole.shape[0]:
        return gate.whole
    return None


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """GPT-OSS's gate on a stacked gate|up product (T, 2I) -> (T, I), as transformers' GptOssExperts:
    the gate clamped above at limit, up to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    n = gate_up.shape[1] // 2
    gate, up = gate_up[:, :n].clamp(max=limit), gate_up[:, n:].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def experts_of(block, moe: MoeConfig, activation: str) -> Experts:
    """A block's router and experts (its `router`, `experts[j].gate_proj` ..., their biases and the
    shared experts where the family has them) as one Experts."""
    biases = [(torch.cat((e.gate_proj_bias, e.up_proj_bias)), e.down_proj_bias) for e in block.experts] \
        if moe.expert_bias else None
    s = block.shared if moe.shared_intermediate else None
    return Experts(block.router, [(e.gate_proj, e.up_proj, e.down_proj) for e in block.experts], moe, activation,
                   block.router_bias.float() if moe.router_bias else None, biases,
                   None if s is None else (s.gate_proj, s.up_proj, s.down_proj), getattr(block, "score_bias", None))
