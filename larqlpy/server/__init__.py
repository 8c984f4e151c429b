"""`larqlpy serve` as a library: `serve(loaded, config)` assembles the budget, the kept states, the
engine thread and the app, and runs it under uvicorn until SIGTERM / Ctrl-C."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import uvicorn

from larqlpy.budget import KVBudget
from larqlpy.config import ServeConfig
from larqlpy.errors import LarqlError
from larqlpy.prefix_cache import PrefixCache
from larqlpy.request import Request
from larqlpy.server.app import Served, build_app
from larqlpy.server.engine import ServeEngine
from larqlpy.server.metrics import Metrics
from larqlpy.text.chat_template import ChatTemplate


def assemble(loaded, config: ServeConfig) -> Served:
    """What the app serves: one KV budget for the live sequences and the kept states beside them."""
    budget = KVBudget(config.kv_budget)
    cache = PrefixCache(loaded, budget, config.disk_budget, config.state_dir)
    engine = ServeEngine(loaded, cache, budget, config.parallel, config.queue_size)
    try:
        ChatTemplate.for_tokenizer(loaded.tokenizer)
        has_template = True
    except LarqlError:
        has_template = False  # chat requests are refused; completions work
    default = Request(engine=config.engine, continuation=config.continuation, options=config.options)
    return Served(loaded, config.name or Path(loaded.path).resolve().name, engine, cache, config, default,
                  Metrics(engine), has_template)


def serve(loaded, config: ServeConfig, announce: Callable[[dict], None] | None = None) -> None:
    """Serve `loaded` as `config` says; `announce` hears what it serves before it listens."""
    s = assemble(loaded, config)
    if announce is not None:
        announce({"name": s.name, "weights": loaded.weights, "engine": config.spec().describe(),
                  "parallel": s.engine.parallel, "kept": len(s.cache.entries), "state_dir": config.state_dir,
                  "url": f"http://{config.host}:{config.port}"})
    uvicorn.run(build_app(s), host=config.host, port=config.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=int(config.shutdown_grace_s))
