"""`serve(loaded, config)`: the budget, the kept states, the engine thread and the app, run under
uvicorn until SIGTERM / Ctrl-C -- and then drained: new requests get 503 while the ones in flight
finish, for up to `shutdown_grace_s`; what is still running then is cut off with its answer ended
properly (`Draining`). Only then does uvicorn close its socket; the kept states go to disk last."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Callable

import uvicorn
from sse_starlette.sse import AppStatus

from larqlpy.budget import KVBudget
from larqlpy.calibration import ensure as ensure_calibration
from larqlpy.config import ServeConfig
from larqlpy.errors import LarqlError
from larqlpy.pipeline.request import Request
from larqlpy.server.app import Served, build_app
from larqlpy.server.bind import listen
from larqlpy.server.engine import ServeEngine
from larqlpy.server.metrics import Metrics
from larqlpy.server.response_store import ResponseStore
from larqlpy.state.prefix_cache import PrefixCache
from larqlpy.text.chat_template import ChatTemplate
from larqlpy.text.template_bounds import TemplateBoundError
from larqlpy.weights.loader import LoadedModel


def chat_template(loaded: LoadedModel) -> bool:
    """Whether the model has a chat template; one past the bounds of rendering on a test
    conversation is refused (TemplateBoundError), before the server answers anything."""
    try:
        template = ChatTemplate.for_tokenizer(loaded.tokenizer)
    except LarqlError:
        return False  # chat requests are refused; completions work
    try:
        template.check()
    except TemplateBoundError as e:
        raise TemplateBoundError(f"{e}; the server renders it with a test conversation before it starts") from None
    return True


def assemble(loaded: LoadedModel, config: ServeConfig, has_template: bool | None = None) -> Served:
    """What the app serves: one KV budget for the live sequences and the kept states beside them.
    `has_template`: `chat_template(loaded)`, when the caller has asked it already."""
    has_template = chat_template(loaded) if has_template is None else has_template
    budget = KVBudget(config.kv_budget)
    cache = PrefixCache(loaded, budget, config.disk_budget, config.state_dir, replica=config.replica)
    engine = ServeEngine(loaded, cache, budget, config.parallel, config.queue_size)
    default = Request(engine=config.engine, continuation=config.continuation, options=config.options)
    return Served(loaded, config.name or Path(loaded.path).resolve().name, engine, cache, config, default,
                  Metrics(engine), has_template, ResponseStore(config.state_dir))


def ready(loaded: LoadedModel, config: ServeConfig) -> Served:
    """`assemble`d, after the checks and the work before the first request: the chat template
    rendered within its bounds (a template that loops is refused before the calibration's prefill),
    the key calibration measured here, not inside the first request's handler."""
    has_template = chat_template(loaded)
    ensure_calibration(loaded, config.spec())
    return assemble(loaded, config, has_template)


def serve(loaded: LoadedModel, config: ServeConfig, announce: Callable[[dict], None] | None = None,
          sock: socket.socket | None = None) -> None:
    """Serve `loaded` as `config` says, on `sock` (bound by `listen` before the weights loaded, or
    now); `announce` hears what it serves before it answers."""
    sock = sock or listen(config.host, config.port)
    s = ready(loaded, config)
    if announce is not None:
        announce({"name": s.name, "weights": loaded.weights, "kv_dtype": loaded.kv_dtype,
                  "engine": config.spec().describe(),
                  "parallel": s.engine.parallel, "kept": len(s.cache.entries), "state_dir": config.state_dir,
                  "url": f"http://{config.host}:{config.port}"})
    AppStatus.disable_automatic_graceful_drain()  # sse-starlette would end every stream at the signal
    # h11 and asyncio, whatever else is installed (ray[serve] brings httptools and uvloop): one behaviour
    server = Draining(uvicorn.Config(build_app(s), log_level="warning", access_log=False, http="h11",
                                     loop="asyncio", timeout_graceful_shutdown=DRAINED_S), s.engine,
                      config.shutdown_grace_s)
    server.run(sockets=[sock])


DRAINED_S = 5  # after the drain, what uvicorn waits for the last answers to be sent


class Draining(uvicorn.Server):
    """uvicorn with a drain before its shutdown. The first SIGTERM or Ctrl-C stops the engine taking
    requests (503) and keeps the socket open; when nothing is in flight, or `grace` seconds have
    passed and what was left has been cut off, uvicorn shuts down as usual. A second Ctrl-C is
    uvicorn's own (a forced exit)."""

    def __init__(self, config: uvicorn.Config, engine: ServeEngine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.drain_until: float | None = None
        self.cut = False

    def handle_exit(self, sig, frame) -> None:
        if self.drain_until is not None:
            return super().handle_exit(sig, frame)
        self._captured_signals.append(sig)  # raised again once uvicorn has finished, as it does
        self.drain_until = time.monotonic() + self.grace
        self.engine.drain()

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and not self.should_exit:
            if not self.engine.handles:
                self.should_exit = True
                AppStatus.should_exit = True
            elif time.monotonic() >= self.drain_until and not self.cut:
                self.engine.cut_off()
                self.cut = True
        return await super().on_tick(counter)
