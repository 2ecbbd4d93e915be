"""The package reads bottom-up: no import circle between its units, none inside a subpackage.

Every module under megatron_rl/ is parsed (nothing is imported): module-level AND function-level
imports count (a lazy import hides a circle from Python, not from a reader), so do ``if
TYPE_CHECKING:`` blocks (they never run, but a type a module names is part of what a reader must
know), and ``importlib.import_module("megatron_rl....")`` with a literal
name counts like an import. A unit is a top-level module (``config``, ``trainer``, ...) or a whole
subpackage (``algos``, ``models``, ``weights``, ``rollout``, ``demo``).

Enforced:
* the graph between units has no cycle (a strongly connected component of more than one unit fails,
  naming one cycle with the import lines that make it);
* inside each subpackage, the graph between its modules has no cycle;
* the leaves (:data:`LEAVES`) import nothing from the package but ``errors`` (the bottom leaf, which
  imports nothing);
* the layering config -> parallel -> weights -> models -> rollout/ppo/reward -> run -> roles ->
  trainer -> train
  (:data:`LAYERS`, bottom first): no unit reaches, through any chain of imports, a unit of a
  higher layer.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = "megatron_rl"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

LEAVES = ("model_args", "errors", "dotted", "job_secret", "seeds")
"""Units every layer may import: they import nothing from the package but ``errors`` (a model refused by
``model_args`` raises its one-line error)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),
    ("parallel",),
    ("weights",),
    ("models",),
    ("rollout", "ppo", "ppo_loop", "reward"),
    ("run",),
    ("roles",),
    ("trainer",),
    ("train",),
)
"""The package's backbone, bottom first: a unit never reaches one of a later layer."""

Edge = tuple[str, str, str]
"""(importing module, imported module, "path:line" of the import)."""


# --------------------------------------------------------------------------------------------------
# Reading the imports
# --------------------------------------------------------------------------------------------------


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package (a package is its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(source: str, module: str, is_package: bool, known: set[str], where: str = "?") -> list[Edge]:
    """The package-internal imports of one module's source, at any depth, TYPE_CHECKING blocks too."""
    package = module if is_package else module.rpartition(".")[0]
    edges: list[Edge] = []

    def target(name: str, line: int) -> None:
        # the longest known module that ``name`` names (``a.b.func`` -> ``a.b``)
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            edges.append((module, name, f"{where}:{line}"))

    class Visitor(ast.NodeVisitor):
        def visit_Import(self, node: ast.Import) -> None:
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    target(alias.name, node.lineno)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source_mod = ".".join(base + ([node.module] if node.module else []))
            else:
                source_mod = node.module or ""
            if not (source_mod == PACKAGE or source_mod.startswith(PACKAGE + ".")):
                return
            for alias in node.names:
                full = f"{source_mod}.{alias.name}"
                target(full if full in known else source_mod, node.lineno)  # a submodule, or a name

        def visit_Call(self, node: ast.Call) -> None:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                value = node.args[0].value
                if isinstance(value, str) and value.startswith(PACKAGE):
                    target(value, node.lineno)
            self.generic_visit(node)

    Visitor().visit(ast.parse(source))
    return edges


def module_edges(root: Path = ROOT) -> list[Edge]:
    modules = _modules(root)
    known = set(modules)
    edges: list[Edge] = []
    for name, path in modules.items():
        rel = f"{PACKAGE}/{path.relative_to(root)}"
        edges += imports_of(path.read_text(), name, path.name == "__init__.py", known, rel)
    return edges


def unit_of(module: str) -> str:
    """``megatron_rl.weights.legacy`` -> ``weights``; ``megatron_rl.config`` -> ``config``. A package's
    ``__main__`` (its command line: run, never imported, so it adds nothing to what importing the
    package pulls in) is a unit of its own: ``megatron_rl.config.__main__`` -> ``config.__main__``."""
    parts = module.split(".")
    if len(parts) > 2 and parts[-1] == "__main__":
        return ".".join(parts[1:])
    return parts[1] if len(parts) > 1 else PACKAGE


# --------------------------------------------------------------------------------------------------
# Graphs
# --------------------------------------------------------------------------------------------------


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, in discovery order."""
    nodes = sorted(set(graph) | {w for ws in graph.values() for w in ws})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one node."""
    cycles = []
    for comp in strongly_connected(graph):
        if len(comp) < 2:
            continue
        members = set(comp)
        # breadth-first from comp[0] back to itself, inside the component: a shortest cycle through it
        start, parent = comp[0], {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, ())):
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        path, v = [start], parent[start]
        while v != start:
            path.append(v)
            v = parent[v]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _describe(cycle: list[str], why: dict[tuple[str, str], list[str]]) -> str:
    steps = []
    for a, b in itertools.pairwise(cycle):
        lines = list(dict.fromkeys(why[a, b]))[:3]  # the first few import lines behind the edge
        steps.append(f"{a} -> {b} ({', '.join(lines)})")
    return " -> ".join(cycle) + "\n    " + "\n    ".join(steps)


