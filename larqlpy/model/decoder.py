"""The decoder every family shares, attention state held by a KV engine. What a family changes is
declared on its ModelConfig (model/families/), never tested by name.

There is no batch dimension: a block is rows of one or several sequences laid end to end. Every
matrix is multiplied once for all rows; RoPE takes each row's own position; attention hands each
sequence's rows to that sequence's layer store.

Shapes: T = rows in the block (all sequences), E = hidden size, H / Hkv = query / KV heads, D = head_dim.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from larqlpy.engines.geometry import LayerGeometry
from larqlpy.engines.stores.base import AttentionParams
from larqlpy.engines.stores.dispatch import attend_block
from larqlpy.engines.stores.state import EngineState
from larqlpy.errors import LarqlError
from larqlpy.kernels.weights.matvec import embedding, gated, linear, qkv_rope, residual_norm, rms_norm, stacked
from larqlpy.model.config import ModelConfig, RopeConfig
from larqlpy.model.mla import MLABlock
from larqlpy.model.moe import experts_of
from larqlpy.model.shaped import ShapedBlock, per_layer_inputs
from larqlpy.model.shaped_tensors import top_weights as shaped_top
from larqlpy.model.tensors import block_weights
from larqlpy.model.yarn import yarn_inv_freq


def inv_freq(cfg: RopeConfig, head_dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies, scaled as the config says (transformers' formulas)."""
    if cfg.rope_type == "proportional":  # Gemma 4: the first share of the pairs turned, over the whole head
        turned = int(cfg.partial * head_dim // 2)
        freq = 1.0 / (cfg.theta ** (torch.arange(0, 2 * turned, 2, dtype=torch.int64).float() / head_dim))
        return torch.cat((freq, torch.zeros(head_dim // 2 - turned))) / cfg.factor
    freq = 1.0 / (cfg.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if cfg.rope_type == "none":  # learned positions: cos 1, sin 0, a rotation that leaves q and k as they are
        return torch.zeros_like(freq)
    if cfg.rope_type == "yarn":
        return yarn_inv_freq(cfg, head_dim)
    if cfg.rope_type == "linear":
        return freq / cfg.factor  # linear scaling stretches positions
    if cfg.rope_type == "yarn":
        return yarn_inv_freq(cfg, head_dim)
    if cfg.rope_type == "llama3":  # long wavelengths divided by factor, short ones kept, a ramp between
        low_wavelen = cfg.original_max_position_embeddings / cfg.low_freq_factor
        high_wavelen = cfg.original_max_position_embeddings / cfg.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / cfg.factor, freq)
        smooth = (cfg.original_max_position_embeddings / wavelen - cfg.low_freq_factor) / \
            (cfg.high_freq_factor - cfg.low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq



def layer_geometries(cfg: ModelConfig, kv_dtype: str = "f32", calibration: list | None = None,
                     problem: str | None = None) -> list[LayerGeometry]:
    """Each layer's shape as the KV engines see it: window, KV heads, head width, the layer whose
    rows it reads (shared K/V), the key calibration when the model has one."""
    cal = calibration or [None] * cfg.num_hidden_layers
    return [LayerGeometry(i, cfg.window(i), s.kv_heads, s.head_dim, cal[i], problem, kv_dtype, cfg.mla is not None,
                          reads=s.reads) for i, s in ((i, cfg.shape(i)) for i in range(cfg.num_hidden_layers))]

class Rope:
    """cos/sin tables for one RoPE, grown on demand. rotate-half layout (HF), not interleaved."""

    def __init__(self, cfg: RopeConfig, head_dim: int, device: torch.device):
        self.inv_freq = inv_freq(cfg, head_dim).to(device)
        self.factor = cfg.attention_factor  # YaRN: cos and sin scaled by it (1 elsewhere)
        self.cos = self.sin = torch.empty(0, head_dim, device=device)

    def tables(self, start: int, t: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if start + t > self.cos.shape[0]:
            n = max(2 * self.cos.shape[0], start + t, 1024)
            freqs = torch.arange(n, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos, self.sin = emb.cos(), emb.sin()
            if self.factor != 1.0:
                self.cos, self.sin = self.cos * self.factor, self.sin * self.factor
        return self.cos[start:start + t].to(dtype), self.sin[start:start + t].to(dtype)


def _weight(*shape: int) -> nn.Parameter:
    """A placeholder filled by the loader (meta: no memory until real weights arrive)."""
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.offset = cfg.rms_norm_eps, 1.0 if cfg.norm_offset else 0.0
        self.cfg, self.layer = cfg, layer
        if cfg.is_sparse(layer):  # experts.{j}.gate_proj, ...: one submodule an expert
            self.experts = nn.ModuleList(nn.Module() for _ in range(cfg.moe.num_experts))
        for ours, (_, shape) in block_weights(cfg, layer).items():  # HF names: q_proj, ..., input_layernorm, ...
            owner, _, attr = ours.rpartition(".")
            setattr(self.get_submodule(owner) if owner else self, attr, _weight(*shape(cfg)))
        self.attn = AttentionParams(scale=cfg.attention_scale, softcap=cfg.attn_softcap)
        self.residual = cfg.residual_multiplier if cfg.residual_multiplier != 1.0 else None  # Granite

    def hot(self) -> SimpleNamespace:
        """The tensors a forward reads, as plain attributes: gathered at the block's first forward
        (the loader has installed them by then), since nn.Module's lookup of a parameter costs a
        decode step several microseconds a layer."""
        w = self.__dict__.get("_hot")
        if w is None:
            c = self.cfg
            w = SimpleNamespace(**{n: getattr(self, n) for n in block_weights(c, self.layer) if "." not in n})
            w.experts = experts_of(self, c.moe, c.activation) if c.is_sparse(self.layer) else None
            fused = c.layout == "gpt2"  # q|k|v one matrix in the files
            w.qkv = (w.qkv_proj,) if fused else (w.q_proj, w.k_proj, w.v_proj)
            w.qkv_bias = w.qkv_proj_bias if fused else \
                torch.cat((w.q_proj_bias, w.k_proj_bias, w.v_proj_bias)) if c.qkv_bias else None
            w.q_norm, w.k_norm = (w.q_norm, w.k_norm) if c.qk_norm else (None, None)
            w.o_bias = w.o_proj_bias if c.o_bias else None
            if c.attention_sinks:  # GPT-OSS: each query head's sink joins every softmax (AttentionParams)
                self.attn = AttentionParams(self.attn.scale, self.attn.softcap, w.sinks.detach().float().cpu())
            w.up_bias, w.down_bias = (w.up_proj_bias, w.down_proj_bias) if c.mlp_bias else (None, None)
            # Gemma: normed after attention, then before and after the MLP; Llama: post_attention_layernorm
            # is the MLP's pre-norm
            w.after_attention = w.post_attention_layernorm if c.sandwich_norms else None
            w.mlp_norm = w.pre_feedforward_layernorm if c.sandwich_norms else w.post_attention_layernorm
            w.after_mlp = w.post_feedforward_layernorm if c.sandwich_norms else None
            self.__dict__["_hot"] = w
        return w

    def forward(self, x: torch.Tensor, h: torch.Tensor | None, next_norm, cos: torch.Tensor, sin: torch.Tensor,
                stores: list, sizes: list[int], stepped: Sequence[bool] = ()) -> tuple[torch.Tensor, object]:
        """x and its pre-norm h (None: normed here) -> the next layer's x and, with `next_norm` (its
        input norm's weight), its h: the residual step and the next norm are one kernel call."""
        w, t = self.hot(), x.shape[0]
        h = rms_norm(x, w.input_layernorm, self.eps, self.offset) if h is None else h  # (T, E)
        q, k, v = qkv_rope(stacked(h, *w.qkv), w.qkv_bias, self.n_heads, self.n_kv, w.q_norm,
                           w.k_norm, self.eps, self.offset, cos, sin)  # biased, normed per head, rotated
        a = attend_block(q, k, v, stores, sizes, self.attn, stepped)  # (H, T, D): the one call into the engines
        a = linear(a.transpose(0, 1).reshape(t, -1), w.o_proj)
        if w.o_bias is not None:
            a = a + w.o_bias
        if self.residual is not None:
            a = a * self.residual
        x, h = residual_norm(x, a, w.after_attention, w.mlp_norm, self.eps, self.offset)
        m = linear(gated(stacked(h, w.gate_proj, w.up_proj), self.cfg.activation), w.down_proj) \
            if w.experts is None else w.experts(h)  # a sparse layer's experts (model/moe.py)
        if self.residual is not None:
            m = m * self.residual
        return residual_norm(x, m, w.after_mlp, next_norm, self.eps, self.offset)


class LayerNormBlock(Block):
    """A block of the LayerNorm families (StarCoder2, GPT-2): LayerNorm (gain and bias) before
    attention and before the MLP, a non-gated MLP act(up) -> down, biases where the family says.
    Each block norms its own input (h None in, None out): no fused residual-and-RMSNorm kernel."""

    def forward(self, x: torch.Tensor, h: torch.Tensor | None, next_norm, cos: torch.Tensor, sin: torch.Tensor,
                stores: list, sizes: list[int], stepped: Sequence[bool] = ()) -> tuple[torch.Tensor, None]:
        w, t, e = self.hot(), x.shape[0], (x.shape[1],)
        h = F.layer_norm(x, e, w.input_layernorm, w.input_layernorm_bias, self.eps)
        q, k, v = qkv_rope(stacked(h, *w.qkv), w.qkv_bias, self.n_heads, self.n_kv, None, None, self.eps, 0.0,
                           cos, sin)
        a = attend_block(q, k, v, stores, sizes, self.attn, stepped)
        a = linear(a.transpose(0, 1).reshape(t, -1), w.o_proj)
        x = x + (a if w.o_bias is None else a + w.o_bias)
        h = F.layer_norm(x, e, w.post_attention_layernorm, w.post_attention_layernorm_bias, self.eps)
        up = linear(h, w.up_proj)
        up = up if w.up_bias is None else up + w.up_bias
        m = linear(F.gelu(up, approximate="tanh") if self.cfg.activation == "gelu_tanh" else F.silu(up), w.down_proj)
        return x + (m if w.down_bias is None else m + w.down_bias), None


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.key_calibration = None  # per-layer KeyCalibration (engines/stores/calibration.py), when the model has one
        self.calibration_problem: str | None = None  # why it has none, when its file is stale or damaged
        self.kv_dtype = "f32"  # what the engines keep exact K/V rows in (engines.geometry.KV_DTYPES)
        self.embed_tokens = _weight(cfg.vocab_size, cfg.hidden_size)
        block = ShapedBlock if cfg.layer_shapes is not None else LayerNormBlock if cfg.layer_norm else \
            MLABlock if cfg.mla is not None else Block
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = _weight(cfg.hidden_size)
        if cfg.layer_norm:
            self.norm_bias = _weight(cfg.hidden_size)
        if cfg.learned_positions:
            self.embed_positions = _weight(cfg.max_position_embeddings, cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = _weight(cfg.vocab_size, cfg.hidden_size)
        for name, (_, shape) in shaped_top(cfg).items():  # Gemma 4's per-layer inputs
            setattr(self, name, _weight(*shape(cfg)))
        # HF rounds the scale to the weights' dtype before multiplying; so do we (matters in bf16).
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size) if cfg.embed_scale else cfg.embedding_multiplier,
                                        dtype=dtype)
        self.scaled_embeddings = cfg.embed_scale or cfg.embedding_multiplier != 1.0
        kinds = {"global": (cfg.rope_global, cfg.kind_head_dim(False)), "sliding": (cfg.rope_local,
                                                                                 cfg.kind_head_dim(True))}
        tables = {r: Rope(*r, self.device) for r in set(kinds.values())}  # each kind at its own head width
        self.ropes = {kind: tables[r] for kind, r in kinds.items()}

    def stack(self) -> list[tuple[Block, torch.Tensor | None]]:
        """The blocks in order, each with the next one's input norm (None after the last): kept from
        the first forward on, as the blocks keep their tensors (Block.hot)."""
        pairs = self.__dict__.get("_stack")
        if pairs is None:
            blocks = list(self.layers)
            pairs = [(b, nxt.hot().input_layernorm if nxt is not None else None)
                     for b, nxt in zip(blocks, [*blocks[1:], None])]
            self.__dict__["_stack"] = pairs
        return pairs

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if c.layer_norm:
            return F.layer_norm(x, (c.hidden_size,), self.norm, self.norm_bias, c.rms_norm_eps)
        return rms_norm(x, self.norm, c.rms_norm_eps, 1.0 if c.norm_offset else 0.0)

    def positions(self, states: Sequence[EngineState], sizes: list[int]) -> torch.Tensor:
        """Each row's learned position embedding (GPT-2's wpe), at its own sequence's position."""
        end = max(s.position + n for s, n in zip(states, sizes))
        if end > self.cfg.max_position_embeddings:
            raise LarqlError(f"{self.cfg.model_type} has learned positions up to {self.cfg.max_position_embeddings:,}"
                             f" tokens: position {end - 1:,} is past them")
        idx = torch.cat([torch.arange(s.position, s.position + n) for s, n in zip(states, sizes)])
        return self.embed_positions[idx.to(self.device)].to(self.dtype)

    @property
    def head(self):
        """The LM head's matrix: the embeddings when tied."""
        return self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head

    def rope_freq(self, layer: int) -> torch.Tensor:
        """The inverse frequencies of the RoPE `layer` turns its queries and keys with (D/2,)."""
        return self.ropes["global" if self.cfg.window(layer) is None else "sliding"].inv_freq

    def geometries(self) -> list[LayerGeometry]:
        return layer_geometries(self.cfg, self.kv_dtype, self.key_calibration, self.calibration_problem)

    def forward(self, tokens: torch.Tensor, state: EngineState, all_logits: bool = False) -> torch.Tensor:
        """Run a block of token ids (T,) at the state's next positions; returns logits (T or 1, V)."""
        return self.forward_many([(tokens, state, "all" if all_logits else "last")])[0]

    @torch.inference_mode()
    def forward_many(self, blocks: Sequence[tuple[torch.Tensor, EngineState, str]]) -> list[torch.Tensor | None]:
        """Blocks of several sequences in one pass: [(ids (T_i,), its state, "last" | "all" | "none" |
        "steps" | "hidden")] -> each block's logits ((1 or T_i, V) float32, or None for "none"). Each
        block runs at its state's next positions; the LM head runs once, on the rows whose logits are
        wanted. "steps": every row's logits, and its rows attended as successive decode steps (a
        verification of speculative proposals: each row's numbers are those a decode step of it
        gives). "hidden": every row's final-normed hidden state (T_i, E) float32 instead of logits --
        transformers' last_hidden_state, what an embedding pools."""
        sizes = [b[0].shape[0] for b in blocks]
        states = [b[1] for b in blocks]
        stepped = [b[2] == "steps" for b in blocks] if any(b[2] == "steps" for b in blocks) else ()
        tokens = blocks[0][0] if len(blocks) == 1 else torch.cat([b[0] for b in blocks])
        x = embedding(tokens.to(self.device), self.embed_tokens).to(self.dtype)
        if self.scaled_embeddings:
            x = x * self.embed_scale.to(self.device)
        if self.cfg.learned_positions:
            x = x + self.positions(states, sizes)
        tables = {}  # kind -> cos, sin (T, D): each row at its own sequence's position
        for kind, rope in self.ropes.items():  # one RoPE: the same tables under both kinds
            parts = [rope.tables(s.position, n, self.dtype) for s, n in zip(states, sizes)]
            tables[kind] = parts[0] if len(parts) == 1 else tuple(torch.cat(p) for p in zip(*parts))
        per_layer = per_layer_inputs(self, tokens.to(self.device), x)  # Gemma 4's, (T, layers, size); else None
        h = None
        for i, (block, after) in enumerate(self.stack()):
            stores = [s.layers[i] for s in states]
            x, h = block.forward(x, h, after, *tables[stores[0].geometry.kind], stores, sizes, stepped,
                                 **({} if per_layer is None else {"per_layer": per_layer[:, i]}))
        for s in states:
            s.end_block()
        return self._outputs(x, [b[2] for b in blocks], sizes)

    def _outputs(self, x: torch.Tensor, wants: list[str], sizes: list[int]) -> list[torch.Tensor | None]:
        """Each block's wanted rows of the final norm, through the LM head unless it wants them as
        they are ("hidden": an embedding's rows, which never meet the head)."""
        rows, lo = [], 0  # (first row, count) of each block's wanted rows in x
        for want, n in zip(wants, sizes):
            rows.append((lo, n) if want in ALL_ROWS else (lo + n - 1, 1) if want == "last" else (lo, 0))
            lo += n
        keep = [r for r in rows if r[1]]
        if not keep:
            return [None] * len(wants)
        x = x[keep[0][0]:keep[0][0] + keep[0][1]] if len(keep) == 1 else torch.cat([x[a:a + n] for a, n in keep])
        h = self.final_norm(x)
        counts = [n for _, n in rows]
        if "hidden" not in wants:  # generation: every wanted row to the head
            return _split(self._head(h), counts)
        parts = _split(h, counts)
        heads = [p for p, w in zip(parts, wants) if p is not None and w != "hidden"]
        logits = iter(_split(self._head(torch.cat(heads)), [p.shape[0] for p in heads]) if heads else ())
        return [p.float() if w == "hidden" else None if p is None else next(logits) for p, w in zip(parts, wants)]

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed rows -> float32 logits."""
        logits = linear(h, self.head)
        if self.cfg.final_softcap:
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap) * cap
        if self.cfg.logits_scaling != 1.0:  # Granite
            logits = logits / self.cfg.logits_scaling
        return logits.float()


ALL_ROWS = ("all", "steps", "hidden")  # the wants that take every row of their block


def _split(t: torch.Tensor, counts: list[int]) -> list[torch.Tensor | None]:
    """Consecutive slices of `counts` rows (None where 0)."""
    out, at = [], 0
    for n in counts:
        out.append(t[at:at + n] if n else None)
        at += n
    return out


def prefill(model: Decoder, state: EngineState, ids: Sequence[int] | torch.Tensor, chunk: int,
            all_logits: bool = False) -> torch.Tensor:
    """Run ids through the model in chunks, sampling nothing (a draft's or a branch's prompt, a
    measurement); logits of the last position (or of every position)."""
    outs = []
    chunk = min(chunk, state.max_chunk or chunk)
    for lo in range(0, len(ids), chunk):
        block = torch.as_tensor(ids[lo:lo + chunk], dtype=torch.long)  # a list, or a tensor of ids
        outs.append(model(block, state, all_logits=all_logits))
    return torch.cat(outs) if all_logits else outs[-1]
