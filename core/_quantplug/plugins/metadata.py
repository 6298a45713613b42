"""A backend's options and presets as data, read without importing its plugin.

``quantplug quantize --help`` lists every installed backend's options, and the command line
checks ``--option`` values (names, types, choices, ranges) and suggests corrections before torch
or any plugin is imported: a help screen or a typo must neither take seconds nor run a third
party's code. So a backend ships its :class:`~_quantplug.plugins.contract.BackendInfo` as a data
file, ``<name>.backend.json``, in the folder of its plugin module (the entry point's module;
``quantplug_reference/reference.backend.json`` for ``reference = "quantplug_reference.plugin"``),
found through the import system's finders without importing anything.

The plugin's ``quantplug_backend_info()`` stays the source of truth (option checks written as
code, ``BackendOption.check``, only run there); the file is generated from it, with the backend's
rules indexes (:mod:`_quantplug.quantizer.rules_index`), by the public command::

    quantplug metadata BACKEND [BACKEND ...]           # write the files
    quantplug metadata --check BACKEND [BACKEND ...]   # exit 1 naming each stale one

(``python -m quantplug.plugins.metadata``, 0.1.0's spelling, still writes or checks the metadata
file alone.) ``load_backend`` logs a warning when a backend's file no longer matches what its
plugin declares. A backend without the file works as before; the command line then lists its
options only after importing it (``quantplug backends --check``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from _quantplug.files import UnreadableFileError, read_json
from _quantplug.plugins.contract import OPTION_TYPES, BackendInfo, BackendOption, Preset

FORMAT = "quantplug-backend/1"
SUFFIX = ".backend.json"
#: the largest metadata file read (the shipped ones are a few KB); read as untrusted input
#: (:func:`~_quantplug.files.read_json`: a regular file, nested at most 64 levels)
METADATA_LIMIT = 4 * 2**20


class MetadataError(ValueError):
    """A metadata file that cannot be read as a backend description."""


def info_to_dict(info: BackendInfo) -> dict[str, Any]:
    """The JSON-ready description of a backend (what its metadata file holds)."""
    return {
        "format": FORMAT,
        "name": info.name,
        "description": info.description,
        "preset_option": info.preset_option,
        "qat_option": info.qat_option,
        **({"requires_api": info.requires_api} if info.requires_api else {}),
        "presets": [{"name": p.name, "description": p.description} for p in info.presets],
        "options": [_option_to_dict(o) for o in info.options],
    }


def _option_to_dict(option: BackendOption) -> dict[str, Any]:
    type_name = next((n for n, t in OPTION_TYPES.items() if t is option.type), None)
    if type_name is None:
        raise MetadataError(
            f"option {option.name!r} has type {option.type!r}; metadata files describe bool, int, float "
            "and str options"
        )
    return {
        "name": option.name,
        "type": type_name,
        "default": option.default,
        "help": option.help,
        "choices": list(option.choices) if option.choices is not None else None,
        "minimum": option.minimum,
        "maximum": option.maximum,
        "exclusive_minimum": option.exclusive_minimum,
        "finite": option.finite,
        "applies_with": {k: list(v) for k, v in option.applies_with.items()},
    }


def info_from_dict(data: Any) -> BackendInfo:
    """The BackendInfo a metadata file describes (no ``check`` code: that stays in the plugin).

    ``preset_option`` and ``qat_option`` must name declared options (a ``preset_option`` naming
    another option would make every preset a value of that one), the preset option's choices
    (if it lists any) must be the presets, and the QAT option must be a bool option.
    """
    try:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise MetadataError(f"not a {FORMAT} document")
        options = tuple(_option_from_dict(o) for o in data["options"])
        presets = tuple(Preset(str(p["name"]), str(p.get("description", ""))) for p in data["presets"])
        info = BackendInfo(
            name=str(data["name"]),
            description=str(data.get("description", "")),
            options=options,
            presets=presets,
            preset_option=_optional_str(data.get("preset_option"), "preset_option"),
            qat_option=_optional_str(data.get("qat_option"), "qat_option"),
            requires_api=_optional_str(data.get("requires_api"), "requires_api"),
        )
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, MetadataError):
            raise
        raise MetadataError(f"malformed backend metadata: {type(exc).__name__}: {exc}") from None
    _check_roles(info)
    return info


def _optional_str(value: Any, key: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise MetadataError(f"{key} must be an option name or null, not {value!r}")
    return value


def _check_roles(info: BackendInfo) -> None:
    """The options the metadata gives a role (preset, QAT) exist and can play it."""
    names = [o.name for o in info.options]
    preset = info.option(info.preset_option) if info.preset_option is not None else None
    if info.preset_option is not None:
        if preset is None:
            raise MetadataError(
                f"preset_option {info.preset_option!r} names no declared option (options: {', '.join(names)})"
            )
        presets = {p.name for p in info.presets}
        if preset.choices is not None and set(map(str, preset.choices)) != presets:
            raise MetadataError(
                f"preset_option {info.preset_option!r} takes {sorted(map(str, preset.choices))}, not the "
                f"presets {sorted(presets)}"
            )
    if info.qat_option is not None:
        qat = info.option(info.qat_option)
        if qat is None or qat.type is not bool:
            raise MetadataError(f"qat_option {info.qat_option!r} names no declared bool option")


def _option_from_dict(o: Mapping[str, Any]) -> BackendOption:
    typ = OPTION_TYPES.get(o["type"])
    if typ is None:
        raise MetadataError(f"option {o.get('name')!r} has unknown type {o['type']!r}")
    choices = o.get("choices")
    return BackendOption(
        name=str(o["name"]),
        type=typ,
        default=o.get("default"),
        help=str(o.get("help", "")),
        choices=tuple(choices) if choices is not None else None,
        minimum=o.get("minimum"),
        maximum=o.get("maximum"),
        exclusive_minimum=o.get("exclusive_minimum"),
        finite=bool(o.get("finite", True)),
        applies_with={str(k): tuple(v) for k, v in (o.get("applies_with") or {}).items()},
    )


def module_folder(module: str) -> Path | None:
    """The folder holding module ``module`` (``"pkg.sub.plugin"``), found without importing it.

    Only the top-level package is looked up through the import system's finders (which does not
    execute it); the rest of the dotted path is followed as folders.
    """
    parts = module.partition(":")[0].strip().split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations is None:  # a top-level module file
        return Path(spec.origin).parent if len(parts) == 1 and spec.origin else None
    folders = [Path(p) for p in spec.submodule_search_locations]
    for part in parts[1:-1]:
        folders = [f / part for f in folders if (f / part).is_dir()]
    if len(parts) == 1:
        return folders[0] if folders else None
    last = parts[-1]
    for folder in folders:
        if (folder / last).is_dir():
            return folder / last
        if (folder / f"{last}.py").exists() or any(folder.glob(f"{last}.*.so")):
            return folder
    return None


def metadata_path(module: str, name: str) -> Path | None:
    """Where backend ``name``'s metadata file belongs (its plugin module is ``module``)."""
    folder = module_folder(module)
    return None if folder is None else folder / f"{name}{SUFFIX}"


