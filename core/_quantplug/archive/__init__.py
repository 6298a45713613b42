"""Loading ``.pt2`` archives without running the code a hostile one can carry.

Loading a model runs code, as unpickling does: treat a ``.pt2`` from an untrusted source like a
script. ``torch.export.load`` runs an archive's code in several places:

* weights and constants marked ``use_pickle``, custom and opaque objects, the example inputs (and
  the legacy format's state) are unpickled, some with ``weights_only=False`` (any code);
* compiled AOTInductor models (shared libraries) are loaded;
* symbolic-shape expressions are parsed with ``sympy.sympify`` (``eval``);
* input guards (``guards_code``) are executed as Python; node, input and attribute names are
  pasted into the Python code torch.fx generates for the program; an op name may resolve to any
  function reachable from ``torch`` (``torch.os.system``).

:func:`load_program` reads the archive first, exactly as torch's reader will
(:mod:`~_quantplug.archive.entries`: the same entries, the same bytes, every entry), and refuses
with :class:`~_quantplug.errors.UnsafeArchiveError`, naming what and where:

* always: an entry outside ``torch.export.save``'s layout (torch loads every ``models/*`` entry
  as a program), an ambiguous archive (a name stored twice, in any case; an entry outside the
  archive's folder, which sends torch to the legacy format), a damaged one, an entry expanding
  like a zip bomb, and names, expressions, guards or op targets that are not of the plain forms
  ``torch.export.save`` writes (:mod:`~_quantplug.archive.program`);
* unless ``allow_pickle=True`` (for files you trust): pickled or compiled entries, and archives
  in the legacy format (torch < 2.7), whose state torch unpickles.

Only then does ``torch.export.load`` run.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from _quantplug.archive.entries import Archive, classify, is_legacy_name, is_payload_name, open_archive
from _quantplug.archive.program import code_in_program, is_fqn
from _quantplug.errors import QuantplugError, UnsafeArchiveError

#: kinds of problem: only ``allow_pickle`` lets ``_PICKLED`` ones through; no file written by
#: torch.export.save has the others (code where plain names belong, entries outside its layout)
_PICKLED = "pickled"
_CODE = "code"
_LAYOUT = "layout"


def load_program(path: str | Path, *, allow_pickle: bool = False) -> Any:
    """``torch.export.load(path)`` once :func:`check_archive` found nothing that would run code.

    Args:
        path: a ``.pt2`` file written by ``torch.export.save``.
        allow_pickle: accept pickled entries, compiled code and the legacy format (their loading
            may run any code the file holds): only for files you trust. The layout, names,
            expressions and guards are checked either way.

    Raises:
        UnsafeArchiveError: the archive would run code when loaded, or cannot be checked
            (damaged, ambiguous, oversized entries).
        QuantplugError: the file is not a torch.export archive, or torch cannot load it (with
            the reason torch gave, not a pointer to hidden warnings).
    """
    check_archive(path, allow_pickle=allow_pickle)
    import torch

    with _captured_torch_logs() as records:
        try:
            return torch.export.load(str(path))
        except Exception as exc:
            detail = next((r for r in records if r.exc_info and r.exc_info[1] is not None), None)
            cause = detail.exc_info[1] if detail is not None and detail.exc_info else exc
            text = str(cause).strip().splitlines()
            reason = f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
            raise QuantplugError(f"torch.export cannot load {str(path)!r}: {reason}") from exc


@contextmanager
def _captured_torch_logs() -> Iterator[list[logging.LogRecord]]:
    """torch.export.load logs the real error (a WARNING with the traceback) before raising one
    that says "check the warnings above"; keep those records to report the cause instead."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("torch.export")
    handler, propagate = Keep(), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def check_archive(path: str | Path, *, allow_pickle: bool = False) -> None:
    """Refuse an archive whose loading would run code, or that cannot be checked (see the
    module docstring)."""
    with open_archive(path) as archive:
        problems = _legacy_problems(archive) if archive.legacy else _problems(archive)
    _refuse(
        archive.where, [(kind, text) for kind, text in problems if not (allow_pickle and kind == _PICKLED)]
    )


