"""larqlpy: LLM inference with pluggable, memory-frugal KV engines.

The Python API (`load`, `Model`, the generation settings) is imported on first use, so importing
`larqlpy` -- or any of its modules, the CLI's among them -- costs nothing until it is needed.
"""

import importlib

from larqlpy._version import __version__

_EXPORTS = {
    "GenerationConfig": "larqlpy.config", "SamplingConfig": "larqlpy.config", "LarqlError": "larqlpy.errors",
    "Model": "larqlpy.api.model", "engine_spec": "larqlpy.api.model", "load": "larqlpy.api.model",
    "Token": "larqlpy.decode.output",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'larqlpy' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
