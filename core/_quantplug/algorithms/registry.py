"""Finding, listing and loading accuracy algorithms by name (imports neither torch nor any algorithm).

Algorithms come from the entry-point group ``quantplug.algorithms`` (quantplug's own built-ins
are declared there too) and from in-process registrations (:func:`register_algorithm`: tests,
notebooks). An entry point's value is ``"package.module:Class"``; listing reads entry-point
metadata plus an optional description file ``<name>.algorithm.json`` beside the module (found
without importing it), and loading imports that one module.

``QUANTPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` ignores entry points, as it does for backends.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from _quantplug.algorithms.option_checks import option_metadata, option_values
from _quantplug.errors import AlgorithmError, UnknownAlgorithmError
from _quantplug.plugins.metadata import module_folder

ALGORITHMS_GROUP = "quantplug.algorithms"
ENV_DISABLE_AUTOLOAD = "QUANTPLUG_DISABLE_PLUGIN_AUTOLOAD"
METADATA_SUFFIX = ".algorithm.json"


@dataclass(frozen=True)
class AlgorithmEntry:
    """One installed or registered algorithm, described without importing it.

    ``description``, ``paper`` and ``options`` (dicts with name/type/default/help) come from the
    algorithm's metadata file (empty when it ships none, until loaded).
    """

    name: str
    value: str  # "module:attr" (entry points) or the object's qualified name (in-process)
    distribution: str | None
    version: str | None
    source: str  # "entry-point" or "in-process"
    description: str = ""
    paper: str = ""
    options: tuple[Mapping[str, Any], ...] = ()


_lock = threading.RLock()
_in_process: dict[str, tuple[AlgorithmEntry, Any]] = {}
_loaded: dict[str, Any] = {}


def _autoload() -> bool:
    return os.environ.get(ENV_DISABLE_AUTOLOAD, "").strip() in ("", "0", "false", "no")


def _metadata_path(entry: AlgorithmEntry) -> Path | None:
    """Where the metadata file of an installed algorithm is (beside its module), found unimported."""
    folder = module_folder(entry.value.partition(":")[0])
    return None if folder is None else folder / f"{entry.name}{METADATA_SUFFIX}"


def _described(entry: AlgorithmEntry) -> AlgorithmEntry:
    path = _metadata_path(entry)
    if path is None:
        return entry
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return entry
    if not isinstance(data, dict):
        return entry
    options = tuple(o for o in data.get("options", ()) if isinstance(o, dict))
    return AlgorithmEntry(
        name=entry.name,
        value=entry.value,
        distribution=entry.distribution,
        version=entry.version,
        source=entry.source,
        description=str(data.get("description", "")),
        paper=str(data.get("paper", "")),
        options=options,
    )


def _entry_points() -> dict[str, AlgorithmEntry]:
    found: dict[str, AlgorithmEntry] = {}
    if not _autoload():
        return found
    for ep in metadata.entry_points(group=ALGORITHMS_GROUP):
        dist = getattr(ep, "dist", None)
        found.setdefault(
            ep.name,
            AlgorithmEntry(
                name=ep.name,
                value=ep.value,
                distribution=dist.metadata["Name"] if dist is not None else None,
                version=dist.version if dist is not None else None,
                source="entry-point",
            ),
        )
    return found


def list_algorithms() -> list[AlgorithmEntry]:
    """Every algorithm quantplug can see, sorted by name; imports no algorithm module."""
    with _lock:
        entries = {name: _described(e) for name, e in _entry_points().items()}
        for name, (entry, _) in _in_process.items():
            entries[name] = entry  # an in-process registration shadows an installed one
        return [entries[name] for name in sorted(entries)]


def algorithm_names() -> list[str]:
    return [e.name for e in list_algorithms()]


def register_algorithm(name: str, factory: Any, *, description: str = "", paper: str = "") -> None:
    """Make ``factory`` (an Algorithm class or a callable taking the options) available as ``name``."""
    info = getattr(factory, "info", None)
    described = info() if callable(info) else None
    entry = AlgorithmEntry(
        name=name,
        value=f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}",
        distribution=None,
        version=None,
        source="in-process",
        description=description or getattr(described, "description", ""),
        paper=paper or getattr(described, "paper", ""),
        options=tuple(option_metadata(o) for o in getattr(described, "options", ())),
    )
    with _lock:
        _in_process[name] = (entry, factory)
        _loaded.pop(name, None)


def unregister_algorithm(name: str) -> None:
    with _lock:
        _in_process.pop(name, None)
        _loaded.pop(name, None)


def load_algorithm(name: str) -> Any:
    """The factory registered as ``name`` (imports its module on first use)."""
    with _lock:
        if name in _in_process:
            return _in_process[name][1]
        if name in _loaded:
            return _loaded[name]
        entries = _entry_points()
        entry = entries.get(name)
        if entry is None:
            raise UnknownAlgorithmError(name, [*entries, *_in_process])
        module_name, _, attr = entry.value.partition(":")
        try:
            value: Any = importlib.import_module(module_name)
            for part in filter(None, attr.split(".")):
                value = getattr(value, part)
        except Exception as exc:  # a broken third-party algorithm must not look like ours
            dist = f" from distribution {entry.distribution!r}" if entry.distribution else ""
            raise AlgorithmError(
                f"algorithm {name!r}{dist} failed to load ({entry.value}): {type(exc).__name__}: {exc}; "
                "reinstall or upgrade it"
            ) from exc
        _loaded[name] = value
        return value


def create_algorithm(name: str, options: Mapping[str, Any] | None = None) -> Any:
    """A configured algorithm: ``load_algorithm(name)`` called with ``options`` (checked, converted)."""
    factory = load_algorithm(name)
    declared = getattr(factory, "options", ())
    if isinstance(declared, (tuple, list)) and all(hasattr(o, "type") for o in declared):
        values = option_values(name, declared, dict(options or {}))
    else:
        values = dict(options or {})
    try:
        return factory(**values)
    except TypeError as exc:
        raise AlgorithmError(f"algorithm {name!r} rejected options {values}: {exc}") from exc


def resolve_algorithms(algorithms: Iterable[Any] | None) -> list[Any]:
    """Names, ``(name, options)`` pairs and configured objects as a list of algorithm objects."""
    if algorithms is None:
        return []
    if isinstance(algorithms, (str, bytes)) or not isinstance(algorithms, Iterable):
        algorithms = [algorithms]
    result = []
    for item in algorithms:
        if isinstance(item, str):
            result.append(create_algorithm(item))
        elif (
            isinstance(item, Sequence)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], Mapping)
        ):
            result.append(create_algorithm(item[0], item[1]))
        elif isinstance(item, type) and any(callable(getattr(item, hook, None)) for hook in _HOOKS):
            result.append(item())
        elif any(callable(getattr(item, hook, None)) for hook in _HOOKS):
            result.append(item)
        else:
            raise AlgorithmError(
                f"{item!r} is not an algorithm: pass a name from `quantplug algorithms`, a "
                "(name, {options}) pair, or an object with transform_program/collector/choose_weight"
            )
    return result


_HOOKS = ("transform_program", "collector", "choose_weight")


def metadata_of(factory: Any) -> dict[str, Any]:
    """The ``<name>.algorithm.json`` document for an Algorithm class (what listings show unimported)."""
    info = factory.info()
    return {
        "name": info.name,
        "description": info.description,
        "paper": info.paper,
        "options": [option_metadata(o) for o in info.options],
    }


def metadata_text(factory: Any) -> str:
    """The text of ``factory``'s metadata file."""
    return json.dumps(metadata_of(factory), indent=2) + "\n"


def write_metadata(factory: Any, folder: str) -> str:
    """Write ``factory``'s metadata file into ``folder`` (beside its module); returns the path."""
    path = os.path.join(folder, factory.name + METADATA_SUFFIX)
    with open(path, "w", encoding="utf-8") as f:
        f.write(metadata_text(factory))
    return path


def expected_metadata_files() -> list[tuple[Path, str]]:
    """quantplug's own algorithms' metadata files and the text each must hold, from the classes'
    declarations (imports every built-in algorithm; ``scripts/generate.py`` writes them)."""
    files = []
    for entry in _entry_points().values():
        if entry.value.startswith("_quantplug."):
            path = _metadata_path(entry)
            if path is None:
                raise AlgorithmError(f"cannot find the folder of algorithm {entry.name!r} ({entry.value})")
            files.append((path, metadata_text(load_algorithm(entry.name))))
    return sorted(files)
