"""The entries of a ``.pt2`` archive as torch's reader resolves them, or a refusal.

Checking an archive is only worth what it checks: exactly the bytes ``torch.export.load`` will
read. Two zip readers take part and they differ: torch's (``PyTorchFileReader``, miniz) finds a
name case-insensitively, takes the archive's folder from its *first* entry, and, when that fails
(a first entry at the root), ``torch.export.load`` falls back to the legacy format through
Python's ``zipfile``, which reads the *last* copy of a duplicated name. So :class:`Archive`:

* takes the archive's folder from the first entry, as torch does, and refuses entries outside it
  (the legacy fallback would read them) and names that differ only in case (duplicates);
* lists the entries through both readers and refuses the archive when the lists differ;
* reads each entry it checks through both (Python's checks the CRC), and refuses the archive when
  the bytes differ;
* refuses an entry that expands more than :data:`MAX_EXPANSION` times its stored size
  (``torch.export.save`` stores entries uncompressed) and, for the entries it parses, one larger
  than :data:`MAX_PARSED_BYTES`;
* turns every failure of either reader on a damaged file into an
  :class:`~_quantplug.errors.UnsafeArchiveError` naming the file.

:func:`classify` names what each entry of ``torch.export.save``'s layout is; anything else is
unexpected (``models/pwn.JSON``: torch loads every ``models/*`` entry as a program).
"""

from __future__ import annotations

import re
import struct
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from _quantplug.errors import QuantplugError, UnsafeArchiveError
from _quantplug.files import parse_json

#: an entry may hold at most this many times its stored size (plus :data:`_SMALL`):
#: ``torch.export.save`` stores entries uncompressed, deflate makes JSON ~10x smaller; a zip
#: bomb expands ~1000x
MAX_EXPANSION = 100
#: the most an entry quantplug reads to check it (a program's JSON, a payload config, example
#: inputs) may hold; a large language model's program is a few tens of MB
MAX_PARSED_BYTES = 512 * 2**20
#: the deepest nesting accepted in a program's JSON (control flow nests subgraphs)
MAX_JSON_DEPTH = 256
_SMALL = 2**20

#: (patterns are matched with ``fullmatch``)
_MODEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PAYLOAD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_EXTRA = re.compile(r"[\x20-\x7e]+")
_FIXED = frozenset(
    {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
)
_LEGACY = frozenset(
    {
        "version",
        "serialized_exported_program.json",
        "serialized_state_dict.pt",
        "serialized_state_dict.json",
        "serialized_constants.pt",
        "serialized_constants.json",
        "serialized_example_inputs.pt",
    }
)

#: what can go wrong reading a damaged zip, through Python's reader or torch's (c10::Error is a
#: RuntimeError)
_DAMAGE = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    EOFError,
    OSError,
    ValueError,
    NotImplementedError,
    RuntimeError,
    OverflowError,
    struct.error,
    zlib.error,
)


def classify(name: str) -> str | None:
    """What entry ``name`` (inside the archive's folder) is in ``torch.export.save``'s layout:
    ``meta``, ``program`` (``models/M.json``), ``sample_inputs``, ``weights_config``,
    ``constants_config``, ``payload`` (a tensor's bytes, or a pickle a config marks), ``legacy``
    (``data/weights/M.pt``: pickled weights of torch < 2.7), ``compiled`` (AOTInductor) or
    ``extra``; None when it is none of them."""
    if name in _FIXED:
        return "meta"
    folder, _, file = name.rpartition("/")
    if folder == "models":
        return "program" if file.endswith(".json") and _MODEL.fullmatch(file[: -len(".json")]) else None
    if folder == "data/sample_inputs":
        return "sample_inputs" if file.endswith(".pt") and _MODEL.fullmatch(file[: -len(".pt")]) else None
    if folder in ("data/weights", "data/constants"):
        kind = folder.rpartition("/")[2]
        suffix = f"_{kind}_config.json"
        if file.endswith(suffix) and _MODEL.fullmatch(file[: -len(suffix)]):
            return f"{kind}_config"
        if file.endswith(".pt") and _MODEL.fullmatch(file[: -len(".pt")]):
            return "legacy"
        return "payload" if _PAYLOAD.fullmatch(file) else None
    if name.startswith("data/aotinductor/"):
        return "compiled"
    if name.startswith("extra/") and _EXTRA.fullmatch(name[len("extra/") :]):
        return "extra"
    return None


def is_payload_name(text: str) -> bool:
    """Whether a config's ``path_name`` is a plain file name of ``data/weights/`` or ``data/constants/``."""
    return bool(_PAYLOAD.fullmatch(text))


def is_legacy_name(name: str) -> bool:
    """An entry of the legacy format (torch < 2.7: everything at the root)."""
    return name in _LEGACY or (name.startswith("extra_files/") and bool(_EXTRA.fullmatch(name)))


