"""The weight bytes a decoded token reads in a mixture of experts (bench/decode.py's "MB a token"): every
dense matrix, the router and the shared experts whole, and of each sparse layer's routed experts only
the top k a token runs -- k / E of their bytes, every expert of a layer being the same size. A dense
model's count is its weights' as before. The same rule for larqlpy, transformers and llama.cpp, so
the bandwidth a decode figure implies is the one it achieves."""

from __future__ import annotations

from functools import reduce


def larqlpy_unread(loaded) -> int:
    """Bytes of the routed experts a token leaves unread: (E - k) / E of each sparse layer's experts."""
    from larqlpy.model.tensors import block_weights

    cfg = loaded.config
    if cfg.moe is None:
        return 0
    k, e = cfg.moe.top_k, cfg.moe.num_experts
    unread = 0
    for i, block in enumerate(loaded.model.layers):
        if not cfg.is_sparse(i):
            continue
        held = [reduce(getattr, n.split("."), block) for n in block_weights(cfg, i) if n.startswith("experts.")]
        wholes = {id(w): w for w in (getattr(p, "whole", p) for p in held)}  # gate|up stacked: counted once
        unread += sum(w.nbytes for w in wholes.values()) * (e - k) // e  # packed or torch: nbytes
    return unread


def hf_unread(hf) -> int:
    """The same for a transformers model: its routed experts' parameters (under `.experts.`)."""
    c = hf.config
    k = getattr(c, "num_experts_per_tok", None)
    e = next((getattr(c, n) for n in ("n_routed_experts", "num_local_experts", "num_experts")
              if getattr(c, n, None)), None)
    if not k or not e:
        return 0
    routed = sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if ".experts." in n)
    return routed * (e - k) // e


def gguf_unread(reader) -> int:
    """The same for a GGUF (llama.cpp): its 3-D ffn_*_exps tensors, k and E from its metadata."""
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def key(name):
        f = reader.fields.get(f"{arch}.{name}")
        return int(f.parts[-1][0]) if f is not None else 0

    k, e = key("expert_used_count"), key("expert_count")
    if not k or not e:
        return 0
    routed = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    return routed * (e - k) // e
