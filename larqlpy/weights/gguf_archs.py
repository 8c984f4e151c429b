"""What each GGUF architecture needs to come back to the Hugging Face layout: its config.json from
the metadata, its tensor names, and the conventions llama.cpp's converter applied on the way in.

- gemma3: every norm stored as 1 + w (HF stores w); the layer pattern, the local RoPE base and
  query_pre_attn_scalar are not in the metadata and are Gemma 3 constants.
- llama: the rows of attn_q and attn_k permuted into llama.cpp's RoPE order (undone here as
  transformers' GGUF loader undoes it); norms stored as they are; no output.weight means a tied head.
  Llama 3.1/3.2's RoPE scaling comes as a tensor, rope_freqs.weight: one divisor a frequency, which
  is read back into the llama3 parameters it was made from (checked to give the same divisors).
- qwen2: the llama layout with q/k/v biases, and no permutation (llama.cpp runs Qwen's RoPE as is).
- qwen3: qwen2's layout with an RMSNorm on each query and key head (attn_q_norm, attn_k_norm) and no
  biases.
- Experts (llama with {arch}.expert_count: Mixtral; qwen3moe): a layer's router is ffn_gate_inp, its
  experts three 3-D tensors, ffn_gate_exps / ffn_up_exps / ffn_down_exps (experts, rows, inputs),
  read as one 2-D view an expert, `NAME[j]` (expert_views). qwen3moe's layers without a router run
  the dense MLP (ffn_gate, ffn_up, ffn_down); qwen3moe's top k weights are renormalized
  (norm_topk_prob), as llama.cpp always does.
- granite, granitemoe, starcoder2, gpt2: gguf_more_archs.py; gpt-oss: gguf_gpt_oss.py (experts with
  biases: the router's ffn_gate_inp.bias, each expert's row of the 2-D ffn_*_exps.bias); deepseek2
  (DeepSeek-V2 / V3: latent attention, shared experts): gguf_deepseek.py; gemma4: gguf_gemma4.py
  (gains as themselves, per-layer inputs, K/V shared by the last layers, experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from larqlpy.model.families import deepseek, gpt_oss, granitemoe, mixtral, qwen3_moe
from larqlpy.weights import gguf_deepseek as ds
from larqlpy.weights import gguf_gemma4 as g4
from larqlpy.weights import gguf_gpt_oss as oss
from larqlpy.weights import gguf_more_archs as more


LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}
GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}  # index in a family's expert names
ROUTER = "ffn_gate_inp"
LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class Arch:
    name: str  # general.architecture
    norms: dict[str, str]  # GGUF block norm -> HF name under model.layers.{i}.
    norm_plus_one: bool  # llama.cpp stores norm gains as 1 + w
    permuted_qk: bool  # llama.cpp permuted attn_q / attn_k rows for its RoPE
    config: Callable[["Meta"], dict]
    in_config: tuple[str, ...] = ()  # tensors read into config.json, not weights
    moe_names: tuple[str, tuple[str, str, str]] | None = None  # HF's router block and expert names (families)
    moe_router: str = "gate"  # the router's HF name under its block
    top: dict[str, str] | None = None  # top-level tensors, GGUF -> HF, beyond (or in place of) TOP's
    linears: dict[str, str] | None = None  # a block's linears, GGUF kind -> HF under the block (None: LINEARS)
    layers: str = "model.layers."  # where blocks live in HF names
    norm_bias: bool = False  # norms with biases (LayerNorm)
    plain: dict[str, str] | None = None  # a block's KIND (.weight) or KIND.WHAT -> its HF name as it is
    names: Callable[[str], tuple[str, bool] | None] | None = None  # tried first: names of the arch's own (Gemma 4)
    table: Callable[[dict], dict] | None = None  # the tensor table as this arch's names read it (after expert_views)

    def hf_name(self, gguf_name: str) -> tuple[str, bool] | None:
        """HF tensor name for a GGUF one, and whether it is a norm stored as 1 + w. None: not ours."""
        if self.names is not None and (own := self.names(gguf_name)) is not None:
            return own
        if self.moe_names is not None and (moe := self._moe_name(gguf_name)) is not None:
            return moe, False
        top = {**TOP, **(self.top or {})}
        if gguf_name in top:
            return top[gguf_name], self.norm_plus_one and gguf_name == "output_norm.weight"
        parts = gguf_name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias"):
            layer, kind, what = parts[1], parts[2], parts[3]
            plains = self.plain or {}
            plain = plains.get(f"{kind}.{what}") or (plains.get(kind) if what == "weight" else None)
            if plain is not None:  # GPT-OSS's sinks, DeepSeek-V3's correction bias
                return f"{self.layers}{layer}.{plain}", False
            if kind in self.norms and (what == "weight" or self.norm_bias):
                return f"{self.layers}{layer}.{self.norms[kind]}.{what}", self.norm_plus_one
            linears = self.linears or LINEARS
            if kind in linears:
                return f"{self.layers}{layer}.{linears[kind]}.{what}", False
        return None

    def _moe_name(self, gguf_name: str) -> str | None:
        """A router's HF name, or an expert's (a view `blk.N.ffn_gate_exps.weight[j]`); their biases
        alike (`.bias`, GPT-OSS)."""
        base, _, expert = gguf_name.partition("[")
        parts = base.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
            return None
        (block, names), what = self.moe_names, parts[3]
        if parts[2] == ROUTER and not expert:
            return f"model.layers.{parts[1]}.{block}.{self.moe_router}.{what}"
        if parts[2] in EXPERTS and expert[:-1].isdigit() and expert.endswith("]"):
            return f"model.layers.{parts[1]}.{block}.experts.{int(expert[:-1])}.{names[EXPERTS[parts[2]]]}.{what}"
        return None

    def restore(self, gguf_name: str, w: np.ndarray, config: dict) -> np.ndarray:
        """Undo the converter's permutation of q and k rows (weights and biases alike)."""
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if not self.permuted_qk or kind not in ("attn_q", "attn_k"):
            return w
        heads = config["num_attention_heads"] if kind == "attn_q" else config["num_key_value_heads"]
        half = w.shape[0] // heads // 2
        return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


    def hf_values(self, gguf_name: str, w: np.ndarray, config: dict, is_norm: bool) -> np.ndarray:
        """A dequantized tensor as the HF layout holds it: rows un-permuted, and w for a norm stored
        as 1 + w."""
        w = self.restore(gguf_name, w, config)
        return w - np.float32(1.0) if is_norm else w


