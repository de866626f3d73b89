"""The walls of pagedrun/: no import circle between modules, and packages stacked as layers.

The graph of which module imports which (every import statement, those inside functions too, read
with ast, nothing executed) has no cycle; collapsed to packages (a top-level module counts as a
package of its own) it has none either, and every import runs down the LAYERS below. kv/ and
engine/ hold no tensors: they never import torch, and the engine reaches the tensors only through
worker/worker.py.

A deferred import inside a function hides a circle from Python but not from the design: data flows
one way, and a helper two packages need lives below both (docs/design/architecture.md).
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pagedrun"

# Lowest first: a package may import itself and the packages before it, never one after it.
LAYERS = ("errors", "console", "build", "structured", "sampling_params", "outputs", "io", "config", "kv",
          "sample", "attention", "models", "worker", "report", "engine", "llm", "bench", "cli", "__main__",
          "__init__")
TENSOR_FREE = ("kv", "engine")


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module `name` names, or the nearest package of ours above it (`a.b.func` -> `a.b`)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(mod: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of pagedrun that `mod` imports anywhere in its text.

    `from pkg import x` is an edge to the submodule pkg.x when there is one, else to pkg itself
    (its __init__). A package's own __init__ is not counted as imported by its submodules: Python
    runs it first, but it is the package's face, not a dependency of what it re-exports.
    """
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pagedrun":
                    out.add(_resolve(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package that holds `mod`
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] != "pagedrun":
                continue
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                out.add(sub if sub in known else _resolve(src, known))
    out.discard(None)
    out.discard(mod)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(m, p, known) for m, p in known.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        # Iterative, so a deep package cannot hit the recursion limit.
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, set(c)) for c in sccs]


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A concrete circle a -> b -> ... -> a inside one strongly connected component (BFS back to a)."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)


def test_pagedrun_has_no_import_cycle():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_graph_sees_imports_inside_functions_and_relative_ones():
    graph = import_graph()
    # cli/generate.py imports the LLM facade and Ray only inside run_generate (torch is slow to import).
    assert "pagedrun.llm" in graph["pagedrun.cli.generate"]
    assert "pagedrun.cli.ray" in graph["pagedrun.cli.generate"]
    assert len(graph) > 50  # every module was read


def unit_of(mod: str) -> str:
    """The layer a module belongs to: its package under pagedrun/, or itself when top-level."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        units.setdefault(unit_of(mod), set()).update(unit_of(d) for d in deps)
    for u, deps in units.items():
        deps.discard(u)
    return units


def imports_up(graph: dict[str, set[str]]) -> list[str]:
    rank = {u: i for i, u in enumerate(LAYERS)}
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if rank[unit_of(d)] > rank[unit_of(m)])


def test_every_package_has_a_layer():
    assert set(unit_graph(import_graph())) == set(LAYERS)


def test_packages_have_no_import_cycle():
    cycles = find_cycles(unit_graph(import_graph()))
    assert not cycles, "package circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_run_down_the_layers():
    up = imports_up(import_graph())
    assert not up, "imports that run up a layer (LAYERS, lowest first):\n" + "\n".join(up)


def test_layer_checks_see_what_is_there():
    assert imports_up({"pagedrun.kv.manager": {"pagedrun.engine.scheduler"}, "pagedrun.engine.scheduler": set()})
    assert not imports_up({"pagedrun.engine.scheduler": {"pagedrun.kv.manager"}, "pagedrun.kv.manager": set()})
    assert find_cycles(unit_graph({"pagedrun.kv.a": {"pagedrun.engine.b"}, "pagedrun.engine.b": {"pagedrun.kv.a"}}))


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            roots.add((node.module or "").split(".")[0])
    return roots


@pytest.mark.parametrize("package", TENSOR_FREE)
def test_tensor_free_packages_import_no_torch(package):
    heavy = {"torch", "numpy", "cupy"}
    found = sorted(f"{m} imports {', '.join(sorted(_imported_roots(p) & heavy))}" for m, p in modules().items()
                   if unit_of(m) == package and _imported_roots(p) & heavy)
    assert not found, "\n".join(found)


def test_kv_imports_only_itself():
    outside = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if unit_of(m) == "kv"
                     for d in deps if unit_of(d) != "kv")
    assert not outside, "\n".join(outside)


def test_engine_reaches_tensors_only_through_the_worker():
    below_the_wall = {"worker", "sample", "attention", "models", "build"}
    found = sorted(f"{m} -> {d}" for m, deps in import_graph().items() if unit_of(m) == "engine" for d in deps
                   if unit_of(d) in below_the_wall and d != "pagedrun.worker.worker")
    assert not found, "\n".join(found)


def test_the_core_runs_without_torch_loaded():
    """Executed, not read: importing the engine and the KV manager loads neither torch nor numpy."""
    code = ("import sys; import pagedrun.engine.engine, pagedrun.engine.scheduler, pagedrun.kv.manager; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("graph, has_cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, True),
])
def test_find_cycles_finds_what_is_there(graph, has_cycle):
    cycles = find_cycles(graph)
    assert bool(cycles) == has_cycle
    for c in cycles:
        assert c[0] == c[-1] and all(b in graph[a] for a, b in zip(c, c[1:]))
