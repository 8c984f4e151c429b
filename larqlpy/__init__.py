"""larqlpy: Gemma 3 inference with pluggable, memory-frugal KV engines."""

from larqlpy.api import Model, engine_spec, load
from larqlpy.errors import LarqlError
from larqlpy.generate import GenerationConfig, SamplingConfig, Token

__all__ = ["GenerationConfig", "LarqlError", "Model", "SamplingConfig", "Token", "engine_spec", "load"]
__version__ = "0.1.0"
