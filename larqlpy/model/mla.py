"""A block of multi-head latent attention (DeepSeek-V2, V3: transformers' DeepseekV2Attention /
DeepseekV3Attention) with a dense MLP or DeepSeek's experts (model/moe.py, model/routing.py).

A position's keys and values for every head come from one latent row c (kv_a_proj, then its
RMSNorm; kv_lora_rank wide) through kv_b_proj, which holds per head W_UK (qk_nope_head_dim x r) and
W_UV (v_head_dim x r), beside one RoPE key k_r (qk_rope_head_dim) every head shares. The engines
keep [c, k_r] alone -- one KV head of kv_lora_rank + qk_rope_head_dim values, its value the same row
(`LayerGeometry.values_are_keys`) -- and attention runs in the latent space (W_UK and W_UV absorbed,
as DeepSeek's own inference and llama.cpp do):

    score_h(i, j) = q_nope_h(i) . W_UK_h c(j) + q_r_h(i) . k_r(j) = [W_UK_hᵀ q_nope_h(i), q_r_h(i)] . [c(j), k_r(j)]
    out_h(i)      = W_UV_h sum_j p_h(i, j) c(j)

so each head's query is [W_UK_hᵀ q_nope, q_r] and its output the first kv_lora_rank columns of the
attention over [c, k_r] rows, times W_UV_h. The scale is qk_head_dim ** -0.5, times YaRN's
mscale(factor, mscale_all_dim) squared (model/yarn.py). The q_a and kv_a norms use eps 1e-6 whatever
rms_norm_eps says, as transformers builds them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn as nn

from larqlpy.engines.stores.base import AttentionParams
from larqlpy.engines.stores.dispatch import attend_block
from larqlpy.kernels.weights import qmany
from larqlpy.kernels.weights.matvec import FEW_ROWS, gated, linear, residual_norm, rms_norm, stacked
from larqlpy.kernels.weights.qweight import TILE
from larqlpy.model.config import ModelConfig
from larqlpy.model.moe import experts_of
from larqlpy.model.tensors import block_weights

LATENT_EPS = 1e-6  # the q_a and kv_a norms' (transformers' DeepseekV2RMSNorm default)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on the last dim of x (..., T, d) with rotate-half tables (T, d). Interleaved pairs are laid
    out as halves first (transformers' apply_rotary_pos_emb_interleave: the same rotation, the pair
    order every query and key share changed, their products not)."""
    if interleave:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def per_head(w, heads: int) -> torch.Tensor:
    """A (heads, rows, inputs) matrix as float32: a packed one (every head's rows) dequantized."""
    if isinstance(w, torch.Tensor):
        return w.float()
    return w.rows(torch.arange(w.shape[0], device=w.device)).view(heads, -1, w.shape[1])


def per_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each head's rows times its matrix, x (H, T, a) @ w (H, a, b): a few rows (decode steps, a
    speculative verification) one at a time, so that a row's numbers are those it gets alone."""
    if 1 < x.shape[1] <= FEW_ROWS:
        return torch.cat([torch.matmul(x[:, i:i + 1], w) for i in range(x.shape[1])], dim=1)
    return torch.matmul(x, w)


class MLABlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer, self.eps = cfg, layer, cfg.rms_norm_eps
        if cfg.is_sparse(layer):
            self.experts = nn.ModuleList(nn.Module() for _ in range(cfg.moe.num_experts))
            if cfg.moe.shared_intermediate:
                self.shared = nn.Module()
        for ours, (_, shape) in block_weights(cfg, layer).items():
            owner, _, attr = ours.rpartition(".")
            setattr(self.get_submodule(owner) if owner else self, attr,
                    nn.Parameter(torch.empty(*shape(cfg), device="meta"), requires_grad=False))
        self.attn = AttentionParams(scale=cfg.attention_scale)

    def hot(self) -> SimpleNamespace:
        """The tensors a forward reads, gathered once (Block.hot), kv_b_proj as per-head W_UK, W_UV."""
        w = self.__dict__.get("_hot")
        if w is None:
            c, m = self.cfg, self.cfg.mla
            w = SimpleNamespace(**{n: getattr(self, n) for n in block_weights(c, self.layer) if "." not in n})
            w.experts = experts_of(self, c.moe, c.activation) if c.is_sparse(self.layer) else None
            w.first = (w.q_proj if m.q_lora_rank is None else w.q_a_proj, w.kv_a_proj)
            heads = c.num_attention_heads
            # a GGUF's codes of k_b and v_b, where each head's rows are whole tiles: run on them (qmany)
            w.heads = (w.k_b_proj, w.v_b_proj) if m.kv_b_split and all(
                qmany.one_kind([p]) and p.shape[0] // heads % TILE == 0 for p in (w.k_b_proj, w.v_b_proj)) else None
            if w.heads is None:  # float: per-head matmuls
                if m.kv_b_split:  # a GGUF's k_b (H, r, nope) and v_b (H, v, r)
                    uk, uv = per_head(w.k_b_proj, heads).transpose(1, 2), per_head(w.v_b_proj, heads)
                else:
                    kv_b = w.kv_b_proj.float().view(heads, m.qk_nope_head_dim + m.v_head_dim, -1)
                    uk, uv = kv_b[:, :m.qk_nope_head_dim], kv_b[:, m.qk_nope_head_dim:]
                w.uk = uk.to(w.kv_a_norm.dtype)  # (H, nope, r)
                w.uv_t = uv.transpose(1, 2).to(w.kv_a_norm.dtype)  # (H, r, v)
            self.__dict__["_hot"] = w
        return w

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stores: list, sizes: list[int],
                  stepped: Sequence[bool]) -> torch.Tensor:
        """Normed rows h (T, E) -> the attention output before o_proj (T, H * v_head_dim)."""
        w, m, t, heads = self.hot(), self.cfg.mla, h.shape[0], self.cfg.num_attention_heads
        r = m.kv_lora_rank
        first = stacked(h, *w.first)  # q (or q_a) | kv_a: one product
        q, ckv = first[:, :-(r + m.qk_rope_head_dim)], first[:, -(r + m.qk_rope_head_dim):]
        if m.q_lora_rank is not None:
            q = linear(rms_norm(q.contiguous(), w.q_a_norm, LATENT_EPS, 0.0), w.q_b_proj)
        q = q.view(t, heads, -1).transpose(0, 1)  # (H, T, nope + rope)
        latent = rms_norm(ckv[:, :r].contiguous(), w.kv_a_norm, LATENT_EPS, 0.0)  # (T, r)
        k_rope = rotate(ckv[:, r:], cos, sin, m.rope_interleave)  # (T, rope): one for every head
        q_rope = rotate(q[..., m.qk_nope_head_dim:], cos, sin, m.rope_interleave)
        query = torch.cat((self.absorbed(q[..., :m.qk_nope_head_dim], 0), q_rope), dim=-1)  # (H, T, r + rope)
        row = torch.cat((latent, k_rope), dim=-1).unsqueeze(0)  # (1, T, r + rope): what the engines keep
        a = attend_block(query.contiguous(), row, row, stores, sizes, self.attn, stepped)
        out = self.absorbed(a[..., :r], 1)  # (H, T, v)
        return out.transpose(0, 1).reshape(t, -1)

    def absorbed(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """Each head's rows x (H, T, a) times its W_UK transposed (which 0: nope -> r) or W_UV (1: r -> v):
        on the file's codes, one call for every head (every row's numbers its own, whatever T), or
        float per-head matmuls."""
        w = self.hot()
        if w.heads is None:
            return per_row(x, w.uv_t if which else w.uk)
        y = torch.from_numpy(qmany.gemm_heads(w.heads[which], x.float().contiguous().numpy(), x.shape[0]))
        return y if x.dtype is torch.float32 else y.to(x.dtype)

    def forward(self, x: torch.Tensor, h: torch.Tensor | None, next_norm, cos: torch.Tensor, sin: torch.Tensor,
                stores: list, sizes: list[int], stepped: Sequence[bool] = ()) -> tuple[torch.Tensor, object]:
        w = self.hot()
        h = rms_norm(x, w.input_layernorm, self.eps, 0.0) if h is None else h
        a = linear(self.attention(h, cos, sin, stores, sizes, stepped), w.o_proj)
        x, h = residual_norm(x, a, None, w.post_attention_layernorm, self.eps, 0.0)
        m = linear(gated(stacked(h, w.gate_proj, w.up_proj), self.cfg.activation), w.down_proj) \
            if w.experts is None else w.experts(h)
        return residual_norm(x, m, None, next_norm, self.eps, 0.0)
