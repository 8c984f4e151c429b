"""Greedy decoding held against transformers, shared by the reference-model tests."""

from __future__ import annotations

import torch

from larqlpy.config import GenerationConfig
from larqlpy.decode.stream import stream_generate
from larqlpy.engines import EngineSpec
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
