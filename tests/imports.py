"""The import graph of a package, read from its source with `ast` (nothing is imported): every
import statement, at module level or inside a function, resolved to the package's own modules."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    deferred: bool  # inside a function body


def module_name(root: Path, file: Path) -> str:
    parts = list(file.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def edges(root: Path) -> list[Edge]:
    """Every import between modules of the package at `root` (a directory with __init__.py)."""
    files = {module_name(root, f): f for f in root.rglob("*.py")}
    out = []
    for name, file in files.items():
        tree = ast.parse(file.read_text(), str(file))
        deferred = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(fn)}
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:  # `import a.b.c` of a module we have: its nearest known name
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.append(Edge(name, t, node.lineno, id(node) in deferred))
    return out


def find_cycle(graph: list[Edge]) -> list[str] | None:
    """A cycle of modules (first == last), or None."""
    nexts: dict[str, list[str]] = {}
    for e in graph:
        nexts.setdefault(e.src, []).append(e.dst)
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in nexts.get(m, ()):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(nexts):
        if m not in state and (found := visit(m)):
            return found
    return None
