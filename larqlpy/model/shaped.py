"""A decoder block whose layer has a shape of its own (`ModelConfig.layer_shapes`: Gemma 4), as
transformers' Gemma4TextDecoderLayer computes it (model/families/gemma4.py lists the options):

    h = norm(x); q = rope(norm(h Wq)); k = rope(norm(h Wk)); v = norm'(h Wv or h Wk)  (norm': no gain)
    a = attend_block(q, k, v)          k, v None on a layer that reads an earlier layer's rows:
                                       its stores attend over that layer's (engines/stores/shared.py)
    x = x + norm(a Wo)
    m = down(gelu(gate(norm(x))) * up(norm(x)))
    [experts beside the MLP: m = norm(m) + norm(experts(norm(x)), routed on x)]
    x = x + norm(m)
    [per-layer inputs: x = x + norm(proj(gelu(x Wg) * p_i))]
    x = x * layer_scalar

Queries are not scaled (scale 1: the q and k norms fix their size), and every norm's gain is stored
as itself. Also the per-layer inputs every block takes its slice of (`per_layer_inputs`)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn as nn

from larqlpy.engines.stores.base import AttentionParams
from larqlpy.engines.stores.dispatch import attend_block
from larqlpy.kernels.weights.matvec import embedding, gated, gemm_few_f32, linear, linears, norm_rope, rms_norm, \
    stacked
from larqlpy.model.config import ModelConfig
from larqlpy.model.moe import Experts
from larqlpy.model.shaped_tensors import block_weights


def apart(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T, each row's numbers those it gets alone, for the matrices that may stay float32 beside
    packed ones (the router; the per-layer inputs' under f32): on the CPU numba's row loop whatever
    the rows, so a verification's rows are the decode steps' (as model/moe.py's router)."""
    if x.is_cpu and x.dtype is torch.float32 and isinstance(w, torch.Tensor) and w.dtype is torch.float32:
        return gemm_few_f32(x.contiguous(), w, "numba")
    return linear(x, w)


