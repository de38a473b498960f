"""The package's import structure: every module imports alone in a fresh interpreter,
`mpilab.rank` (the code that runs on the ranks) imports nothing of the notebook side,
and no modules import each other in a circle, counting imports made inside functions
(a circle hidden in a function still ties the modules' designs together)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# import name -> folder, as pyproject.toml's package-dir maps them
PACKAGES = {"mpilab": ROOT / "kernel_ext", "mpilab.rank": ROOT / "kernel_ext" / "rank",
            "mpilab.widgets": ROOT / "widgets"}
# the modules both sides share: what crosses between them (the records' schema and
# reports), the lifeline's two ends (the kernel listens, each rank's supervisor holds)
# and the choice of the network address to listen on
SHARED = {"mpilab.wire", "mpilab.lifeline", "mpilab.endpoint"}
# what the ranks may import of the package besides mpilab.rank: the package itself (its
# names resolve lazily), its lazy-name helper, and the shared modules
RANK_MAY_IMPORT = {"mpilab", "mpilab._lazy", "mpilab.rank", *SHARED}


def _modules() -> dict[str, Path]:
    """Every module of the package by import name (a package by its __init__)."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom | ast.Import, is_package: bool) -> list[str]:
    """The modules of the package an import statement in `module` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            parts = module.split(".")
            base = parts if is_package else parts[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix
                 for alias in node.names]
    return [name for name in names if name in MODULES]


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its code (module level and
    functions; TYPE_CHECKING blocks left out: they never run). An import of a package the
    module is inside (`import mpilab` in mpilab.rank.engine) is no edge: importing the
    module has imported it already."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                    and "TYPE_CHECKING" in ast.unparse(node.test)
                    for stmt in node.body for n in ast.walk(stmt)}
        graph[module] = {target for node in ast.walk(tree)
                         if isinstance(node, ast.Import | ast.ImportFrom)
                         and id(node) not in checking
                         for target in _target(module, node, path.stem == "__init__")
                         if not (module + ".").startswith(target + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _path(graph: dict[str, set[str]], group: list[str]) -> str:
    """One circle through the group's first module, as `a -> b -> a`."""
    start = group[0]
    members = set(group)
    trail = [start]
    seen = {start}
    while True:
        nxt = sorted(m for m in graph[trail[-1]] if m in members)
        back = [m for m in nxt if m == start]
        if back and len(trail) > 1:
            return " -> ".join([*trail, start])
        fresh = [m for m in nxt if m not in seen]
        if not fresh:
            return " -> ".join([*trail, "…"])
        trail.append(fresh[0])
        seen.add(fresh[0])


def test_no_modules_import_each_other_in_a_circle():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        f"{', '.join(group)} (e.g. {_path(graph, group)})" for group in found)


def test_rank_code_names_nothing_of_the_notebook_side():
    """Anywhere in its code, functions included: the ranks never load the notebook's
    modules (a rank has no kernel, no widgets, no ZMQ receiver)."""
    graph = import_graph()
    wrong = {module: sorted(t for t in targets if not _rank_may(t))
             for module, targets in graph.items() if _is_rank(module)}
    assert not {m: t for m, t in wrong.items() if t}


def test_shared_modules_import_nothing_of_either_side():
    graph = import_graph()
    assert {module: sorted(graph[module]) for module in SHARED} == \
        {module: [] for module in SHARED}


def _is_rank(module: str) -> bool:
    return module == "mpilab.rank" or module.startswith("mpilab.rank.")


def _rank_may(module: str) -> bool:
    return _is_rank(module) or module in RANK_MAY_IMPORT


_LOADED = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m == "mpilab" or m.startswith("mpilab."))))
"""


def _import_alone(module: str) -> tuple[str, subprocess.CompletedProcess]:
    return module, subprocess.run([sys.executable, "-c", _LOADED, module], cwd=ROOT,
                                  capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def imported_alone() -> dict[str, subprocess.CompletedProcess]:
    """Each module imported alone in a fresh interpreter (two at a time: most of the
    time goes to torch and IPython, one core each)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(_import_alone, sorted(MODULES)))


def test_every_module_imports_alone(imported_alone):
    failed = {module: run.stderr.strip().splitlines()[-1:]
              for module, run in imported_alone.items() if run.returncode}
    assert not failed


def test_importing_rank_code_loads_nothing_of_the_notebook_side(imported_alone):
    loaded = {module: [m for m in json.loads(run.stdout.splitlines()[-1]) if not _rank_may(m)]
              for module, run in imported_alone.items() if _is_rank(module) and not run.returncode}
    assert loaded and not {m: notebook for m, notebook in loaded.items() if notebook}


def test_the_graph_reads_relative_imports_and_finds_circles():
    """The checker itself, on this package's modules and on a made-up graph."""
    graph = import_graph()
    assert "mpilab.wire" in graph["mpilab.rank.agent"]  # from ..wire import …
    assert "mpilab.rank.agent" in graph["mpilab.rank.bootstrap"]  # from . import agent
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _path({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c"]) == "a -> b -> c -> a"
