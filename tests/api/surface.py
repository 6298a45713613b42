"""The public surface of quantplug as data: what a plugin or a user can name, and its shape.

``python -m tests.api.surface`` prints it; ``--write`` stores it as ``api/surface.json``, the
snapshot ``tests/api/test_public_surface.py`` holds the code to. ``api/releases/VERSION.json`` are
the surfaces of released versions (written by the same command, ``--release VERSION``), against
which every removal or incompatible change must be recorded in ``CHANGELOG.md`` and keep a
deprecation path.

What counts as the surface:

* the names of ``__all__`` of the public modules (``quantplug``, ``quantplug.backend``,
  ``quantplug.debug``, ``quantplug.distributed``, ``quantplug.conformance``), each with its kind
  and shape: a function's signature, a class's constructor, fields, public methods and
  properties, a constant's type (and value, for text and numbers: meta keys are data);
* the hook specifications (name, arguments, ``firstresult``);
* what plugins read of ``Quantizer`` and ``BackendContext`` (their public attributes).

Signatures are rendered as text with object addresses removed, so the snapshot does not depend
on the machine or the order anything was imported in.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import inspect
import json
import re
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "api" / "surface.json"
RELEASES = ROOT / "api" / "releases"

PUBLIC_MODULES = (
    "quantplug",
    "quantplug.backend",
    "quantplug.debug",
    "quantplug.distributed",
    "quantplug.conformance",
)
#: where the hook specifications live (the first that imports)
HOOKSPEC_MODULES = ("_quantplug.plugins.hookspecs", "quantplug.plugins.hookspecs")
#: classes whose public attributes plugins read, by their public name in ``quantplug``
READ_BY_PLUGINS = ("Quantizer", "BackendContext")

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _text(value: Any) -> str:
    return _ADDRESS.sub("", str(value))


def _signature(obj: Any) -> str:
    try:
        return _text(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _members(cls: type) -> dict[str, str]:
    out: dict[str, str] = {}
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            if not f.name.startswith("_"):
                out[f.name] = f"field: {_text(f.type)}"
    for name, raw in sorted(vars(cls).items()):
        if name.startswith("_"):
            continue
        if isinstance(raw, property):
            out[name] = "property" + (" (settable)" if raw.fset is not None else "")
        elif isinstance(raw, (staticmethod, classmethod)):
            out[name] = f"{type(raw).__name__}{_signature(raw.__func__)}"
        elif inspect.isfunction(raw):
            out[name] = f"method{_signature(raw)}"
    for base in cls.__mro__[1:]:
        if base.__module__.split(".")[0] not in ("quantplug", "_quantplug"):
            continue
        for name, kind in _members(base).items():
            out.setdefault(name, kind)
    return out


def describe(obj: Any) -> dict[str, Any]:
    """The shape of one public object."""
    if inspect.isclass(obj):
        entry: dict[str, Any] = {"kind": "class"}
        if issubclass(obj, enum.Enum):
            entry["members"] = [m.name for m in obj]
            return entry
        if issubclass(obj, BaseException):
            entry["kind"] = "exception"
            entry["bases"] = [b.__name__ for b in obj.__mro__[1:] if b is not object]
            return entry
        if dataclasses.is_dataclass(obj):
            entry["fields"] = {
                f.name: _text(f.type)
                + (
                    ""
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                    else " = ..."
                )
                for f in dataclasses.fields(obj)
                if not f.name.startswith("_")
            }
        entry["init"] = _signature(obj)
        entry["members"] = _members(obj)
        return entry
    if callable(obj) and (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
        return {"kind": "function", "signature": _signature(obj)}
    if inspect.ismodule(obj):
        return {"kind": "module"}
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return {"kind": "constant", "type": type(obj).__name__, "value": obj}
    if isinstance(obj, (tuple, frozenset)) and all(isinstance(v, (str, int)) for v in obj):
        return {"kind": "constant", "type": type(obj).__name__, "value": sorted(map(str, obj))}
    if callable(obj):
        return {"kind": "callable", "type": type(obj).__name__, "signature": _signature(obj)}
    return {"kind": "constant", "type": type(obj).__name__}


def _public_names(module_name: str) -> dict[str, Any] | None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    names = getattr(module, "__all__", None)
    if names is None:
        return None
    return {name: describe(getattr(module, name)) for name in sorted(names)}


def _hookspecs() -> dict[str, Any]:
    for name in HOOKSPEC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        project = module.PROJECT
        specs = {}
        for attr, fn in sorted(vars(module).items()):
            opts = getattr(fn, f"{project}_spec", None)
            if opts is None:
                continue
            specs[attr] = {
                "arguments": list(inspect.signature(fn).parameters),
                "firstresult": bool(opts.get("firstresult")),
                "historic": bool(opts.get("historic")),
            }
        return specs
    raise ImportError(f"no hook specifications in any of {HOOKSPEC_MODULES}")


def surface() -> dict[str, Any]:
    """The whole public surface, as JSON-ready data."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import quantplug

        modules = {}
        for name in PUBLIC_MODULES:
            names = _public_names(name)
            if names is not None:
                modules[name] = names
        read = {cls: _members(getattr(quantplug, cls)) for cls in READ_BY_PLUGINS}
        return {
            "version": quantplug.__version__,
            "plugin_api": getattr(importlib.import_module("quantplug"), "PLUGIN_API_VERSION", "1.0"),
            "modules": modules,
            "hookspecs": _hookspecs(),
            "read_by_plugins": read,
        }


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True, default=str) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"store it as {SNAPSHOT.relative_to(ROOT)}")
    parser.add_argument("--release", metavar="VERSION", help="store it as api/releases/VERSION.json")
    args = parser.parse_args(argv)
    text = dumps(surface())
    if args.release:
        RELEASES.mkdir(parents=True, exist_ok=True)
        (RELEASES / f"{args.release}.json").write_text(text, encoding="utf-8")
    elif args.write:
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