def read_declared(module: str, name: str) -> BackendInfo | None:
    """Backend ``name``'s options and presets from its metadata file; None if it ships none.

    Raises:
        MetadataError: the file exists but is not a valid description of backend ``name``.
    """
    path = metadata_path(module, name)
    if path is None or not os.path.lexists(path):
        return None
    try:
        info = info_from_dict(read_json(path, limit=METADATA_LIMIT, finite=False))
    except UnreadableFileError as exc:
        raise MetadataError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise MetadataError(f"{path}: {exc}") from None
    if info.name != name:
        raise MetadataError(f"{path} describes backend {info.name!r}, not {name!r}")
    return info


#: the public command that writes (``--check``: checks) a backend's generated files
COMMAND = "quantplug metadata"


def stale_reason(module: str, info: BackendInfo) -> str | None:
    """Why backend ``info.name``'s metadata file does not match ``info`` (None: it matches or is absent)."""
    path = metadata_path(module, info.name)
    if path is None or not os.path.lexists(path):
        return None
    try:
        found = read_json(path, limit=METADATA_LIMIT, finite=False)
    except (OSError, ValueError) as exc:
        return f"{path} cannot be read: {exc}"
    if found != info_to_dict(info):
        return (
            f"{path} does not match the options its plugin declares; regenerate it with "
            f"`{COMMAND} {info.name}`"
        )
    return None


def metadata_text(info: BackendInfo) -> str:
    """The text of the metadata file describing ``info``."""
    return json.dumps(info_to_dict(info), indent=2) + "\n"


def expected_files(backends: Iterable[str]) -> list[tuple[Path, str]]:
    """Each backend's metadata file and the text it must hold (imports the plugins)."""
    from _quantplug.plugins.registry import load_backend

    files = []
    for name in backends:
        loaded = load_backend(name)
        path = metadata_path(loaded.entry.module, name)
        if path is None:
            raise MetadataError(f"cannot locate the folder of module {loaded.entry.module!r}")
        files.append((path, metadata_text(loaded.info)))
    return files


def write_metadata(name: str) -> Path:
    """Write backend ``name``'s metadata file next to its plugin module (imports the plugin)."""
    [(path, text)] = expected_files([name])
    path.write_text(text, encoding="utf-8")
    return path


def check_metadata(name: str) -> tuple[Path | None, str | None]:
    """Backend ``name``'s metadata file, and why it is missing or stale (None: it is current)."""
    from _quantplug.plugins.registry import load_backend

    loaded = load_backend(name)
    path = metadata_path(loaded.entry.module, name)
    if path is None or not path.is_file():
        return path, f"backend {name!r} ships no metadata file ({path}); write it with `{COMMAND} {name}`"
    return path, stale_reason(loaded.entry.module, loaded.info)


def main(argv: Sequence[str] | None = None) -> int:
    """0.1.0's command (``python -m quantplug.plugins.metadata``): the metadata files alone."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m quantplug.plugins.metadata",
        description="Write (or --check) installed backends' metadata files from their plugins "
        f"(`{COMMAND}` writes them and the backends' rules indexes).",
    )
    parser.add_argument("backends", nargs="+", metavar="BACKEND")
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    failed = False
    for name in args.backends:
        if not args.check:
            print(f"{name}: wrote {write_metadata(name)}")
            continue
        path, reason = check_metadata(name)
        if reason is not None:
            failed = True
            print(reason, file=sys.stderr)
        else:
            print(f"{name}: {path} is up to date")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