def unit_graph(edges: list[Edge]) -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    graph: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], list[str]] = defaultdict(list)
    for src, dst, where in edges:
        a, b = unit_of(src), unit_of(dst)
        if a != b:
            graph[a].add(b)
            why[a, b].append(where)
    return graph, why


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return module_edges()


def test_no_cycle_between_units(edges):
    graph, why = unit_graph(edges)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between units of megatron_rl:\n" + "\n".join(
        _describe(c, why) for c in cycles
    )


def test_no_cycle_inside_a_subpackage(edges):
    graph: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], list[str]] = defaultdict(list)
    subpackages = {m for m, p in _modules().items() if p.name == "__init__.py" and m != PACKAGE}
    for src, dst, where in edges:
        if unit_of(src) == unit_of(dst) and f"{PACKAGE}.{unit_of(src)}" in subpackages:
            graph[src].add(dst)
            why[src, dst].append(where)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles inside a subpackage:\n" + "\n".join(_describe(c, why) for c in cycles)


def test_leaves_import_nothing_from_the_package(edges):
    found = [
        f"{src} imports {dst} ({where})"
        for src, dst, where in edges
        if unit_of(src) in LEAVES and (unit_of(dst) != "errors" or unit_of(src) == "errors")
    ]
    assert not found, "\n".join(found)


def test_layering(edges):
    graph, _ = unit_graph(edges)
    units = {unit_of(m) for m in _modules()}
    assert {u for layer in LAYERS for u in layer} <= units, "a unit of LAYERS no longer exists"
    wrong = []
    for i, layer in enumerate(LAYERS):
        above = {u for later in LAYERS[i + 1 :] for u in later}
        for unit in layer:
            for hit in sorted(reachable(graph, unit) & above):
                wrong.append(f"{unit} reaches {hit}, a unit of a higher layer")
    assert not wrong, "\n".join(wrong)


def test_every_kind_of_import_is_seen():
    """The reader sees function-level, relative, importlib and TYPE_CHECKING imports."""
    source = (
        "from __future__ import annotations\n"
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "import megatron_rl.a\n"
        "from megatron_rl import b\n"
        "from . import c\n"
        "from .d import name\n"
        "if TYPE_CHECKING:\n"
        "    from megatron_rl import hidden\n"
        "def f():\n"
        "    from megatron_rl.e import g\n"
        "    importlib.import_module('megatron_rl.h')\n"
    )
    known = {f"megatron_rl.{x}" for x in ("a", "b", "c", "d", "e", "h", "hidden", "x")}
    got = {dst for _, dst, _ in imports_of(source, "megatron_rl.x", False, known)}
    assert got == {f"megatron_rl.{x}" for x in ("a", "b", "c", "d", "e", "h", "hidden")}


def test_cycle_detector_finds_a_planted_cycle():
    """Negative control: the detector is not vacuous."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}}) == []  # a self-import is not a circle between units
    assert find_cycles({"a": {"b"}, "b": {"c"}, "e": {"a", "c"}}) == []
    graph, _ = unit_graph(
        [
            ("megatron_rl.models.x", "megatron_rl.weights.y", "1"),
            ("megatron_rl.weights.z", "megatron_rl.models", "2"),
        ]
    )
    assert find_cycles(graph) == [["models", "weights", "models"]]


def test_architecture_doc_names_only_modules_that_exist():
    import re

    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w/]+\.py)`", doc)) | set(re.findall(r"`(\w+/)`", doc))
    missing = []
    for name in named:
        candidates = [ROOT / name, *ROOT.glob(f"*/{name}")] if name.endswith(".py") else [ROOT / name]
        if name.startswith(("tests/", "docs/")):
            candidates = [ROOT.parent / name]
        if not any(c.exists() for c in candidates) and not (ROOT.parent / name).exists():
            missing.append(name)
    assert not missing, f"docs/architecture.md names modules that do not exist: {sorted(missing)}"
