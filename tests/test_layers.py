"""Imports flow one way, bottom to top (docs/architecture.md draws the map):

    errors, files, budget -> kernels -> engines -> model, weights, text, convert -> state, calibration,
    config -> decode -> pipeline -> api, batch -> tools -> cli, server

No cycles, counting imports inside functions too (so none can hide one), and a function-level import
only where a path does without a heavy dependency (see docs/architecture.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from imports import edges, find_cycle

ROOT = Path(__file__).resolve().parent.parent / "larqlpy"
LAYERS = [
    ("larqlpy._version", "larqlpy.errors", "larqlpy.files", "larqlpy.budget"),
    ("larqlpy.kernels",),
    ("larqlpy.engines",),
    ("larqlpy.model", "larqlpy.weights", "larqlpy.text", "larqlpy.convert"),
    ("larqlpy.state", "larqlpy.calibration", "larqlpy.config"),
    ("larqlpy.decode",),
    ("larqlpy.pipeline", "larqlpy"),
    ("larqlpy.api", "larqlpy.batch"),
    ("larqlpy.tools",),
    ("larqlpy.cli", "larqlpy.server"),
]
# Imports inside functions outside cli/ (which defers all of them, for start-up): optional
# heavy libraries, and the torch-side stores a torch-free provider builds when it makes a state.
DEFERRED_OK = ("matplotlib", "transformers", "llama_cpp", "ray")


def layer(module: str) -> int:
    best = None
    for i, names in enumerate(LAYERS):
        for n in names:
            if module == n or module.startswith(n + "."):
                if best is None or len(n) > len(best[1]):
                    best = (i, n)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


GRAPH = edges(ROOT)


def test_the_graph_is_read():
    assert len(GRAPH) > 100 and any(e.deferred for e in GRAPH)


def test_no_import_cycle():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_every_import_points_down_or_across():
    up = [f"{e.src}:{e.line} imports {e.dst}" for e in GRAPH if layer(e.dst) > layer(e.src)]
    assert not up, "\n".join(up)


def test_function_level_imports_are_only_deferred_heavy_ones():
    import ast

    bad = []
    for f in ROOT.rglob("*.py"):
        if "cli" in f.relative_to(ROOT).parts:
            continue
        tree = ast.parse(f.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    for name in names:
                        store = name.startswith("larqlpy.engines.stores") and f.parent == ROOT / "engines"
                        if not store and name.split(".")[0] not in DEFERRED_OK:
                            bad.append(f"{f.relative_to(ROOT)}:{node.lineno} {fn.name} imports {name}")
    assert not bad, "\n".join(bad)


def write_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in {"__init__": "", **files}.items():
        path = pkg / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


@pytest.mark.parametrize("b_imports_a", [
    "import pkg.a\n",
    "def f():\n    from pkg import a  # hidden in a function\n",
    "def f():\n    from . import a\n",
])
def test_a_planted_cycle_is_found(tmp_path, b_imports_a):
    pkg = write_package(tmp_path, {"a": "from pkg.b import thing\n", "b": b_imports_a, "c": "import pkg.a\n"})
    cycle = find_cycle(edges(pkg))
    assert cycle is not None and set(cycle) == {"pkg.a", "pkg.b"}
    ok = write_package(tmp_path / "ok", {"a": "from pkg.b import thing\n", "b": "x = 1\n", "c": "import pkg.a\n"})
    assert find_cycle(edges(ok)) is None


def test_a_planted_upward_import_is_found(tmp_path):
    pkg = write_package(tmp_path, {"kernels.k": "def f():\n    from pkg.cli import main\n",
                                   "cli": "import pkg.kernels.k\n"})
    got = {(e.src, e.dst, e.deferred) for e in edges(pkg)}
    assert ("pkg.kernels.k", "pkg.cli", True) in got and ("pkg.cli", "pkg.kernels.k", False) in got
