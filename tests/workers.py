"""Helpers run as separate processes by the state tests: `python tests/workers.py KIND ...`."""

from __future__ import annotations

import sys

import torch


def resume_and_decode(model_dir: str, state_path: str, n: str, out: str, weights: str = "f32",
                      kv_dtype: str = "") -> None:
    from larqlpy.config import GenerationConfig
    from larqlpy.decode.sequence import Sequence
    from larqlpy.decode.stream import generate_step
    from larqlpy.state.saved import FileSource
    from larqlpy.weights.loader import load

    loaded = load(model_dir, device="cpu", weights=weights, kv_dtype=kv_dtype or None)
    source = FileSource(loaded, state_path)
    seq = Sequence(loaded.model, source.tokens, source.spec(None),
                   GenerationConfig(max_tokens=int(n), stop_at_eos=False), source=source)
    toks = list(generate_step(loaded.model, seq))
    torch.save({"ids": [t.id for t in toks], "logits": torch.stack([t.logits for t in toks])}, out)


def save_forever(model_dir: str, state_path: str) -> None:
    """Grow a state and save it over the same file, as fast as it goes, until killed."""
    from larqlpy.state.sources import Held
    from larqlpy.engines import EngineSpec, new_state
    from larqlpy.state.saved import save
    from larqlpy.weights.loader import load

    loaded = load(model_dir, device="cpu")
    state = new_state(EngineSpec(), loaded.model.geometries(), loaded.device)
    ids = []
    i = 0
    while True:
        block = [7 + (i * 31 + j * 7) % 280 for j in range(8)]
        logits = loaded.model(torch.tensor(block), state)[-1]
        ids += block
        save(loaded, state_path, Held(ids, state, logits))
        print(len(ids), flush=True)
        i += 1


if __name__ == "__main__":
    {"resume": resume_and_decode, "save-forever": save_forever}[sys.argv[1]](*sys.argv[2:])
