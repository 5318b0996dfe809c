"""The import graph of ``src/delta_attn``: no cycle, no import from a higher layer, no operator above another.

Every module is parsed with ``ast`` (nothing is imported): its import statements at module level and inside
functions count, those under ``if TYPE_CHECKING:`` do not (they never run). An edge goes to the module an
import names (``from . import cudnn`` names the module ``cudnn``; ``from .args import AttnArgs`` names
``args``), not to the packages above it that Python initialises on the way. Lazy ``"module:function"``
strings of the backend registry are not imports. The layers are docs/ARCHITECTURE.md's ("Layers").
"""
from __future__ import annotations

import ast
import fnmatch
import importlib.util
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = "delta_attn"

# bottom to top: a module imports from its own layer or the ones below it (docs/ARCHITECTURE.md). Patterns
# (fnmatch) of the module name without the leading "delta_attn."; "" is delta_attn/__init__.py
OPERATORS = ("ops.flash", "ops.diag", "ops.kda")
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("base", ("settings", "_outputs", "_reference_diag", "_install")),
    ("contract", ("reference", "_checks", "backends", "testing")),
    ("ops helpers", ("ops", "ops._*")),
    ("operators", tuple(p for op in OPERATORS for p in (op, op + ".*"))),
    ("public api", ("",)),
    ("layers", ("nn", "nn.*", "distributed", "distributed.*")),
    ("integrations", ("integrations", "integrations.*")),
    ("tools", ("env", "cli", "bench", "bench.*")),
]


def _source_root() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.origin, f"{PACKAGE} is not importable"
    return Path(spec.origin).parent


def _modules(root: Path) -> Dict[str, Tuple[Path, bool]]:
    """Dotted name -> (file, is a package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(node: ast.AST) -> Iterator[ast.stmt]:
    """Every Import / ImportFrom under ``node`` (functions and classes included), except in TYPE_CHECKING blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            for other in child.orelse:
                yield from _imports_of(other)
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST) -> Iterator[ast.stmt]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node)


def import_graph(root: Path) -> Dict[str, Dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}."""
    modules = _modules(root)
    graph: Dict[str, Dict[str, int]] = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        edges: Dict[str, int] = {}
        for node in _imports(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # `from pkg import sub` names the submodule; `from mod import name` the module
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    edges.setdefault(t, node.lineno)
        graph[name] = edges
    return graph


def strongly_connected(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """The groups of two or more modules that import each other, directly or not (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def connect(v: str) -> None:          # recursive: the package is far from the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def find_cycles(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """A shortest cycle (a -> ... -> a) through each edge inside a group of modules that import each other."""
    cycles = []
    for comp in strongly_connected(graph):
        members = set(comp)
        for a in comp:
            for b in sorted(set(graph[a]) & members):
                prev = {b: b}                # breadth first from b back to a, inside the group
                frontier = [b]
                while a not in prev:
                    nxt = []
                    for v in frontier:
                        for w in sorted(graph[v]):
                            if w in members and w not in prev:
                                prev[w] = v
                                nxt.append(w)
                    frontier = nxt
                path = [a]
                while path[-1] != b:
                    path.append(prev[path[-1]])
                cycle = [a] + path[::-1]
                edges = set(zip(cycle, cycle[1:]))
                if all(set(zip(c, c[1:])) != edges for c in cycles):
                    cycles.append(cycle)
    return cycles


def _short(module: str) -> str:
    return module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + ".") else ("" if module == PACKAGE else module)


def layer_of(module: str) -> int:
    """Index in LAYERS of the module's layer."""
    short = _short(module)
    hits = [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(short, p) for p in patterns)]
    assert len(hits) == 1, f"{module} must be in exactly one layer of tests/project/test_import_graph.py, is in {hits}"
    return hits[0]


def _operator(module: str):
    short = _short(module)
    return next((op for op in OPERATORS if short == op or short.startswith(op + ".")), None)


def _edge(graph, a, b) -> str:
    return f"{a} -> {b} (line {graph[a][b]})"


def test_no_import_cycle():
    graph = import_graph(_source_root())
    assert len(graph) > 50, "the source tree was not found"
    cycles = find_cycles(graph)
    report = ["  " + " -> ".join(c) + "\n" + "\n".join("      " + _edge(graph, a, b) for a, b in zip(c, c[1:]))
              for c in cycles]
    assert not cycles, "import cycles in src/delta_attn:\n" + "\n".join(report)


def test_no_import_from_a_higher_layer():
    graph = import_graph(_source_root())
    upward = [f"  {_edge(graph, a, b)}: {LAYERS[layer_of(a)][0]} imports {LAYERS[layer_of(b)][0]}"
              for a, edges in sorted(graph.items()) for b in edges if layer_of(b) > layer_of(a)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_operator_imports_another():
    graph = import_graph(_source_root())
    across = [f"  {_edge(graph, a, b)}" for a, edges in sorted(graph.items()) for b in edges
              if _operator(a) and _operator(b) and _operator(a) != _operator(b)]
    assert not across, ("an operator package imports another (shared helpers belong in ops/_*.py):\n"
                        + "\n".join(across))


def test_the_checker_sees_what_it_must(tmp_path):
    """The parser on a made-up package: function-level imports count, TYPE_CHECKING ones do not."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
                              "def f():\n    from .sub import c\n")
    (pkg / "b.py").write_text("from . import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from ..b import x\n")
    graph = import_graph(pkg)
    assert graph[f"{PACKAGE}.a"] == {f"{PACKAGE}.sub.c": 5}
    assert graph[f"{PACKAGE}.b"] == {f"{PACKAGE}.a": 1}
    assert graph[f"{PACKAGE}.sub.c"] == {f"{PACKAGE}.b": 1}
    assert find_cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.sub.c", f"{PACKAGE}.b", f"{PACKAGE}.a"]]
