"""The package's layers: each imports only the ones below it, and no two modules import
each other (type-checking imports included). Read from the source, nothing imported."""

from __future__ import annotations

import collections

from tests.helpers.import_graph import Import, cycles, imports, module_files

# Bottom first. A package (or top-level module) may import those in lower layers only;
# `radixserve` itself (its lazy `Engine`) sits on top of everything.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("retry", "protocol", "credentials"),
    ("model_files", "chat_format", "detok"),
    ("api", "prep", "grammar", "routing", "store", "bus", "infra", "benchmark"),
    ("telemetry", "auth"),
    ("engine",),
    ("kv_transfer",),
    ("worker", "lang"),
    ("services",),
    ("stack", "chat_client"),
    ("cli",),
)


def _part(module: str) -> str:
    """`radixserve.engine.sched.policy` -> "engine"; the package itself -> "radixserve"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "radixserve"


def _rank() -> dict[str, int]:
    rank = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    rank["radixserve"] = len(LAYERS)
    return rank


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {_part(name) for name in module_files()}
    assert parts - set(_rank()) == set(), "a new package needs its place in LAYERS"
    assert set(_rank()) - parts == set(), "LAYERS names a package that is gone"


def test_no_package_imports_one_above_or_beside_it() -> None:
    rank = _rank()
    wrong: list[Import] = [
        edge
        for edge in imports()
        if _part(edge.importer) != _part(edge.imported)
        and rank[_part(edge.imported)] >= rank[_part(edge.importer)]
    ]
    assert not wrong, "\n".join(
        f"{e.importer}:{e.line} imports {e.imported} (layer {rank[_part(e.imported)]} "
        f">= {rank[_part(e.importer)]})"
        for e in wrong
    )


def test_no_two_modules_import_each_other() -> None:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for edge in imports():
        edges[edge.importer].add(edge.imported)
    assert cycles(edges) == []


def test_the_graph_reader_sees_every_kind_of_import() -> None:
    """The reader must see what these tests rely on: type-checking imports, imports inside
    functions, and `from package import module` as an import of that module."""
    found = collections.defaultdict(list)
    for e in imports():
        found[(e.importer, e.imported)].append(e.type_checking)
    # radixserve/__init__.py: once for type checking, once inside __getattr__.
    assert sorted(found[("radixserve", "radixserve.engine.engine")]) == [False, True]
    assert ("radixserve.services.health", "radixserve.protocol") in found
    assert ("radixserve.cli", "radixserve.stack") in found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_architecture_layout_names_every_package_and_top_module() -> None:
    """docs/architecture.md's Layout block lists each part of libs/radixserve (`name/`
    for a package, `name.py` for a module) and the layer order this test enforces."""
    doc = (module_files()["radixserve"].parents[2] / "docs" / "architecture.md").read_text()
    layout = doc.split("## Layout", 1)[1].split("```")[1]
    root = module_files()["radixserve"].parent
    for part in sorted({_part(name) for name in module_files()} - {"radixserve"}):
        written = f"{part}/" if (root / part).is_dir() else f"{part}.py"
        assert f"  {written}" in layout, f"the layout does not describe {written}"
    order = " | ".join(", ".join(layer) for layer in LAYERS)
    assert order in " ".join(layout.split()), "the layout's layer order differs from LAYERS"
