"""How the public modules (``quantplug``, ``quantplug.backend`` ...) re-export private names.

A public module declares, once, which private module defines each of its names; the names are
imported from there on first use (PEP 562), so ``import quantplug`` and ``import
quantplug.backend`` import neither torch nor any plugin, and ``quantplug --help`` answers at
once. Type checkers read the stub (``.pyi``) generated from the same declaration
(``python scripts/generate.py``).

A public module also refuses to have one of its names replaced by a submodule of the same name:
importing an old module path (``quantplug.distributed.shard``, see :mod:`_quantplug.deprecated`)
binds the module on its parent, which would otherwise hide the public function ``shard``.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any


class PublicModule(types.ModuleType):
    """A public module: lazy names, never shadowed by a submodule."""

    def __setattr__(self, name: str, value: Any) -> None:
        current = self.__dict__.get(name)
        exports: Mapping[str, str] = self.__dict__.get("_EXPORTS", {})
        if isinstance(value, types.ModuleType) and (
            (current is not None and not isinstance(current, types.ModuleType))
            or (current is None and name in exports)
        ):
            return  # an old submodule path was imported: the public name stays what it is
        super().__setattr__(name, value)


def exports_of(declaration: Mapping[str, Sequence[str]]) -> dict[str, str]:
    """``{module: (names...)}`` -> ``{name: module}``; a name declared twice is an error."""
    table: dict[str, str] = {}
    for module, names in declaration.items():
        for name in names:
            if name in table:
                raise ValueError(f"{name!r} is exported from both {table[name]} and {module}")
            table[name] = module
    return table


def merged(*declarations: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Several declarations as one: each module's names, in the order given."""
    table: dict[str, tuple[str, ...]] = {}
    for declaration in declarations:
        for module, names in declaration.items():
            table[module] = (*table.get(module, ()), *names)
    return table


def install(
    module_name: str,
    declaration: Mapping[str, Sequence[str]],
    *,
    modules: Mapping[str, str] | None = None,
) -> list[str]:
    """Make ``module_name`` a public module exporting ``declaration``; returns its ``__all__``.

    ``modules`` maps attribute names to modules imported whole on first use (``quantplug.backend``
    reached as an attribute of ``quantplug``).
    """
    module = sys.modules[module_name]
    table = exports_of(declaration)
    submodules = dict(modules or {})
    module.__dict__["_EXPORTS"] = table

    def __getattr__(name: str) -> Any:
        source = table.get(name)
        if source is not None:
            value = getattr(importlib.import_module(source), name)
            module.__dict__[name] = value  # later lookups skip this function
            return value
        if name in submodules:
            value = importlib.import_module(submodules[name])
            module.__dict__[name] = value
            return value
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*module.__dict__, *table, *submodules})

    getter: Callable[[str], Any] = __getattr__
    module.__dict__["__getattr__"] = getter
    module.__dict__["__dir__"] = __dir__
    module.__class__ = PublicModule
    return sorted(table)
