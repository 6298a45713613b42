"""The rules index: which ops each rules module of a package covers, as data read without importing it.

A backend's annotation rules live in the modules of one package (``quantplug_reference.rules``),
and each module says which ops it covers in its ``@register_annotator([...])`` decorators: that is
the only place the ops are written. The core has to know which module covers which op before it
imports any of them (it imports a rules module only when a graph holds one of its ops), so the
package ships those declarations as data, ``rules.json`` in its folder, generated from the modules
themselves::

    quantplug metadata BACKEND            # writes the indexes BACKEND reads (and its metadata file)
    quantplug metadata --check BACKEND    # exit 1 naming each op an index and its modules disagree on

and a backend's ``quantplug_annotation_rules`` hook returns :func:`rules_from_index` of its
package. The index is compared with the modules' declarations where they are all imported anyway
(that command, ``scripts/generate.py --check`` and the tests), never in a user's run.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _quantplug.annotation.annotators import rules_in_module
from _quantplug.errors import QuantplugError
from _quantplug.plugins.contract import RulesModule
from _quantplug.plugins.metadata import module_folder

INDEX_FILE = "rules.json"
FORMAT = "quantplug-rules/1"


class RulesIndexError(QuantplugError, LookupError):
    """A rules index that is missing or unreadable, or a module it does not list."""


def index_path(package: str) -> Path | None:
    """Where package ``package``'s rules index belongs (found without importing the package)."""
    folder = module_folder(package)
    return None if folder is None else folder / INDEX_FILE


def registered_ops(package: str) -> dict[str, tuple[str, ...]]:
    """Each module of ``package`` holding rules -> the ops its ``register_annotator`` declarations
    cover, sorted (imports every module of the package: for generating and checking the index)."""
    found: dict[str, tuple[str, ...]] = {}
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        if info.ispkg:
            continue
        rules = rules_in_module(importlib.import_module(f"{package}.{info.name}"))
        if rules:
            found[info.name] = tuple(sorted(rules))
    return found


def index_text(package: str, modules: Mapping[str, Iterable[str]]) -> str:
    """The index file of ``package`` listing ``modules`` (module name in the package -> its ops)."""
    listed = {module: sorted(ops) for module, ops in sorted(modules.items())}
    return json.dumps({"format": FORMAT, "package": package, "modules": listed}, indent=2) + "\n"


def expected_index(package: str) -> tuple[Path, str]:
    """Package ``package``'s index file and the text it must hold (imports its modules)."""
    path = index_path(package)
    if path is None:
        raise RulesIndexError(f"cannot find the folder of package {package!r}")
    return path, index_text(package, registered_ops(package))


def read_index(package: str) -> dict[str, tuple[str, ...]]:
    """Module name in ``package`` -> the ops it covers, from the package's index (imports nothing)."""
    path = index_path(package)
    if path is None or not path.is_file():
        raise RulesIndexError(
            f"rules package {package!r} ships no rules index ({path or INDEX_FILE}): reinstall its "
            f"distribution; its author generates the index with `quantplug metadata BACKEND` and ships "
            f"it as package data"
        )
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("package") != package:
            raise ValueError(f"not a {FORMAT} index of package {package!r}")
        return {str(module): tuple(map(str, ops)) for module, ops in data["modules"].items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RulesIndexError(f"{path} cannot be read as a rules index: {exc}") from None


#: packages :func:`rules_from_index` was asked for inside :func:`collecting` (None outside it)
_collected: set[str] | None = None


@contextmanager
def collecting() -> Iterator[set[str]]:
    """Record the packages :func:`rules_from_index` is asked for, and answer it from the modules'
    own declarations (importing them) rather than from the index files.

    How ``quantplug metadata`` learns which indexes a backend reads: it builds the backend's
    quantizer inside this, so an index that is stale or not written yet is no obstacle.
    """
    global _collected
    outer, _collected = _collected, set()
    try:
        yield _collected
    finally:
        _collected = outer


def rules_from_index(package: str, modules: Iterable[str] | None = None) -> tuple[RulesModule, ...]:
    """The rules modules of ``package`` and the ops each covers, read from the package's rules
    index (``rules.json`` in its folder) without importing any of them.

    Return it from ``quantplug_annotation_rules``: the ops are those the modules declare in their
    ``@register_annotator`` decorators, written nowhere else. ``modules`` selects some of the
    package's modules by name (``["abs_rules"]``: an extension's share of a package); None, all.

    Raises:
        RulesIndexError: the package ships no readable index, or lists no module of that name.
    """
    if _collected is not None:
        _collected.add(package)
        index = registered_ops(package)
    else:
        index = read_index(package)
    names = list(index) if modules is None else [m.removeprefix(package + ".") for m in modules]
    unknown = [m for m in names if m not in index]
    if unknown:
        raise RulesIndexError(
            f"the rules index of {package!r} lists no module {', '.join(map(repr, unknown))}; it lists "
            + (", ".join(index) or "none")
            + " (a module must hold a @register_annotator rule to be listed)"
        )
    return tuple(RulesModule(f"{package}.{name}", index[name]) for name in names)


def drift(package: str) -> list[str]:
    """What ``package``'s index and its modules' declarations disagree on (imports every module).

    One line per op a module registers that the index lacks, and per op the index lists that
    its module does not register; empty when the index is current.
    """
    registered = registered_ops(package)
    try:
        indexed = read_index(package)
    except RulesIndexError as exc:
        return [str(exc)]
    problems = []
    for module in sorted(set(registered) | set(indexed)):
        declared, listed = set(registered.get(module, ())), set(indexed.get(module, ()))
        name = f"{package}.{module}"
        for op in sorted(declared - listed):
            problems.append(f"{name} registers {op}, which its rules index lacks")
        for op in sorted(listed - declared):
            problems.append(f"the rules index lists {op} for {name}, which has no rule for it")
    path = index_path(package)
    generated = index_text(package, registered)
    if not problems and path is not None and path.read_text(encoding="utf-8") != generated:
        problems.append(f"{path} lists the right ops, but not in the form generated")
    return problems


def packages_read_by(backend: str) -> list[str]:
    """The rules packages of ``backend``'s own distribution whose indexes it reads through
    :func:`rules_from_index` from its hooks (builds its quantizer at default options: imports it)."""
    from _quantplug.plugins.registry import load_backend
    from _quantplug.quantizer.quantizer import make_quantizer

    loaded = load_backend(backend)
    with collecting() as packages:
        make_quantizer(loaded, {})
    top = loaded.entry.module.partition(":")[0].split(".")[0]
    return sorted(p for p in packages if p.split(".")[0] == top)
