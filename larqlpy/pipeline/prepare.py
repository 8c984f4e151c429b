"""A request made into a sequence, the same way for every entry point: the engine, the prompt's ids
(a conversation through the chat template, text through the tokenizer, or ids as given), the fit in
the model's context, and where its first state comes from -- a state file to resume, a server's
kept states, a chat's previous turn, or nothing (a fresh state). Every refusal raises LarqlError
here, before the first forward pass.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

from larqlpy.calibration import ensure as ensure_calibration
from larqlpy.config import DRAFT_TOKENS, GenerationConfig, Grammar
from larqlpy.decode.sequence import Sequence
from larqlpy.decode.speculate import Draft, Lookup
from larqlpy.engines import EngineSpec
from larqlpy.errors import LarqlError
from larqlpy.pipeline.request import Request
from larqlpy.state.branches import Branches
from larqlpy.state.saved import FileSource
from larqlpy.state.sources import StateSource
from larqlpy.text.chat_template import ChatTemplate
from larqlpy.text.reasoning import SWITCH, reasoning_of, switchable
from larqlpy.text.tools import call_grammar, tag_tokens
from larqlpy.weights.loader import LoadedModel


def prepare(loaded: LoadedModel, req: Request, source: StateSource | None = None, key=None, spec=None) -> Sequence:
    """`req` as a sequence on `loaded`. `source`: the kept states it may start from (a request that
    resumes a file reads it here); given one, the engine must keep a state. `spec`: an engine
    already chosen (a chat's), instead of the request's."""
    spec = req.spec() if spec is None else spec
    template = ChatTemplate.for_tokenizer(loaded.tokenizer, req.chat_template) if req.messages is not None else None
    req = with_tools(loaded, req, template)
    text = rendered(req, template)
    req = with_reasoning(req, template, text)
    ids = prompt_ids(loaded, req, text)
    if req.resume is not None:
        source = FileSource(loaded, req.resume, req.reprefill)
        spec = source.spec(spec)
        ids = source.tokens if ids is None else ids
    elif source is not None:
        spec.stateful("keep its state for later requests")
    vocab = loaded.config.vocab_size
    biased = [t for t, _ in req.gen.logit_bias if t >= vocab]
    if biased:
        raise LarqlError(f"`logit_bias` names token id {biased[0]}; the model's ids are 0..{vocab - 1}")
    gen, notes = fit_context(req.gen, len(ids), loaded.config.max_position_embeddings)
    return Sequence(loaded.model, ids, spec, gen, stop_ids=loaded.tokenizer.stop_ids, tokenizer=loaded.tokenizer,
                    source=source, key=key if key is not None else req.id, request=req, notes=notes,
                    proposer=proposer(loaded, spec, gen), before_start=calibrated(loaded, spec),
                    reasoning=req.reasoning)


def prompt_of(loaded: LoadedModel, req: Request) -> list[int]:
    """The prompt's ids as `prepare` makes them (the template, with the request's tools), and no
    sequence: what counting a prompt's tokens needs."""
    template = ChatTemplate.for_tokenizer(loaded.tokenizer, req.chat_template) if req.messages is not None else None
    return prompt_ids(loaded, req, rendered(with_tools(loaded, req, template), template)) or []


def calibrated(loaded: LoadedModel, spec: EngineSpec | None) -> Callable[[], str | None] | None:
    """The key calibration the engine may want, measured when the sequence starts: that is a prefill
    of the model, so it runs on the thread that runs the model (a server's engine thread), never
    where the request is prepared."""
    return partial(ensure_calibration, loaded, spec) if spec is not None else None


def proposer(loaded: LoadedModel, spec, gen: GenerationConfig):
    """Speculative decoding's proposer for one sequence: the process's draft model, or prompt
    lookup, or none (no-cache keeps no state to roll back)."""
    tokens = next(k for k in (gen.draft_tokens, loaded.draft_tokens, DRAFT_TOKENS) if k is not None)
    drafting = loaded.draft is not None and tokens > 0
    if drafting and gen.lookup:
        raise LarqlError("`lookup` and a draft model are two ways to propose tokens: give `draft_tokens` 0 to "
                         "look up instead")
    if spec is None or spec.replay:
        return None
    if drafting:
        return Draft(loaded.draft.model, spec, tokens, gen.prefill_chunk, gen.sampling.seed,
                     loaded.config.vocab_size, gen.draft_p_min)
    return Lookup(gen.lookup) if gen.lookup else None