class RoutedBeside(Experts):
    """Gemma 4's experts: routed on the block's input x (RMS-normed with no gain, times a gain and
    hidden^-1/2), a softmax, the top k renormalized then scaled per expert; run on their own norm of x."""

    def __init__(self, w: SimpleNamespace, block: nn.Module, cfg: ModelConfig):
        super().__init__(w.router, [(e.gate_proj, e.up_proj, e.down_proj) for e in block.experts], cfg.moe,
                         cfg.activation)
        self.gain, self.per_expert, self.eps = w.router_scale, w.per_expert_scale, cfg.rms_norm_eps
        self.root = cfg.hidden_size ** -0.5
        self.unit = torch.zeros_like(w.router_scale)  # a norm with no gain: x̂ (1 + 0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = rms_norm(x, self.unit, self.eps, 1.0) * self.gain * self.root
        probs = torch.softmax(apart(h, self.router).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert[chosen], chosen


class ShapedBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer, self.shape = cfg, layer, cfg.shape(layer)
        self.n_heads, self.eps = cfg.num_attention_heads, cfg.rms_norm_eps
        if cfg.moe is not None:
            self.experts = nn.ModuleList(nn.Module() for _ in range(cfg.moe.num_experts))
        for ours, (_, shape) in block_weights(cfg, layer).items():
            owner, _, attr = ours.rpartition(".")
            setattr(self.get_submodule(owner) if owner else self, attr,
                    nn.Parameter(torch.empty(*shape(cfg), device="meta"), requires_grad=False))
        self.attn = AttentionParams(scale=cfg.attention_scale, softcap=cfg.attn_softcap)

    def hot(self) -> SimpleNamespace:
        """The tensors a forward reads, gathered at the first forward (as decoder.Block.hot)."""
        w = self.__dict__.get("_hot")
        if w is None:
            c = self.cfg
            w = SimpleNamespace(**{n: getattr(self, n) for n in block_weights(c, self.layer) if "." not in n})
            w.qkv = tuple(getattr(w, n) for n in ("q_proj", "k_proj", "v_proj") if hasattr(w, n))
            w.bias = tuple(getattr(w, f"{n}_bias") for n in ("q_proj", "k_proj", "v_proj")
                           if c.qkv_bias and hasattr(w, f"{n}_bias"))
            w.unit = torch.zeros(self.shape.head_dim, dtype=w.q_norm.dtype, device=w.q_norm.device)
            w.experts = RoutedBeside(w, self, c) if c.moe is not None else None
            self.__dict__["_hot"] = w
        return w

    def forward(self, x: torch.Tensor, h: torch.Tensor | None, next_norm, cos: torch.Tensor, sin: torch.Tensor,
                stores: list, sizes: list[int], stepped: Sequence[bool] = (),
                per_layer: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """x -> the next layer's x (each block norms its own input: h None in, None out)."""
        w, eps = self.hot(), self.eps
        h = rms_norm(x, w.input_layernorm, eps, 0.0)
        q, k, v = self._qkv(w, h, cos, sin)
        a = attend_block(q, k, v, stores, sizes, self.attn, stepped)  # the one call into the engines
        a = linear(a.transpose(0, 1).reshape(x.shape[0], -1), w.o_proj)
        x = x + rms_norm(a if not self.cfg.o_bias else a + w.o_proj_bias, w.post_attention_layernorm, eps, 0.0)
        h = rms_norm(x, w.pre_feedforward_layernorm, eps, 0.0)
        m = linear(gated(stacked(h, w.gate_proj, w.up_proj), self.cfg.activation), w.down_proj)
        if w.experts is not None:
            weights, chosen = w.experts.route(x)
            moe = w.experts.grouped(rms_norm(x, w.pre_feedforward_layernorm_2, eps, 0.0), weights, chosen)
            m = rms_norm(m, w.post_feedforward_layernorm_1, eps, 0.0) + \
                rms_norm(moe, w.post_feedforward_layernorm_2, eps, 0.0)
        x = x + rms_norm(m, w.post_feedforward_layernorm, eps, 0.0)
        if per_layer is not None:
            # act(x Wg) * p_i through the MLP's jitted gate: each row's bits those it gets alone
            g = gated(torch.cat((apart(x, w.per_layer_input_gate), per_layer), dim=1), self.cfg.activation)
            x = x + rms_norm(apart(g, w.per_layer_projection), w.post_per_layer_input_norm, eps, 0.0)
        return (x * w.layer_scalar if self.cfg.layer_scalar else x), None

    def _qkv(self, w: SimpleNamespace, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """q (H, T, D) normed and turned; k, v (Hkv, T, D) -- k normed and turned, v normed with no gain
        -- or None, None on a layer that reads an earlier layer's rows."""
        parts = list(linears(h, *w.qkv))
        for i, b in enumerate(w.bias):
            parts[i] = parts[i] + b
        s, eps, t = self.shape, self.eps, h.shape[0]
        q = norm_rope(parts[0].contiguous(), self.n_heads, w.q_norm, eps, 0.0, cos, sin)
        if s.reads is not None:
            return q, None, None
        k = norm_rope(parts[1].contiguous(), s.kv_heads, w.k_norm, eps, 0.0, cos, sin)
        raw_v = parts[1] if s.k_as_v else parts[2]
        v = rms_norm(raw_v.contiguous().view(t, s.kv_heads, s.head_dim), w.unit, eps, 1.0)
        return q, k, v.transpose(0, 1).contiguous()


def per_layer_inputs(model: nn.Module, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
    """Every layer's slice of the per-layer inputs (T, layers, size), from the ids and their scaled
    embeddings x: (norm(x Wp * hidden^-1/2) + table[ids] * sqrt(size)) * 2^-1/2; None without them."""
    c = model.cfg
    p = c.per_layer_inputs
    if p is None:
        return None
    t, n = x.shape[0], c.num_hidden_layers
    table = embedding(ids, model.embed_tokens_per_layer).to(x.dtype) * torch.tensor(math.sqrt(p.size), dtype=x.dtype)
    proj = apart(x, model.per_layer_model_projection) * c.hidden_size ** -0.5
    proj = rms_norm(proj.reshape(t, n, p.size), model.per_layer_projection_norm, c.rms_norm_eps, 0.0)
    return (proj + table.reshape(t, n, p.size)) * 2.0 ** -0.5