class Archive:
    """An open ``.pt2``: its entries (names inside the archive's folder, in archive order) and
    their bytes, as torch will read them. Use :func:`open_archive`."""

    def __init__(self, where: str, zip_file: zipfile.ZipFile, prefix: str, torch_reader: Any) -> None:
        self.where = where
        self.prefix = prefix
        self.legacy = prefix == ""
        self._zip = zip_file
        self._torch = torch_reader
        self._infos = {info.filename[len(prefix) :]: info for info in zip_file.infolist()}
        self.names = list(self._infos)

    def read(self, name: str) -> bytes:
        """The bytes of entry ``name``: CRC-checked, and the same through torch's reader."""
        info = self._infos[name]
        if info.file_size > MAX_PARSED_BYTES:
            raise UnsafeArchiveError(
                f"refusing to load {self.where!r}: {name} holds {info.file_size / 2**20:.0f} MiB, more than "
                f"the {MAX_PARSED_BYTES // 2**20} MiB quantplug reads to check an entry"
            )
        with damaged(self.where):
            data = self._zip.read(info)
            theirs = None if self._torch is None else bytes(self._torch.get_record(name))
        if theirs is not None and theirs != data:
            raise UnsafeArchiveError(
                f"refusing to load {self.where!r}: torch's zip reader reads other bytes for {name} than "
                "Python's; no file written by torch.export.save is ambiguous: it was crafted or damaged"
            )
        return data

    def json(self, name: str) -> Any:
        """Entry ``name`` parsed as JSON (``NaN``/``Infinity`` allowed: torch writes them)."""
        return parse_json(self.read(name), f"{self.where}: {name}", max_depth=MAX_JSON_DEPTH, finite=False)


@contextmanager
def damaged(where: str) -> Iterator[None]:
    """A reader's failure on a damaged (or crafted) zip as an :class:`UnsafeArchiveError`."""
    try:
        yield
    except QuantplugError:
        raise
    except _DAMAGE as exc:
        text = str(exc).strip().splitlines()
        reason = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
        raise UnsafeArchiveError(
            f"refusing to load {where!r}: the archive is damaged ({reason}); save the program again "
            "with torch.export.save"
        ) from None


@contextmanager
def open_archive(path: Any) -> Iterator[Archive]:
    """The archive at ``path``, its layout checked (see the module docstring).

    Raises:
        QuantplugError: not a zip archive, or not one of torch.export.
        UnsafeArchiveError: damaged, ambiguous (entries outside its folder, names differing only in
            case, readers that disagree), or an entry expanding like a zip bomb.
    """
    where = str(path)
    with damaged(where):
        try:
            zip_file = zipfile.ZipFile(path)
        except (OSError, zipfile.BadZipFile) as exc:
            raise QuantplugError(
                f"{where!r} is not a torch.export archive (.pt2 files are zip archives): {exc}"
            ) from None
    with zip_file:
        infos = zip_file.infolist()
        if not infos:
            raise QuantplugError(f"{where!r} is an empty zip archive, not a torch.export program")
        first = infos[0].filename
        prefix = first[: first.index("/") + 1] if "/" in first else ""
        _check_layout(where, infos, prefix)
        if prefix and not any(info.filename == prefix + "archive_format" for info in infos):
            raise QuantplugError(
                f"{where!r} is a zip archive but not a torch.export program (no archive_format entry); "
                "write one with torch.export.save(torch.export.export(model, example_inputs), path)"
            )
        reader = None
        if prefix:
            with damaged(where):
                reader = _torch_reader(where, infos, prefix)
        yield Archive(where, zip_file, prefix, reader)


def _check_layout(where: str, infos: list[zipfile.ZipInfo], prefix: str) -> None:
    seen: dict[str, str] = {}
    problems = []
    if prefix:
        outside = [i.filename for i in infos if not i.filename.startswith(prefix)]
        why = f"outside the archive's folder {prefix!r} (torch's reader then fails"
    else:  # the legacy format keeps everything at the root (extra files in extra_files/)
        outside = [
            i.filename for i in infos if "/" in i.filename and not i.filename.startswith("extra_files/")
        ]
        why = f"in folders while the first, {infos[0].filename!r}, lies at the root (torch's reader fails"
    if outside:
        problems.append(
            f"{len(outside)} entr{'y' if len(outside) == 1 else 'ies'} ({outside[0]!r}"
            f"{', ...' if len(outside) > 1 else ''}) {'lies' if len(outside) == 1 else 'lie'} {why} and "
            "falls back to the legacy format, which unpickles its state)"
        )
    for info in infos:
        name = info.filename
        key = name.lower()  # torch's reader finds names case-insensitively
        if key in seen:
            problems.append(
                f"entry {name!r} is stored twice (torch's reader and Python's read different copies)"
                if seen[key] == name
                else f"entries {seen[key]!r} and {name!r} differ only in case (torch's reader finds "
                "names case-insensitively)"
            )
        seen.setdefault(key, name)
        if info.file_size > info.compress_size * MAX_EXPANSION + _SMALL:
            problems.append(
                f"entry {name!r} expands from {info.compress_size:,} to {info.file_size:,} bytes "
                f"({info.file_size // max(info.compress_size, 1):,}x; torch.export.save stores entries "
                "uncompressed)"
            )
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise UnsafeArchiveError(
            f"refusing to load {where!r}: {shown}. No file written by torch.export.save looks like this: "
            "it was crafted or damaged."
        )


def _torch_reader(where: str, infos: list[zipfile.ZipInfo], prefix: str) -> Any:
    """torch's own reader of the archive, once it lists the same entries, of the same sizes."""
    import torch

    reader = torch._C.PyTorchFileReader(where)
    listed = list(reader.get_all_records())
    ours = [info.filename[len(prefix) :] for info in infos]
    same = listed == ours and all(
        int(reader.get_record_size(name)) == info.file_size for name, info in zip(ours, infos)
    )
    if not same:
        raise UnsafeArchiveError(
            f"refusing to load {where!r}: torch's zip reader and Python's see different entries "
            f"({len(listed)} against {len(ours)}, or of other sizes); no file written by "
            "torch.export.save is ambiguous: it was crafted or damaged"
        )
    return reader
