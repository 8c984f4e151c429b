"""Greedy decoding held against transformers, shared by the reference-model tests."""

from __future__ import annotations

import torch

from larqlpy.config import GenerationConfig
from larqlpy.decode.stream import stream_generate
from larqlpy.engines import EngineSpec, new_state
from larqlpy.model.decoder import prefill
from larqlpy.text.chat_template import ChatTemplate


def greedy_hf(hf_model, ids, n):
    """transformers' greedy ids: argmax of its logits, step by step with its KV cache (its generate()
    would also apply the generation config's processors, e.g. a repetition penalty)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = hf_model(x, cache=past, use_cache=True)
            past, tok = r.cache, int(r.logits[0, -1].argmax())
            out.append(tok)
            x = torch.tensor([[tok]])
    return out


def hf_logits(hf_model, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def hf_generate(hf_model, ids, n) -> list[int]:
    """transformers' generate(), greedy, n new ids whatever it meets."""
    with torch.no_grad():
        return hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                 pad_token_id=0)[0, len(ids):].tolist()


def our_logits(loaded, ids, chunk: int = 64) -> torch.Tensor:
    """Every position's logits from a prefill in chunks (canonical/v1)."""
    state = new_state(EngineSpec(), loaded.model.geometries(), loaded.device)
    return prefill(loaded.model, state, ids, chunk, all_logits=True)


def logit_gaps(loaded, hf_model, ids, split: int = 20) -> tuple[float, float]:
    """Largest |ours - transformers'| over every position's logits: a prefill of all `ids` in chunks
    of 16, and the ids after `split` decoded one at a time."""
    want = hf_logits(hf_model, ids)
    whole = (our_logits(loaded, ids, 16) - want).abs().max().item()
    state = new_state(EngineSpec(), loaded.model.geometries(), loaded.device)
    prefill(loaded.model, state, ids[:split], 64)
    steps = torch.stack([loaded.model(torch.tensor([t]), state)[-1] for t in ids[split:]])
    return whole, (steps - want[split:]).abs().max().item()


def greedy_ours(loaded, ids, n):
    cfg = GenerationConfig(max_tokens=n, stop_at_eos=False)
    return [t.id for t in stream_generate(loaded.model, ids, EngineSpec(), cfg)]


def assert_prompts_match(loaded, hf_model, prompts, n):
    for prompt in prompts:
        ids = loaded.tokenizer.encode(prompt)
        assert greedy_ours(loaded, ids, n) == greedy_hf(hf_model, ids, n), prompt


def assert_chats_match(loaded, hf_model, hf_tokenizer, conversations, n) -> list[int]:
    """Each conversation's rendered text equals transformers' and so do the answers' greedy ids;
    returns the last answer's ids."""
    template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    for messages in conversations:
        text = template.render(messages, add_generation_prompt=True)
        assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = loaded.tokenizer.encode(text, add_bos=False)
        ours = greedy_ours(loaded, ids, n)
        assert ours == greedy_hf(hf_model, ids, n), messages
    return ours
