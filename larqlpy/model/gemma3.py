"""Gemma 3 text decoder: one sequence, no batch dimension, attention state held by a KV engine.

Shapes: T = tokens in the block, E = hidden size, H / Hkv = query / KV heads, D = head_dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.base import AttentionParams, EngineState
from larqlpy.kernels.matvec import embedding, linear, linears, rms_norm
from larqlpy.model.config import Gemma3Config, RopeConfig


class Rope:
    """cos/sin tables for one RoPE base, grown on demand. rotate-half layout (HF), not interleaved."""

    def __init__(self, cfg: RopeConfig, head_dim: int, device: torch.device):
        inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.inv_freq = (inv_freq / cfg.factor).to(device)  # linear scaling stretches positions
        self.cos = self.sin = torch.empty(0, head_dim, device=device)

    def tables(self, start: int, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if start + t > self.cos.shape[0]:
            n = max(2 * self.cos.shape[0], start + t, 1024)
            freqs = torch.arange(n, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
        return self.cos[start:start + t].to(dtype), self.sin[start:start + t].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (heads, T, D); cos/sin: (T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _weight(*shape: int) -> nn.Parameter:
    """A placeholder filled by the loader (meta: no memory until real weights arrive)."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Block(nn.Module):
    SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # packed weights stack these

    def __init__(self, cfg: Gemma3Config, layer: int):
        super().__init__()
        e, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim, self.eps = cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rms_norm_eps
        self.q_proj = _weight(self.n_heads * d, e)
        self.k_proj = _weight(self.n_kv * d, e)
        self.v_proj = _weight(self.n_kv * d, e)
        self.o_proj = _weight(e, self.n_heads * d)
        self.q_norm = _weight(d)
        self.k_norm = _weight(d)
        self.gate_proj = _weight(cfg.intermediate_size, e)
        self.up_proj = _weight(cfg.intermediate_size, e)
        self.down_proj = _weight(e, cfg.intermediate_size)
        # The four norms: before and after attention, before and after the MLP.
        self.input_layernorm = _weight(e)
        self.post_attention_layernorm = _weight(e)
        self.pre_feedforward_layernorm = _weight(e)
        self.post_feedforward_layernorm = _weight(e)
        # Gemma 3 dropped Gemma 2's attention-logit softcapping (transformers ignores the key too).
        self.attn = AttentionParams(scale=cfg.query_pre_attn_scalar ** -0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, store) -> torch.Tensor:
        t = x.shape[0]
        h = rms_norm(x, self.input_layernorm, self.eps)  # (T, E)
        q, k, v = linears(h, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(t, self.n_heads, self.head_dim).transpose(0, 1)  # (H, T, D)
        k = k.view(t, self.n_kv, self.head_dim).transpose(0, 1)  # (Hkv, T, D)
        v = v.view(t, self.n_kv, self.head_dim).transpose(0, 1)
        q = apply_rope(rms_norm(q, self.q_norm, self.eps), cos, sin)
        k = apply_rope(rms_norm(k, self.k_norm, self.eps), cos, sin)
        a = store.attend(q, k, v, self.attn)  # (H, T, D): the single dispatch point to the KV engine
        a = linear(a.transpose(0, 1).reshape(t, -1), self.o_proj)
        x = x + rms_norm(a, self.post_attention_layernorm, self.eps)
        h = rms_norm(x, self.pre_feedforward_layernorm, self.eps)
        gate, up = linears(h, self.gate_proj, self.up_proj)
        m = linear(F.gelu(gate, approximate="tanh") * up, self.down_proj)
        return x + rms_norm(m, self.post_feedforward_layernorm, self.eps)


class Gemma3(nn.Module):
    def __init__(self, cfg: Gemma3Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.key_calibration = None  # per-layer KeyCalibration (engines/stores/calibration.py), when the model has one
        self.calibration_problem: str | None = None  # why it has none, when its file is stale or damaged
        self.embed_tokens = _weight(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = _weight(cfg.hidden_size)
        # HF rounds the scale to the weights' dtype before multiplying; so do we (matters in bf16).
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=dtype)
        self.ropes = {"global": Rope(cfg.rope_global, cfg.head_dim, self.device),
                      "sliding": Rope(cfg.rope_local, cfg.head_dim, self.device)}

    def geometries(self) -> list[LayerGeometry]:
        c = self.cfg
        cal = self.key_calibration or [None] * c.num_hidden_layers
        return [LayerGeometry(i, c.window(i), c.num_key_value_heads, c.head_dim, cal[i], self.calibration_problem)
                for i in range(c.num_hidden_layers)]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, state: EngineState, all_logits: bool = False) -> torch.Tensor:
        """Run a block of token ids (T,) at the state's next positions; returns logits (T or 1, V)."""
        start, t = state.position, tokens.shape[0]
        x = embedding(tokens.to(self.device), self.embed_tokens).to(self.dtype) * self.embed_scale.to(self.device)
        tables = {kind: rope.tables(start, t, self.dtype) for kind, rope in self.ropes.items()}
        for block, store in zip(self.layers, state.layers):
            x = block(x, *tables[store.geometry.kind], store)
        state.end_block()
        if not all_logits:
            x = x[-1:]
        logits = linear(rms_norm(x, self.norm, self.cfg.rms_norm_eps), self.embed_tokens)  # tied LM head
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
