"""Checks of the command line's arguments that need neither torch nor any plugin.

Everything a user can get wrong on the command line (a misspelt command, backend, option or
preset, a value out of range, a missing file) is answered from here in a fraction of a second,
before ``quantplug quantize`` imports torch and the backend's plugin (seconds).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from _quantplug.cli.errors import InputError
from _quantplug.plugins.contract import COMMON_OPTION_NAMES, STRICT_OPTION, BackendInfo
from _quantplug.plugins.contract import COMMON_OPTIONS as COMMON_OPTIONS  # here since 0.1.0
from _quantplug.suggest import close_matches, did_you_mean

#: here since 0.1.0 (the option is ``STRICT_OPTION`` of the contract)
STRICT = STRICT_OPTION

COMMANDS = ("backends", "quantize", "report", "conformance", "new-backend", "metadata", "algorithms")

#: ``package.module:factory`` (the part after the colon may be dotted: ``mod:Class.build``);
#: matched with ``fullmatch`` (``$`` would accept a trailing newline)
FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def looks_like_model(word: str) -> bool:
    """Whether a first argument that is no command names a model rather than a misspelt command."""
    return ":" in word or "/" in word or "\\" in word or "." in word or Path(word).exists()


def unknown_command(word: str) -> InputError:
    return InputError(
        f"unknown command {word!r}{did_you_mean(word, COMMANDS)}; commands: {', '.join(COMMANDS)} "
        f"(to quantize a model, give a .pt2 file or package.module:factory; there is no file {word!r})"
    )


def check_model_spec(spec: str | None) -> None:
    """The model argument names an existing file or a ``package.module:factory``."""
    if spec is None or Path(spec).exists() or FACTORY.fullmatch(spec):
        return
    hint = ""
    if not looks_like_model(spec) and close_matches(spec, COMMANDS):
        hint = f" (did you mean the command {close_matches(spec, COMMANDS)[0]!r}?)"
    raise InputError(
        f"model file {spec!r} not found{hint} (give a torch.export.save()d .pt2 file or a "
        "package.module:factory returning (model, example_inputs))"
    )


def check_calibration_path(spec: str | None, what: str = "calibration data") -> None:
    """A file, a folder, or a ``package.module:factory`` returning an iterable of batches."""
    if spec is not None and not Path(spec).exists() and not FACTORY.fullmatch(spec):
        raise InputError(
            f"{what} {spec!r} not found (a .pt file, a folder of them or a "
            "package.module:factory returning an iterable of batches)"
        )


def check_backend_options(backend: str, pairs: Mapping[str, str]) -> BackendInfo | None:
    """``--backend`` and ``--option`` against what the backend declares, without importing it.

    Raises UnknownBackendError (with suggestions), DuplicateBackendError, BackendDisabledError or
    OptionError like ``get_quantizer`` would; a backend whose plugin ships no metadata file is
    checked after it is imported. Returns the backend's declaration (None without metadata).
    """
    from _quantplug.plugins.metadata import MetadataError
    from _quantplug.plugins.registry import declared_info, entry_for

    entry_for(backend)  # the same errors as loading it, minus the import
    try:
        info: BackendInfo | None = declared_info(backend)
    except MetadataError:
        info = None  # the plugin's own declaration decides, once it is imported
    if info is None:
        return None
    for common in COMMON_OPTIONS:
        if common.name in pairs:
            common.coerce(pairs[common.name], backend=backend)
    given = {k: v for k, v in pairs.items() if k not in COMMON_OPTION_NAMES}
    info.resolve_options(given)
    return info
