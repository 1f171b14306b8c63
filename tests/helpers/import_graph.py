"""The package's import graph, read from its source (nothing is imported): which
radixserve module each module imports, at the top, inside functions or for type checking."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "libs" / "radixserve"


@dataclass(frozen=True)
class Import:
    """One import of one radixserve module by another, where it is written."""

    importer: str
    imported: str
    line: int
    type_checking: bool


def module_files(root: Path = PACKAGE_ROOT) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports(root: Path = PACKAGE_ROOT) -> list[Import]:
    """Every import between the package's modules. `from a import b` counts as an import
    of the module `a.b` where there is one, else of `a`."""
    modules = module_files(root)
    found: list[Import] = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        guarded = _type_checking_lines(tree)
        for node in ast.walk(tree):
            for target in _targets(node, package, modules):
                if target != name:
                    found.append(Import(name, target, node.lineno, node.lineno in guarded))
    return found


def _targets(node: ast.AST, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source not in modules:
        return []
    return [
        f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
        for alias in node.names
    ]


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
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
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found
