"""What the chat template's bounds (larqlpy/text/template_bounds.py) cost on a normal render: the
shipped SmolLM2 and Qwen2.5-Coder templates over a 10-message conversation (a system message, then
user and assistant in turn), rendered by the unbounded sandbox transformers uses, by the bounded
sandbox alone (`ChatTemplate._render`: the checks and the output's count), by that under the
deadline (`within`: the watchdog), and by `ChatTemplate.render` (which also checks the messages and
converts tool calls, as it did before the bounds), taking turns so a noisy host slows all alike.
Prints the median and minimum µs a render of each. Asserts that all render the same text.

    python bench/template_bounds.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from larqlpy.text import chat_template as ct
from larqlpy.text.template_bounds import within

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"SmolLM2-135M": ROOT / "models/smollm2-135m-instruct",
          "Qwen2.5-Coder-0.5B": ROOT / "models/qwen2.5-coder-0.5b-instruct"}
ASKED, ANSWERED = "What is the capital of France, and why? ", "Paris, since 508. "
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}] + [
    {"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: " + (ASKED if i % 2 == 0 else ANSWERED) * 3}
    for i in range(9)]


def unbounded(source: str):
    """The sandbox as transformers builds it (and as larqlpy did before the bounds)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[ct._Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = ct._tojson
    env.globals.update(raise_exception=ct._raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=ct._TemplateDict(), namespace=ct._Namespace)
    return env.from_string(source)


def timed(f, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    for name, path in MODELS.items():
        config = json.loads((path / "tokenizer_config.json").read_text())
        source = config["chat_template"]
        special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        bounded = ct.ChatTemplate(source, special, name)
        plain = unbounded(source)
        context = dict(messages=CONVERSATION, tools=None, documents=None, add_generation_prompt=True, **special)
        assert bounded.render(CONVERSATION) == plain.render(**context) == within(1.0, bounded._render, context)
        runs = {"unbounded": lambda: plain.render(**context), "bounded sandbox": lambda: bounded._render(context),
                "bounded + deadline": lambda: within(1.0, bounded._render, context),
                "ChatTemplate.render": lambda: bounded.render(CONVERSATION)}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(10):  # in turns
            for k, f in runs.items():
                times[k] += timed(f, args.repeat // 10)
        base = statistics.median(times["unbounded"])
        for k, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:20s} {k:20s} median {med:7.1f} µs  min {min(ts):7.1f} µs  ({med - base:+.1f} µs)")


if __name__ == "__main__":
    main()
