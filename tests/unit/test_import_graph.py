"""The import graph of the product (``rlframe``, ``workers``) has no circles, counting lazy
imports inside functions and imports under ``TYPE_CHECKING`` too, and ``rlframe`` never
imports ``workers``: read from the source with ``ast``, nothing is imported. And what a fresh
interpreter imports with the driver's modules: a child process, since this one has imported
everything already."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rlframe", "workers")


def list_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the product packages."""
    modules = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest product module that ``name`` (a module or a module's attribute) names."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def read_imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Product modules ``module`` imports anywhere in its file."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names] or [base]
        for name in names:
            target = resolve(name, modules)
            if target is not None and target != module:
                found.add(target)
    return found


def build_graph() -> dict[str, set[str]]:
    modules = list_modules()
    return {m: read_imports(m, p, modules) for m, p in modules.items()}


def find_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted.

    A package's ``__init__`` importing its own submodules is not a circle by itself: a
    submodule's import of its package is implicit, not an edge here."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circles() -> None:
    graph = build_graph()
    assert len(graph) > 50  # the walk found the product
    assert find_circles(graph) == []


def test_the_walk_finds_a_circle_when_there_is_one() -> None:
    graph = build_graph()
    graph["rlframe.state.checkpoint_layout"] = graph["rlframe.state.checkpoint_layout"] | {
        "rlframe.state.export"
    }
    # export imports checkpoint_layout (directly or through checksums): the new edge closes it.
    circles = find_circles(graph)
    assert any(
        {"rlframe.state.checkpoint_layout", "rlframe.state.export"} <= set(c) for c in circles
    )


def fold_into_folders(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph between folders: ``rlframe.run.launch`` is ``rlframe.run``; a top-level module
    (``rlframe.main``) is a node of its own. Edges inside one folder are dropped."""

    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])

    folded: dict[str, set[str]] = {folder(m): set() for m in graph}
    for module, targets in graph.items():
        folded[folder(module)] |= {folder(t) for t in targets} - {folder(module)}
    return folded


def test_no_import_loops_between_folders() -> None:
    folders = fold_into_folders(build_graph())
    assert {"rlframe.core", "rlframe.run", "workers.training"} <= folders.keys()
    assert find_circles(folders) == []


def test_the_folder_walk_finds_a_loop_when_there_is_one() -> None:
    graph = build_graph()
    graph["rlframe.core.protocol"] = graph["rlframe.core.protocol"] | {"rlframe.run.launch"}
    assert any(
        {"rlframe.core", "rlframe.run"} <= set(c) for c in find_circles(fold_into_folders(graph))
    )


def test_no_module_loads_a_product_module_by_path() -> None:
    """A dotted path in a string hides an edge from this walk: plug-ins and worker classes
    named in configs are the users' business, never the product's own imports."""
    hidden = re.compile(r"load_(function|class)\(\s*[\"'](rlframe|workers)\.")
    found = [
        str(path.relative_to(REPO))
        for path in list_modules().values()
        if hidden.search(path.read_text())
    ]
    assert found == []


def test_rlframe_never_imports_workers() -> None:
    graph = build_graph()
    upward = {(m, t) for m, targets in graph.items() if m.startswith("rlframe") for t in targets}
    assert not [(m, t) for m, t in upward if t.startswith("workers")]


def test_the_schema_imports_nothing_heavy() -> None:
    """The schema validates without torch or the algorithm registries (no import cycle)."""
    code = (
        "import sys, rlframe.config\n"
        "heavy = [m for m in ('torch', 'rlframe.algorithms.losses',"
        " 'rlframe.algorithms.advantages') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=REPO)


def test_importing_the_driver_imports_no_vllm_and_no_cuda() -> None:
    code = (
        "import sys, rlframe, rlframe.main, rlframe.config, rlframe.core.protocol\n"
        "import rlframe.controller.worker_group, rlframe.controller.placement\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), "
        "'vllm imported'\n"
        "import torch; assert not torch.cuda.is_initialized(), 'cuda initialised'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)