class Meta:
    """The GGUF's metadata under its architecture's prefix. Values are decoded once: the vocabulary
    is read by the check, the config and the tokenizer (a tenth of a second each for 150k tokens)."""

    def __init__(self, reader, arch: str, given: dict | None = None):
        """given: values that stand in for the file's (a pre-tokenizer named at load)."""
        self.reader, self.arch = reader, arch
        self._values: dict = dict(given or {})

    def get(self, key: str, default=None):
        if key in self._values:
            return self._values[key]
        f = self.reader.fields.get(key)
        if f is None:
            return default
        if key not in self._values:
            self._values[key] = f.contents()
        return self._values[key]

    def arch_key(self, key: str, default=None):
        return self.get(f"{self.arch}.{key}", default)

    def tensor(self, name: str):
        """The file's tensor `name` (gguf-py's ReaderTensor), or None."""
        return next((t for t in self.reader.tensors if t.name == name), None)

    def has_tensor(self, name: str) -> bool:
        return self.tensor(name) is not None

    def common(self, model_type: str, architecture: str, default_theta: float) -> dict:
        """The config.json fields every architecture reads the same way."""
        tokens = self.get("tokenizer.ggml.tokens")
        hidden = int(self.arch_key("embedding_length"))
        heads = int(self.arch_key("attention.head_count"))
        eos = self.get("tokenizer.ggml.eos_token_id")
        out = {
            "architectures": [architecture], "model_type": model_type,
            "vocab_size": int(self.arch_key("vocab_size", len(tokens))), "hidden_size": hidden,
            "intermediate_size": int(_first(self.arch_key("feed_forward_length"))),
            "num_hidden_layers": int(self.arch_key("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(_first(self.arch_key("attention.head_count_kv", heads))),
            "head_dim": int(self.arch_key("attention.key_length", hidden // heads)),
            "rope_theta": float(self.arch_key("rope.freq_base", default_theta)),
            "rms_norm_eps": float(self.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self.arch_key("context_length", 2048)),
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": None if eos is None else int(eos),
            "pad_token_id": self.get("tokenizer.ggml.padding_token_id"),
            "tie_word_embeddings": not self.has_tensor("output.weight"),
            "torch_dtype": "float32",
        }
        factor = self.arch_key("rope.scaling.factor")
        if self.arch_key("rope.scaling.type") == "linear" and factor:  # other kinds: refused by gguf_check
            out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        return out


def _first(v):
    """A key llama.cpp reads as one value or one a layer (gguf_check lets lists through on gemma4):
    the first layer's; the architecture's config reads the others."""
    return v[0] if isinstance(v, list) else v


def gemma3_config(m: Meta) -> dict:
    c = m.common("gemma3_text", "Gemma3ForCausalLM", 1e6)
    tokens = m.get("tokenizer.ggml.tokens")
    eot = tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else None
    eos = c["eos_token_id"] if c["eos_token_id"] is not None else 1
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    c.update({
        "vocab_size": len(tokens), "sliding_window": int(m.arch_key("attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"  # five sliding, one global
                        for i in range(c["num_hidden_layers"])],
        "rope_local_base_freq": 10_000.0,
        # Gemma 3 scales queries by head_dim ** -0.5, except 27B which uses hidden/heads (168).
        "query_pre_attn_scalar": hidden // heads if hidden == 5376 else c["head_dim"],
        "final_logit_softcapping": m.arch_key("final_logit_softcapping"), "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(m.arch_key("context_length", 32768)),
        "bos_token_id": int(c["bos_token_id"] if c["bos_token_id"] is not None else 2),
        "eos_token_id": [eos] + ([eot] if eot is not None and eot != eos else []),
        "pad_token_id": int(c["pad_token_id"] if c["pad_token_id"] is not None else 0), "tie_word_embeddings": True,
        "rope_scaling": c.get("rope_scaling"),
    })
    return c


def llama_config(m: Meta) -> dict:
    c = {**m.common("llama", "LlamaForCausalLM", 10000.0), "hidden_act": "silu", "attention_bias": False,
         "mlp_bias": False}
    tensor = m.tensor(ROPE_FREQS)
    if tensor is not None:  # checked by gguf_check: of the llama3 form
        c["rope_scaling"] = llama3_rope(np.asarray(tensor.data), c["rope_theta"], c["head_dim"])
    if m.arch_key("expert_count"):  # Mixtral: llama's layout, experts in every layer (checked by gguf_check)
        c.update(model_type="mixtral", architectures=["MixtralForCausalLM"], sliding_window=None,
                 num_local_experts=int(m.arch_key("expert_count")),
                 num_experts_per_tok=int(m.arch_key("expert_used_count")))
    return c


ROPE_FREQS = "rope_freqs.weight"


def llama3_rope(divisors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """The llama3 rope_scaling whose per-frequency divisors (llama.cpp's rope_freqs, as its converter
    makes them from config.json) are `divisors`; None when no such parameters give them. The file
    does not keep the original context length: only its ratio to the wavelengths shows, read from a
    ramped frequency (else any length between the kept and the divided ones gives the same divisors)."""
    d = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if d.shape != (head_dim // 2,) or not np.all(np.isfinite(d)) or d.min() < 1:
        return None
    factor = float(d.max())
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):  # Llama 3.1 and 3.2: 1 and 4
        original = _original_context(d, wavelen, factor, low, high)
        smooth = (original / wavelen - low) / (high - low)
        made = np.where(wavelen < original / high, 1.0, np.where(
            wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
        if np.allclose(made, d, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    return None


def _original_context(d, wavelen, factor: float, low: float, high: float) -> int:
    ramp = (d > 1) & (d < factor)
    if ramp.any() and factor > 1:
        smooth = (factor / d[ramp] - 1) / (factor - 1)
        return int(round(float(np.median(wavelen[ramp] * (smooth * (high - low) + low)))))
    above = float(wavelen[d == 1].max() * high) if (d == 1).any() else 0.0
    below = float(wavelen[d == factor].min() * low) if (d == factor).any() else 2.0 ** 31
    return 8192 if above < 8192 < below else int((above + below) / 2)


def qwen3_config(m: Meta) -> dict:
    return {**m.common("qwen3", "Qwen3ForCausalLM", 1e6), "hidden_act": "silu", "attention_bias": False,
            "use_sliding_window": False}


def qwen3moe_config(m: Meta) -> dict:
    c = {**qwen3_config(m), "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    n = c["num_hidden_layers"]
    routed = {t.name for t in m.reader.tensors if t.name.endswith(f".{ROUTER}.weight")}
    c.update(num_experts=int(m.arch_key("expert_count")), num_experts_per_tok=int(m.arch_key("expert_used_count")),
             moe_intermediate_size=int(m.arch_key("expert_feed_forward_length")), decoder_sparse_step=1,
             norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalizes (Qwen3-MoE's own configs say so)
             mlp_only_layers=[i for i in range(n) if f"blk.{i}.{ROUTER}.weight" not in routed])
    return c


def expert_views(tensors: dict[str, tuple]) -> dict[str, tuple]:
    """A tensor table (name -> type, shape, offset, bytes) with each 3-D ffn_*_exps tensor (a layer's
    experts, outermost) in place as one 2-D view an expert, `NAME[j]`: an expert's rows lie whole and
    together, so each is read, checked and packed as any matrix is; the experts' 2-D biases
    (ffn_*_exps.bias) as one row an expert alike."""
    out = {}
    for name, (qtype, shape, offset, nbytes) in tensors.items():
        biases = len(shape) == 2 and name.endswith("_exps.bias")  # not deepseek2's 3-D attn_k_b / attn_v_b
        if not ((len(shape) == 3 and "_exps." in name) or biases) or shape[0] < 1 or nbytes % shape[0]:
            out[name] = (qtype, shape, offset, nbytes)
            continue
        per = nbytes // shape[0]
        out.update({f"{name}[{j}]": (qtype, tuple(shape[1:]), offset + j * per, per) for j in range(shape[0])})
    return out


def qwen2_config(m: Meta) -> dict:
    return {**m.common("qwen2", "Qwen2ForCausalLM", 1e6), "hidden_act": "silu", "use_sliding_window": False}


ARCHS = {a.name: a for a in (
    Arch("gemma3", GEMMA_NORMS, norm_plus_one=True, permuted_qk=False, config=gemma3_config),
    Arch("gemma4", {**GEMMA_NORMS, **g4.NORMS}, norm_plus_one=False, permuted_qk=False, config=g4.gemma4_config,
         in_config=(ROPE_FREQS,), top=g4.TOP, linears={**LINEARS, **g4.LINEARS}, plain=g4.PLAIN, names=g4.hf_name,
         table=g4.split_gate_up),
    Arch("llama", LLAMA_NORMS, norm_plus_one=False, permuted_qk=True, config=llama_config, in_config=(ROPE_FREQS,),
         moe_names=mixtral.HF_NAMES),
    Arch("qwen2", LLAMA_NORMS, norm_plus_one=False, permuted_qk=False, config=qwen2_config),
    Arch("qwen3", LLAMA_NORMS, norm_plus_one=False, permuted_qk=False, config=qwen3_config),
    Arch("qwen3moe", LLAMA_NORMS, norm_plus_one=False, permuted_qk=False, config=qwen3moe_config,
         moe_names=qwen3_moe.HF_NAMES),
    Arch("granite", LLAMA_NORMS, norm_plus_one=False, permuted_qk=True, config=more.granite_config),
    Arch("granitemoe", LLAMA_NORMS, norm_plus_one=False, permuted_qk=True, config=more.granitemoe_config,
         moe_names=granitemoe.HF_NAMES, moe_router=granitemoe.HF_ROUTER),
    Arch("starcoder2", LLAMA_NORMS, norm_plus_one=False, permuted_qk=False, config=more.starcoder2_config,
         top=more.LAYER_NORM_TOP, linears={**LINEARS, **more.PLAIN_MLP}, norm_bias=True),
    Arch("gpt-oss", oss.NORMS, norm_plus_one=False, permuted_qk=False, config=oss.gpt_oss_config,
         moe_names=gpt_oss.HF_NAMES, moe_router=oss.ROUTER, plain=oss.PLAIN),
    Arch("deepseek2", ds.NORMS, norm_plus_one=False, permuted_qk=False, config=ds.deepseek2_config,
         moe_names=deepseek.HF_NAMES, linears=ds.LINEARS, plain=ds.PLAIN),
    Arch("gpt2", more.GPT2_NORMS, norm_plus_one=False, permuted_qk=False, config=more.gpt2_config,
         top=more.GPT2_TOP, linears=more.GPT2_LINEARS, layers="transformer.h.", norm_bias=True),
)}
