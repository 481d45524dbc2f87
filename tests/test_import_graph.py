"""The package's import graph has no cycles: imports flow one way.

Every module under ``tokenfab/`` is parsed with :mod:`ast` (nothing is imported or run), and every ``import`` /
``from ... import`` statement found anywhere in it, function-level and ``if TYPE_CHECKING:`` imports included, adds
an edge from the module to the ``tokenfab`` module it names. ``from pkg import name`` points at the submodule
``pkg.name`` when that file exists, else at ``pkg`` (its ``__init__.py``). The implicit import of a parent package
(importing ``tokenfab.a.b`` first runs ``tokenfab/a/__init__.py``) is not an edge: a package's ``__init__``
re-exporting its children is the normal layout, not a circle. Strings given to ``importlib.import_module`` are not
followed.
"""
from __future__ import annotations

import ast
import os

import pytest

import tokenfab

PKG_DIR = os.path.dirname(os.path.abspath(tokenfab.__file__))
PKG = "tokenfab"


def package_modules(pkg_dir: str = PKG_DIR, pkg: str = PKG) -> dict[str, str]:
    """Dotted module name -> file path for every ``.py`` file below ``pkg_dir`` (``__init__`` names the package)."""
    out = {}
    for root, dirs, files in os.walk(pkg_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(root, pkg_dir)
        parts = [pkg] + ([] if rel == "." else rel.split(os.sep))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            name = ".".join(parts if f == "__init__.py" else parts + [f[:-3]])
            out[name] = os.path.join(root, f)
    return out


def _resolve(module: str, path: str, node: ast.ImportFrom) -> str:
    """The absolute dotted name ``from <node.module> import`` refers to, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.endswith("__init__.py") else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (see the module docstring for what counts)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, path, node)
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]
            for t in targets:
                while t and t not in modules:  # ``import tokenfab.a.b`` of a non-module attribute: its package
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges[mod].add(t)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each as one cycle path through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth <= number of modules (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_cycle_path(c, edges) for c in comps]


def _cycle_path(comp: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A closed path start -> ... -> start inside one strongly connected component (breadth-first)."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def test_graph_helpers_find_a_hand_made_cycle(tmp_path):
    """A 3-package tree with a -> b -> c -> a (one of them a function-level, one a relative import) and d -> a."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "sub" / "c.py").write_text("import p.a\ng = 1\n")
    (pkg / "d.py").write_text("from p.a import thing\nimport os\n")
    mods = package_modules(str(pkg), "p")
    assert set(mods) == {"p", "p.a", "p.d", "p.sub", "p.sub.b", "p.sub.c"}
    edges = import_edges(mods)
    assert edges["p.a"] == {"p.sub.b"}
    assert edges["p.sub.b"] == {"p.sub.c"}
    assert edges["p.sub.c"] == {"p.a"}
    assert edges["p.d"] == {"p.a"}
    assert find_cycles(edges) == [["p.a", "p.sub.b", "p.sub.c", "p.a"]]
    (pkg / "sub" / "c.py").write_text("g = 1\n")
    assert find_cycles(import_edges(mods)) == []


def test_package_import_graph_has_no_cycles():
    modules = package_modules()
    assert len(modules) > 50, f"found only {len(modules)} modules under {PKG_DIR}"
    cycles = find_cycles(import_edges(modules))
    if cycles:
        pytest.fail("import circles (make the imports flow one way):\n" +
                    "\n".join("  " + " -> ".join(c) for c in cycles))
