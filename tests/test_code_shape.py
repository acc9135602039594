"""The shape of the source, kept: modules a reader can hold in mind, functions that fit a screen,
and an import graph without cycles (the layers themselves are import-linter contracts in
pyproject.toml, run by ``make lint``)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import grimp

import postbox

PACKAGE = Path(postbox.__file__).parent
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_data" not in p.parts)


def test_no_module_is_over_400_lines():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _sources()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def test_no_function_is_over_60_lines():
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = n
    assert not long, long


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_import_graph_has_no_cycle():
    """Counting imports inside functions too: a cycle is a cycle even when it is deferred."""
    assert _cycles(grimp.build_graph("postbox", exclude_type_checking_imports=True)) == []


def _layer_modules() -> list[str]:
    config = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [m.strip() for layer in layers for m in layer.split("|")]


def test_every_module_sits_in_a_layer_of_the_import_contract():
    """A new module must be placed in the layers contract (pyproject.toml), or import-linter would
    not look at it. Room packages whose ``__init__`` imports nothing need no place."""
    named = _layer_modules()
    graph = grimp.build_graph("postbox")

    def placed(module: str) -> bool:
        if any(module == n or module.startswith(n + ".") for n in named):
            return True
        is_room = any(n.startswith(module + ".") for n in named)
        return is_room and not graph.find_modules_directly_imported_by(module)

    unplaced = sorted(m for m in graph.modules if m != "postbox" and not placed(m))
    assert unplaced == []
    assert all(n in graph.modules for n in named), "the contract names a module that does not exist"