def prepare_all(loaded: LoadedModel, req: Request, source: StateSource | None = None, key=None,
                spec=None) -> list[Sequence]:
    """`req` as its sequences: one, or its `n` choices -- branches of one prompt, prefilled once
    (state/branches.py), each with its own seed when one is given. Branches neither take from nor
    leave kept states: `source` serves a single choice only. `spec`: as `prepare`'s."""
    if req.n == 1:
        return [prepare(loaded, req, source, key, spec)]
    first = prepare(loaded, req, key=key, spec=spec)
    branches = Branches(loaded.model, first.spec, req.n, first.gen.prefill_chunk)
    first.source = branches
    return [first] + [branch(loaded, first, branch_settings(first.gen, i)) for i in range(1, req.n)]


def branch(loaded: LoadedModel, first: Sequence, gen: GenerationConfig) -> Sequence:
    """Another choice of `first`'s prompt, on settings `gen` (its seed), from the same branches."""
    return Sequence(loaded.model, first.prompt_ids, first.spec, gen, stop_ids=loaded.tokenizer.stop_ids,
                    tokenizer=loaded.tokenizer, source=first.source, key=first.key, request=first.request,
                    notes=first.notes, proposer=proposer(loaded, first.spec, gen),
                    before_start=first.before_start, reasoning=first.request.reasoning)


def with_tools(loaded: LoadedModel, req: Request, template: ChatTemplate | None) -> Request:
    """A request that offers tools (a chat's: `template` renders it), with its template's
    convention for them and, when it must call one, the grammar of that call."""
    if req.tools is None:
        return req
    use = dataclasses.replace(req.tools, convention=template.convention)
    if use.forced:
        grammar = Grammar("grammar", call_grammar(use, tag_tokens(loaded.tokenizer.ids_of)))
        return dataclasses.replace(req, tools=use, gen=dataclasses.replace(req.gen, grammar=grammar))
    return dataclasses.replace(req, tools=use)


def rendered(req: Request, template: ChatTemplate | None) -> str | None:
    """The request's conversation as `template` renders it (None: no conversation), with its tools
    and template variables: `chat_template_kwargs`, and `enable_thinking` from `thinking` where the
    template takes it."""
    if template is None:
        return None
    extra = dict(req.chat_template_kwargs or {})
    if req.thinking is not None and switchable(template.source):
        extra.setdefault(SWITCH, req.thinking)
    return template.render(list(req.messages), tools=req.tools, **extra)


def with_reasoning(req: Request, template: ChatTemplate | None, text: str | None) -> Request:
    """A chat with a model that thinks: its reasoning block (`text`: the rendered prompt, which may
    have opened it). Thinking off where the template has no switch for it: a budget of 0 tokens, the
    block closed as it opens."""
    reasoning = reasoning_of(template.source, text) if template is not None else None
    if reasoning is None:
        return req
    gen = req.gen
    if req.thinking is False and not switchable(template.source):
        gen = dataclasses.replace(gen, thinking_budget=0)
    return dataclasses.replace(req, reasoning=reasoning, gen=gen)


def prompt_ids(loaded: LoadedModel, req: Request, text: str | None) -> list[int] | None:
    """The request's prompt as ids: its conversation as the chat template rendered it (`text`, BOS
    written by the template), its ids, or its text; None for an empty prompt that continues a
    resumed state."""
    tok = loaded.tokenizer
    if text is not None:
        return tok.encode(text, add_bos=False)
    if req.ids is not None:
        vocab = loaded.config.vocab_size
        if max(req.ids) >= vocab or min(req.ids) < 0:
            raise LarqlError(f"`prompt` token ids must be in [0, {vocab})")
        return list(req.ids)
    if req.prompt == "" and req.resume is not None:
        return None
    return tok.encode(req.prompt)


def fit_context(gen: GenerationConfig, prompt_tokens: int, context: int) -> tuple[GenerationConfig, list[str]]:
    """The prompt and its output must fit the model's context: a prompt that fills it is refused; a
    `max_tokens` past it is capped to what is left, and the note says so."""
    if gen.max_tokens and prompt_tokens >= context:
        raise LarqlError(f"the prompt is {prompt_tokens:,} tokens; the model's context is {context:,} positions, "
                         "so nothing can be generated after it")
    room = context - prompt_tokens
    if gen.max_tokens <= room:
        return gen, []
    note = (f"`max_tokens` {gen.max_tokens:,} capped to {room:,}: the prompt's {prompt_tokens:,} tokens and the "
            f"output must fit the model's context of {context:,} positions")
    return dataclasses.replace(gen, max_tokens=room), [note]


def branch_settings(gen: GenerationConfig, i: int) -> GenerationConfig:
    """Branch i's settings: a given seed moves by i, so that sampled branches differ and each is
    reproducible."""
    seed = gen.sampling.seed
    if seed is None or i == 0:
        return gen
    return dataclasses.replace(gen, sampling=dataclasses.replace(gen.sampling, seed=seed + i))
