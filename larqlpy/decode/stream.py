"""One sequence over the model, as mlx-lm layers `generate_step` under `stream_generate`:

- `generate_step(model, seq)`: run the sequence's blocks (its prompt in chunks, then a row per
  token) and yield its tokens until it finishes;
- `stream_generate(model, prompt_ids, spec, cfg, ...)`: a sequence made from a prompt, streamed.

"""

from __future__ import annotations

from typing import Iterable, Iterator
from typing import Sequence as Ids

from larqlpy.config import GenerationConfig
from larqlpy.decode.output import Token
from larqlpy.decode.sequence import Sequence
from larqlpy.engines import EngineSpec
from larqlpy.kernels.threads import LoadFollower
from larqlpy.state.sources import Given, Held


def generate_step(model, seq: Sequence) -> Iterator[Token]:
    """The sequence's tokens, one forward pass of its own rows at a time, until it finishes (the
    kernels' thread count following the load, as the scheduler's)."""
    follow = LoadFollower(on=model.device.type == "cpu")
    seq.start()
    while not seq.finished:
        follow()
        yield from seq.sample() if seq.ready else seq.feed(model.forward_many([seq.block()])[0])


def stream_generate(model, prompt_ids: Ids[int], spec: EngineSpec = EngineSpec(),
                    cfg: GenerationConfig = GenerationConfig(), stop_ids: Iterable[int] = (), tokenizer=None,
                    held: Held | None = None) -> Iterator[Token]:
    """The tokens generated after `prompt_ids`. `held`: a state to run on, which may already hold a
    prefix of them (only the rest is prefilled); the caller keeps it."""
    source = Given(held) if held is not None else None
    yield from generate_step(model, Sequence(model, list(prompt_ids), spec, cfg, stop_ids=stop_ids,
                                             tokenizer=tokenizer, source=source))
