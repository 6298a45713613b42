"""Finding, listing and loading backends by name.

Backends come from two places: entry points of installed distributions (group
``quantplug.backends``, extensions in ``quantplug.extensions``) and plugins registered in-process
with :func:`register_backend` (tests, notebooks). Listing reads entry-point metadata only;
loading imports one backend module plus the extensions that target it, nothing else.

Environment:
    ``QUANTPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` ignores entry points altogether (only in-process
    plugins remain), like pytest's ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``.
    ``QUANTPLUG_BACKENDS=reference,qnn_htp`` restricts autoloading to the listed backend names.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any

from _quantplug.errors import (
    BackendDisabledError,
    BackendLoadError,
    DuplicateBackendError,
    OptionError,
    UnknownBackendError,
)
from _quantplug.plugins.contract import BackendInfo

if TYPE_CHECKING:  # pluggy is imported when a backend is loaded, not to list them
    import pluggy

logger = logging.getLogger("quantplug")

BACKENDS_GROUP = "quantplug.backends"
EXTENSIONS_GROUP = "quantplug.extensions"
ENV_DISABLE_AUTOLOAD = "QUANTPLUG_DISABLE_PLUGIN_AUTOLOAD"
ENV_BACKENDS = "QUANTPLUG_BACKENDS"


@dataclass(frozen=True)
class BackendEntry:
    """One installed or registered backend, described without importing it.

    ``status`` is ``"available"`` (not loaded yet), ``"loaded"``, ``"error"`` (a load failed;
    ``error`` says why), ``"disabled"`` (excluded by environment) or ``"conflict"`` (several
    distributions claim the name).
    """

    name: str
    module: str
    distribution: str | None
    version: str | None
    source: str  # "entry-point" or "in-process"
    status: str = "available"
    error: str | None = None
    claimants: tuple[str, ...] = ()


@dataclass
class LoadedBackend:
    """A backend's plugin manager (backend + its extensions) and its description."""

    entry: BackendEntry
    manager: pluggy.PluginManager
    info: BackendInfo
    extensions: list[str] = field(default_factory=list)

    @property
    def hook(self) -> Any:
        return self.manager.hook


@dataclass(frozen=True)
class _ExtensionEntry:
    target: str
    module: str
    distribution: str | None
    plugin: Any = None  # in-process extensions carry the object itself


_lock = threading.RLock()
_in_process: dict[str, tuple[BackendEntry, Any]] = {}
_in_process_extensions: list[_ExtensionEntry] = []
_loaded: dict[str, LoadedBackend] = {}
_failures: dict[str, str] = {}


def _autoload_allowed(name: str) -> bool:
    if os.environ.get(ENV_DISABLE_AUTOLOAD, "").strip() not in ("", "0", "false", "no"):
        return False
    only = os.environ.get(ENV_BACKENDS, "").strip()
    if not only:
        return True
    return name in {n.strip() for n in only.split(",") if n.strip()}


