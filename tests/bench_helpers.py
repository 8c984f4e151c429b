"""The bench's measurement functions, importable from tests (bench/ is not a package)."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("kv_mixed", Path(__file__).resolve().parent.parent / "bench" / "kv_mixed.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
bits_per_value, measure, teacher_forced = _mod.bits_per_value, _mod.measure, _mod.teacher_forced
