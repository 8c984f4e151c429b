"""Helpers run as separate processes by the state tests: `python tests/workers.py KIND ...`."""

from __future__ import annotations

import sys

import torch


def resume_and_decode(model_dir: str, state_path: str, n: str, out: str, weights: str = "f32") -> None:
    from larqlpy.generate import GenerationConfig, stream_generate
    from larqlpy.model.loader import load
    from larqlpy.session import resume

    loaded = load(model_dir, device="cpu", weights=weights)
    plan, ids = resume(loaded, state_path, None, None)
    toks = list(stream_generate(loaded.model, ids, plan.spec, GenerationConfig(max_tokens=int(n), stop_at_eos=False),
                         state=plan.state, logits=plan.logits))
    torch.save({"ids": [t.id for t in toks], "logits": torch.stack([t.logits for t in toks])}, out)


def save_forever(model_dir: str, state_path: str) -> None:
    """Grow a state and save it over the same file, as fast as it goes, until killed."""
    from larqlpy.engines import EngineSpec, build_provider
    from larqlpy.model.loader import load
    from larqlpy.session import save

    loaded = load(model_dir, device="cpu")
    state = build_provider(EngineSpec()).new_state(loaded.model.geometries(), loaded.device)
    ids = []
    i = 0
    while True:
        block = [7 + (i * 31 + j * 7) % 280 for j in range(8)]
        state.last_logits = loaded.model(torch.tensor(block), state)[-1]
        ids += block
        save(loaded, state_path, state, ids)
        print(len(ids), flush=True)
        i += 1


if __name__ == "__main__":
    {"resume": resume_and_decode, "save-forever": save_forever}[sys.argv[1]](*sys.argv[2:])