def _problems(archive: Archive) -> list[tuple[str, str]]:
    kinds = {name: classify(name) for name in archive.names}
    problems: list[tuple[str, str]] = [
        (_LAYOUT, _unexpected(name)) for name, kind in kinds.items() if kind is None
    ]
    if not any(kind == "program" for kind in kinds.values()):
        raise QuantplugError(f"{archive.where!r} holds no exported program (no models/*.json entry)")
    for name, kind in kinds.items():
        if kind == "compiled":
            problems.append((_PICKLED, f"{name} is compiled AOTInductor code (loaded as a shared library)"))
        elif kind == "legacy":
            problems.append((_PICKLED, f"{name} is a pickled legacy weights file"))
        elif kind == "program":
            problems += [(_CODE, f"{name}: {p}") for p in code_in_program(archive.json(name))]
        elif kind in ("weights_config", "constants_config"):
            problems += _config_problems(name, archive.json(name))
        elif kind == "sample_inputs" and not _loads_without_pickle(archive.read(name)):
            problems.append((_PICKLED, f"{name} holds pickled objects other than tensors"))
    return problems


def _unexpected(name: str) -> str:
    if name.startswith("models/"):
        return (
            f"{name}: torch loads every models/ entry as a program; torch.export.save writes models/NAME.json"
        )
    return f"{name} is not an entry torch.export.save writes"


def _config_problems(name: str, doc: Any) -> list[tuple[str, str]]:
    """A weights or constants config: plain attribute paths and file names; pickles marked."""
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        return [(_LAYOUT, f"{name} is not a payload config (no 'config' object)")]
    problems: list[tuple[str, str]] = []
    for fqn, meta in config.items():
        if not is_fqn(fqn):
            problems.append((_CODE, f"{name}: {fqn!r} is not a plain attribute path"))
        if not isinstance(meta, dict):
            problems.append((_LAYOUT, f"{name}: the entry of {fqn!r} is not an object"))
            continue
        path_name = meta.get("path_name")
        if not isinstance(path_name, str) or not is_payload_name(path_name):
            problems.append(
                (_LAYOUT, f"{name}: {fqn!r} is stored under {path_name!r}, not a plain file name")
            )
        elif meta.get("use_pickle"):
            problems.append((_PICKLED, f"{fqn!r} is stored pickled ({name})"))
        elif path_name.startswith(("custom_obj", "opaque_obj")):
            problems.append((_PICKLED, f"{fqn!r} is a pickled object ({name})"))
    return problems


def _legacy_problems(archive: Archive) -> list[tuple[str, str]]:
    """The format of torch < 2.7, read through Python's zipfile: a JSON program and pickled state."""
    if "serialized_exported_program.json" not in archive.names:
        raise QuantplugError(
            f"{archive.where!r} is a zip archive but not a torch.export program (no archive_format "
            "entry); write one with torch.export.save(torch.export.export(model, example_inputs), path)"
        )
    problems: list[tuple[str, str]] = [
        (_LAYOUT, f"{name} is not an entry of torch's legacy format")
        for name in archive.names
        if not is_legacy_name(name)
    ]
    problems.append(
        (
            _PICKLED,
            "it is in torch's legacy format (torch < 2.7), whose state torch unpickles; save it again "
            "with a current torch.export.save",
        )
    )
    program = archive.json("serialized_exported_program.json")
    problems += [(_CODE, f"serialized_exported_program.json: {p}") for p in code_in_program(program)]
    return problems


def _loads_without_pickle(data: bytes) -> bool:
    """Whether torch's restricted unpickler reads ``data`` (then torch never falls back to the
    unrestricted one, which runs code)."""
    if not data:
        return True
    import torch

    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception:
        return False
    return True


def _refuse(where: str, problems: list[tuple[str, str]]) -> None:
    if not problems:
        return
    texts = [text for _, text in problems]
    shown = "; ".join(texts[:3]) + (f"; and {len(texts) - 3} more" if len(texts) > 3 else "")
    kinds = {kind for kind, _ in problems}
    what = (
        "loading it would run code"
        if kinds - {_LAYOUT}
        else "its entries are not those torch.export.save writes"
    )
    advice = (
        " If you trust this file, pass allow_pickle=True (CLI: --allow-pickle): loading it may then run "
        "any code it holds."
        if _PICKLED in kinds
        else " No file written by torch.export.save looks like this: it was crafted or damaged."
    )
    raise UnsafeArchiveError(f"refusing to load {where!r}: {what} ({shown}).{advice}")


__all__ = ["check_archive", "load_program"]