def _dist_of(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _entry_point_backends() -> dict[str, list[BackendEntry]]:
    found: dict[str, dict[str, BackendEntry]] = defaultdict(dict)
    for ep in metadata.entry_points(group=BACKENDS_GROUP):
        dist, version = _dist_of(ep)
        key = dist or ep.value
        # the same distribution seen twice on sys.path (editable + site) is one claimant
        found[ep.name].setdefault(
            key,
            BackendEntry(
                name=ep.name, module=ep.value, distribution=dist, version=version, source="entry-point"
            ),
        )
    return {name: list(by_dist.values()) for name, by_dist in found.items()}


def list_backends() -> list[BackendEntry]:
    """Every backend quantplug can see, sorted by name; imports no plugin module."""
    with _lock:
        entries: dict[str, BackendEntry] = {}
        for name, claims in _entry_point_backends().items():
            entry = claims[0]
            if len(claims) > 1:
                claimants = tuple(sorted(c.distribution or c.module for c in claims))
                entry = _with(entry, status="conflict", claimants=claimants)
            elif not _autoload_allowed(name):
                entry = _with(entry, status="disabled")
            entries[name] = entry
        for name, (entry, _) in _in_process.items():
            entries[name] = entry  # in-process registration shadows an installed one (tests)
        result = []
        for name in sorted(entries):
            entry = entries[name]
            if entry.status in ("available",):
                if name in _loaded:
                    entry = _with(entry, status="loaded")
                elif name in _failures:
                    entry = _with(entry, status="error", error=_failures[name])
            result.append(entry)
        return result


def entry_for(name: str) -> BackendEntry:
    """The entry of a backend that can be loaded (nothing is imported).

    Raises:
        UnknownBackendError: no backend of that name (the message lists installed ones and the
            closest names).
        DuplicateBackendError: two distributions claim the name.
        BackendDisabledError: the environment excludes it.
    """
    with _lock:
        entries = {e.name: e for e in list_backends()}
    entry = entries.get(name)
    if entry is None:
        raise UnknownBackendError(name, [n for n, e in entries.items() if e.status != "disabled"])
    if entry.status == "conflict":
        raise DuplicateBackendError(name, entry.claimants)
    if entry.status == "disabled":
        raise BackendDisabledError(
            f"backend {name!r} is installed but disabled by {ENV_DISABLE_AUTOLOAD}/{ENV_BACKENDS}; "
            f"unset them or add {name!r} to {ENV_BACKENDS}"
        )
    return entry


def declared_info(name: str) -> BackendInfo | None:
    """Backend ``name``'s options and presets without importing its plugin, or None if unknown.

    Installed backends describe themselves in a metadata file (:mod:`_quantplug.plugins.metadata`);
    in-process ones are already imported and asked directly.

    Raises:
        MetadataError: the backend's metadata file is malformed.
    """
    with _lock:
        if name in _in_process:
            return load_backend(name).info
        if name in _loaded:
            return _loaded[name].info
        entry = next((e for e in list_backends() if e.name == name), None)
    if entry is None or entry.status in ("disabled", "conflict"):
        return None
    from _quantplug.plugins.metadata import read_declared

    return read_declared(entry.module, name)


def _with(entry: BackendEntry, **changes: Any) -> BackendEntry:
    fields = {**entry.__dict__, **changes}
    return BackendEntry(**fields)


def load_backend(name: str) -> LoadedBackend:
    """Import backend ``name`` (once) with its extensions and return its plugin manager.

    Raises:
        UnknownBackendError: no backend of that name (the message lists installed ones).
        DuplicateBackendError: two distributions claim the name.
        BackendDisabledError: the environment excludes it.
        BackendLoadError: the plugin or one of its extensions fails to import or to describe itself.
    """
    with _lock:
        if name in _loaded:
            return _loaded[name]
        entry = entry_for(name)
        try:
            loaded = _load(entry)
        except BackendLoadError as exc:
            _failures[name] = str(exc.cause)
            raise
        _failures.pop(name, None)
        _loaded[name] = loaded
        return loaded


def _new_manager() -> pluggy.PluginManager:
    import pluggy

    from _quantplug.plugins import hookspecs

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def _import(value: str, *, name: str, distribution: str | None, extension_of: str | None = None) -> Any:
    """Import an entry-point value: ``"pkg.module"`` or ``"pkg.module:attribute"``.

    Any failure of the plugin's import is a :class:`BackendLoadError`, ``sys.exit()`` included
    (a plugin ending the process would end ``quantplug backends --check`` with status 0 and
    nothing printed); only a KeyboardInterrupt (the user's Ctrl-C during a long import) passes.
    """
    module, _, attr = value.partition(":")
    try:
        obj = importlib.import_module(module.strip())
        for part in attr.strip().split(".") if attr.strip() else ():
            obj = getattr(obj, part)
        return obj
    except (Exception, SystemExit) as exc:  # any failure inside a third-party plugin import
        cause: BaseException | str = exc
        if isinstance(exc, SystemExit):
            cause = f"importing it called sys.exit({'' if exc.code is None else repr(exc.code)})"
        raise BackendLoadError(name, distribution, value, cause, extension_of=extension_of) from exc


def _load(entry: BackendEntry) -> LoadedBackend:
    import pluggy

    pm = _new_manager()
    if entry.source == "in-process":
        plugin = _in_process[entry.name][1]
    else:
        plugin = _import(entry.module, name=entry.name, distribution=entry.distribution)
    try:
        pm.register(plugin, name=f"backend:{entry.name}")
        pm.check_pending()  # a misspelled hook name is an error, not silently ignored
    except (ValueError, pluggy.PluginValidationError) as exc:
        raise BackendLoadError(entry.name, entry.distribution, entry.module, exc) from exc
    try:
        info = pm.hook.quantplug_backend_info()
    except (Exception, SystemExit) as exc:  # the plugin's code: it cannot describe itself
        raise BackendLoadError(entry.name, entry.distribution, entry.module, exc) from exc
    if not isinstance(info, BackendInfo):
        raise BackendLoadError(
            entry.name,
            entry.distribution,
            entry.module,
            "it does not implement quantplug_backend_info() returning a BackendInfo",
        )
    if info.name != entry.name:
        raise BackendLoadError(
            entry.name,
            entry.distribution,
            entry.module,
            f"its quantplug_backend_info() declares the name {info.name!r}; the entry point (or "
            f"register_backend) must use the same name",
        )
    from _quantplug.plugins.api_version import api_problem

    try:
        problem = api_problem(info.requires_api)
    except OptionError as exc:
        problem = f"its BackendInfo.requires_api is not a version: {exc}"
    if problem is not None:
        raise BackendLoadError(entry.name, entry.distribution, entry.module, problem)
    if entry.source == "entry-point":
        from _quantplug.plugins.metadata import stale_reason

        stale = stale_reason(entry.module, info)
        if stale is not None:
            logger.warning("backend %r: %s", entry.name, stale)
    loaded = LoadedBackend(entry=entry, manager=pm, info=info)
    for ext in _extensions_for(entry.name):
        plugin = ext.plugin
        if plugin is None:
            plugin = _import(
                ext.module, name=entry.name, distribution=ext.distribution, extension_of=ext.target
            )
        if pm.is_registered(plugin):
            continue
        try:
            pm.register(plugin, name=f"extension:{ext.module}")
            pm.check_pending()
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise BackendLoadError(
                entry.name, ext.distribution, ext.module, exc, extension_of=ext.target
            ) from exc
        loaded.extensions.append(ext.module)
    return loaded


def _extensions_for(backend: str) -> list[_ExtensionEntry]:
    result: list[_ExtensionEntry] = []
    if _autoload_allowed(backend):
        for ep in metadata.entry_points(group=EXTENSIONS_GROUP):
            if ep.name in (backend, "*"):
                dist, _ = _dist_of(ep)
                ext = _ExtensionEntry(target=ep.name, module=ep.value, distribution=dist)
                if ext not in result:
                    result.append(ext)
    result.extend(e for e in _in_process_extensions if e.target in (backend, "*"))
    return result


def in_process_names() -> set[str]:
    """The backends registered in this process (:func:`register_backend`)."""
    with _lock:
        return set(_in_process)


def register_backend(name: str, plugin: Any, *, module: str | None = None) -> None:
    """Register a backend in-process (no installation): ``plugin`` is a module or an object
    whose methods are ``@quantplug.hookimpl`` hook implementations."""
    with _lock:
        mod = module or getattr(plugin, "__name__", None) or type(plugin).__qualname__
        _in_process[name] = (
            BackendEntry(name=name, module=mod, distribution=None, version=None, source="in-process"),
            plugin,
        )
        _loaded.pop(name, None)
        _failures.pop(name, None)


def register_extension(target: str, plugin: Any) -> None:
    """Register an in-process extension of backend ``target`` (``"*"``: every backend)."""
    with _lock:
        mod = getattr(plugin, "__name__", None) or type(plugin).__qualname__
        _in_process_extensions.append(
            _ExtensionEntry(target=target, module=mod, distribution=None, plugin=plugin)
        )
        _invalidate(target)


def unregister(name: str) -> None:
    """Forget an in-process backend and the in-process extensions registered for it."""
    with _lock:
        _in_process.pop(name, None)
        _in_process_extensions[:] = [e for e in _in_process_extensions if e.target != name]
        _invalidate(name)


def _invalidate(name: str) -> None:
    if name == "*":
        _loaded.clear()
    else:
        _loaded.pop(name, None)
    _failures.pop(name, None)


def reset_cache() -> None:
    """Drop loaded backends so the next ``get_quantizer`` re-reads the environment and entry points."""
    with _lock:
        _loaded.clear()
        _failures.clear()


@contextmanager
def registered_backend(name: str, plugin: Any, *extensions: Any) -> Iterator[None]:
    """Test helper: a backend (and extensions of it) registered only inside the ``with`` block."""
    register_backend(name, plugin)
    for ext in extensions:
        register_extension(name, ext)
    try:
        yield
    finally:
        unregister(name)
