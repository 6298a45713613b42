"""The core's layers, held: every import in ``_quantplug`` goes down (or across) its layer order.

``_quantplug.LAYERS`` declares the folders (and top-level modules) of the private package from the
lowest layer up. Every module is read with ``ast`` (nothing is imported), function-level imports
included, so an import hidden in a function to dodge a cycle counts like any other; only imports
under ``if TYPE_CHECKING:`` are exempt (they never run). The rules:

* an import of another folder goes to a folder of the same layer or a lower one;
* no two folders import each other, directly or through a longer chain (within a layer too);
* no module of ``_quantplug`` imports another in a cycle (through function-level imports neither);
* ``_quantplug`` never imports the public front (``quantplug``, ``quantplug.backend`` ...): the
  front re-exports the private modules, never the other way round. The one exception is the
  conformance kit (:data:`PUBLIC_FRONT_USERS`), which runs a backend through ``quantplug.prepare``,
  ``convert`` and ``lower`` exactly as the backend's users' programs do;
* every folder and top-level module is in exactly one layer, and every name of ``LAYERS`` exists.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import _quantplug

PACKAGE = Path(_quantplug.__file__).resolve().parent

#: the folders that may import the public front (see the module docstring)
PUBLIC_FRONT_USERS = frozenset({"conformance"})

#: imports (importing module, imported module) that knot the layers and that other parts of issue 41
#: remove, left out of the checks until then; :func:`test_every_pending_import_is_still_there`
#: fails once one is gone, so none stays here longer, and none may be added
PENDING: dict[tuple[str, str], str] = {
    ("_quantplug.plugins.metadata", "_quantplug.plugins.registry"): (
        "writing the backends' metadata files moves to the generator (scripts/generate.py)"
    ),
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is written."""

    module: str  # the importing module, dotted (``_quantplug.flow.prepare``)
    target: str  # the imported module or ``module.name`` (dotted, absolute)
    line: int

    @property
    def where(self) -> str:
        return f"{self.module.replace('.', '/')}.py:{self.line}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every statement at any depth (function bodies included), except ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _statements(other)
            continue
        if isinstance(child, ast.stmt):
            yield child
        yield from _statements(child)


def _imports(path: Path) -> list[Import]:
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return _imports_in(path.read_text(encoding="utf-8"), module, package)


def _imports_in(source: str, module: str, package: str) -> list[Import]:
    """The imports of ``module`` (source text ``source``, in package ``package``) that can run."""
    found = []
    for node in _statements(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            found += [Import(module, f"{origin}.{alias.name}", node.lineno) for alias in node.names]
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
ALL_IMPORTS = [imp for path in MODULES.values() for imp in _imports(path)]


def _existing_module(target: str) -> str:
    """The module ``target`` (``module`` or ``module.name``) names."""
    while target not in MODULES and "." in target:
        target = target.rpartition(".")[0]
    return target


IMPORTS = [imp for imp in ALL_IMPORTS if (imp.module, _existing_module(imp.target)) not in PENDING]


def _unit(module: str) -> str | None:
    """The folder or top-level module of ``_quantplug`` a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if parts[0] == "_quantplug" and len(parts) > 1 else None


LAYER_OF = {unit: index for index, layer in enumerate(_quantplug.LAYERS) for unit in layer}


def _between_units() -> list[tuple[str, str, Import]]:
    """Every import from one folder (or top-level module) of ``_quantplug`` into another."""
    found = []
    for imp in IMPORTS:
        source, target = _unit(imp.module), _unit(imp.target)
        if source is not None and target is not None and source != target:
            found.append((source, target, imp))
    return found


def test_every_folder_is_in_one_layer() -> None:
    units = {_unit(m) for m in MODULES} - {None}
    declared = [unit for layer in _quantplug.LAYERS for unit in layer]
    assert len(declared) == len(set(declared)), "a folder is in two layers"
    assert units - set(declared) == set(), "folders of _quantplug in no layer of _quantplug.LAYERS"
    assert set(declared) - units == set(), "_quantplug.LAYERS names folders that do not exist"


def test_every_import_goes_down_the_layers() -> None:
    upward = [
        f"{imp.where}: {imp.target} ({source}, layer {LAYER_OF[source]} imports {target}, layer "
        f"{LAYER_OF[target]})"
        for source, target, imp in _between_units()
        if LAYER_OF[target] > LAYER_OF[source]
    ]
    assert not upward, "imports pointing up a layer (see _quantplug.LAYERS):\n" + "\n".join(upward)


def _knots(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of the directed graph ``edges`` with more than one node (each
    a set of nodes importing each other, directly or around a longer chain), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
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
            part = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def _described(pairs: list[tuple[str, str, Import]]) -> str:
    """The knots among ``pairs`` (source, target, where), each with the imports inside it."""
    edges: dict[str, set[str]] = {}
    for source, target, _ in pairs:
        edges.setdefault(source, set()).add(target)
    lines = []
    for part in _knots(edges):
        lines.append("  " + ", ".join(part) + ":")
        inside = sorted({(s, t) for s, t, _ in pairs if s in part and t in part})
        for a, b in inside:
            where = sorted({imp.where for s, t, imp in pairs if (s, t) == (a, b)})
            lines.append(f"    {a} -> {b}: " + ", ".join(where))
    return "\n".join(lines)


def test_no_two_folders_import_each_other() -> None:
    knots = _described(_between_units())
    assert not knots, "folders importing each other:\n" + knots


def test_no_module_imports_itself_through_others() -> None:
    pairs = []
    for imp in IMPORTS:
        target = _existing_module(imp.target)
        # importing a package's submodule runs the package's __init__, never the other way round
        if target in MODULES and target != imp.module and not imp.module.startswith(target + "."):
            pairs.append((imp.module, target, imp))
    knots = _described(pairs)
    assert not knots, "modules importing each other:\n" + knots


def test_every_pending_import_is_still_there() -> None:
    found = {(imp.module, _existing_module(imp.target)) for imp in ALL_IMPORTS}
    gone = [f"{a} -> {b}" for a, b in PENDING if (a, b) not in found]
    assert not gone, "remove from PENDING (the import is gone): " + ", ".join(gone)


def test_the_private_package_never_imports_the_public_front() -> None:
    front = [
        f"{imp.where}: {imp.target}"
        for imp in IMPORTS
        if imp.target.split(".")[0] == "quantplug" and _unit(imp.module) not in PUBLIC_FRONT_USERS
    ]
    assert not front, (
        "_quantplug imports the public front (import the private module that defines the name):\n"
        + "\n".join(front)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f():\n    from _quantplug.flow import prepare\n", ["_quantplug.flow.prepare"]),
        (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    import _quantplug.cli\nelse:\n    import os\n",
            ["typing.TYPE_CHECKING", "os"],
        ),
        (
            "from ..meta import STATE_KEY\nfrom . import attrs\n",
            ["_quantplug.meta.STATE_KEY", "_quantplug.graph.attrs"],
        ),
        ("class A:\n    def f(self):\n        import quantplug\n", ["quantplug"]),
    ],
)
def test_the_reader_sees_every_import_that_runs(source: str, expected: list[str]) -> None:
    """The test's own reader: function-level and relative imports count, type-checking ones do not."""
    found = _imports_in(source, "_quantplug.graph.probe", "_quantplug.graph")
    assert [imp.target for imp in found] == expected
