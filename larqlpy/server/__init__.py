"""`larqlpy serve` as a library: `serve(loaded, config)` (server/main.py) assembles the budget, the
kept states, the engine thread and the app, and runs it under uvicorn until SIGTERM / Ctrl-C;
`listen(host, port)` (server/bind.py) binds its socket first, before any weights load. Imported on
first use, so binding (and refusing a busy port) costs no torch."""

import importlib

_EXPORTS = {"serve": "larqlpy.server.main", "assemble": "larqlpy.server.main", "listen": "larqlpy.server.bind"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'larqlpy.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
