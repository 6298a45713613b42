"""Files in folders others may write into: never follow a link, never leave half a file, never
read what is not a file.

``write_atomic`` replaces a file all at once. The new content goes to a temporary file with a
unique name created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, as ``tempfile.mkstemp``
does) and is written through the descriptor that creation returned, so nobody can substitute a
symbolic link for it; ``rename`` then replaces the destination's directory entry (a link there is
replaced, not followed). A writer that needs a path (ONNX, torch.save) gets one inside a private
folder (``mkdtemp``: mode 0700, unique name) for the same reason.

``refuse_planted_links`` refuses a path that goes through a symbolic link another user planted in
a shared sticky folder (``/tmp``): the rule Linux applies with ``fs.protected_symlinks``, and
``ssh``/``git`` with their ownership checks. Replacing ``--out shared/qout`` through such a link
would replace the files of whoever the link points at.

``read_json`` reads the JSON files quantplug reads back (``report.json``, ``mixed_precision.json``,
a backend's ``*.backend.json``) as untrusted input: a regular file only (a link to ``/dev/zero``
would be read until memory runs out, a FIFO would block forever), at most ``limit`` bytes, nested
at most ``max_depth`` levels (the parser itself recurses), and, unless asked, no ``NaN``,
``Infinity`` or number beyond 64 bits (what the files' readers compute with). Each refusal is an
:class:`UnreadableFileError` naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

from _quantplug.errors import QuantplugError

#: bytes, text (UTF-8), or ``write(path)`` for content another library writes to a path
FileContent = Union[bytes, str, Callable[[Path], None]]


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike[str], content: FileContent) -> list[Path]:
    """Replace ``path`` with ``content`` in one rename; returns the paths written.

    A ``write(path)`` callable may write more files beside the one it is given (an ONNX model's
    external data); they are moved next to ``path`` under the names it gave them, each in one
    rename. The file gets the usual mode of a new file (0666 less the umask); on any error
    (signals included) the temporary files are removed and ``path`` is unchanged.
    """
    final = Path(path)
    folder = final.parent
    if callable(content):
        return _write_through_private_folder(final, content)
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), 0o666 & ~umask())
        os.replace(tmp_name, final)
    except BaseException:
        _unlink_quietly(tmp_name)
        raise
    return [final]


def _write_through_private_folder(final: Path, write: Callable[[Path], None]) -> list[Path]:
    private = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
    try:
        write(private / final.name)
        # the named file last: when it appears, what it refers to is already in place
        made = sorted(private.iterdir(), key=lambda p: (p.name == final.name, p.name))
        if not made or made[-1].name != final.name:
            raise FileNotFoundError(f"the writer of {final.name} wrote no file")
        written = []
        for p in made:
            if not p.is_file() or p.is_symlink():
                raise OSError(f"the writer of {final.name} made {p.name!r}, which is not a plain file")
            os.chmod(p, 0o666 & ~umask())
            target = final.parent / p.name
            os.replace(p, target)
            written.append(target)
        return written
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _unlink_quietly(name: str | os.PathLike[str]) -> None:
    try:
        os.unlink(name)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------
# paths through links others planted
# ------------------------------------------------------------------------------------------------


class UnsafePathError(QuantplugError, ValueError):
    """A path quantplug would write through that leads through a symbolic link another user
    planted in a shared sticky folder. The message names the link and its owner."""


def planted_link(path: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """The first symbolic link met resolving ``path`` that sits in a sticky, world-writable folder
    and belongs neither to this user nor to the folder's owner, with its owner's uid; None if
    there is none (or the system has no such notion).

    Resolution follows the kernel's: component by component, each link's target in place of the
    link (``..`` after a link leaves the folder the link led to). Components that do not exist yet
    end the walk: nothing can be followed there.
    """
    if not hasattr(os, "geteuid"):
        return None
    me = os.geteuid()
    given = Path(path)  # not abspath(): it would drop "link/.." before the link is followed
    todo = list((given if given.is_absolute() else Path(os.getcwd()) / given).parts)
    current = Path(todo.pop(0))
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        step = current / part
        try:
            info = os.lstat(step)
        except OSError:
            return None
        if not stat.S_ISLNK(info.st_mode):
            current = step
            continue
        folder = os.stat(current)
        shared = folder.st_mode & stat.S_ISVTX and folder.st_mode & stat.S_IWOTH
        if shared and info.st_uid not in (me, folder.st_uid):
            return step, info.st_uid
        hops += 1
        if hops > 40:  # a loop: the write fails on its own (ELOOP)
            return None
        target = Path(os.readlink(step))
        if target.is_absolute():
            current = Path(target.anchor)
            todo = list(target.parts[1:]) + todo
        else:
            todo = list(target.parts) + todo
    return None


def refuse_planted_links(path: str | os.PathLike[str], what: str) -> None:
    """Raise :class:`UnsafePathError` when writing ``path`` (named ``what`` in the message, e.g.
    ``--out 'shared/qout'``) would go through a link another user planted (:func:`planted_link`)."""
    found = planted_link(path)
    if found is None:
        return
    link, uid = found
    try:
        import pwd

        owner = f"user {pwd.getpwuid(uid).pw_name!r}"
    except (ImportError, KeyError):
        owner = f"uid {uid}"
    raise UnsafePathError(
        f"refusing to write {what}: {str(link)!r} is a symbolic link owned by {owner} in the shared sticky "
        f"folder {str(link.parent)!r}; following it could replace another user's files. Give the folder "
        "it points to directly if it is yours"
    )


# ------------------------------------------------------------------------------------------------
# reading JSON files that may have been edited, replaced or planted
# ------------------------------------------------------------------------------------------------

#: the largest JSON file quantplug reads back, unless its reader says otherwise (a report of
#: 200,000 layers is about 60 MB)
JSON_LIMIT = 256 * 2**20
#: the deepest nesting of arrays and objects accepted (quantplug's files nest fewer than 10 levels)
JSON_DEPTH = 64
#: integers beyond this magnitude are refused: the readers compute with them as floats and sizes
_INT_LIMIT = 2**63

_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFSOCK: "a socket",
}


class UnreadableFileError(QuantplugError, ValueError):
    """A file quantplug reads that is not a regular file, is too large, or is not the JSON it
    should be (too deep, non-finite numbers). The message is ``"PATH: what is wrong"``."""


def read_regular(path: str | os.PathLike[str], *, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of ``path`` if it is a regular file (links followed) of at most ``limit`` bytes.

    Opened without blocking (``O_NONBLOCK``: opening a FIFO nobody writes to returns at once) and
    checked with ``fstat`` on the descriptor read from, so nothing can be swapped in between.
    """
    name = os.fspath(path)
    flags = (
        os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    )
    fd = os.open(name, flags | getattr(os, "O_BINARY", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = _KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file")
            raise UnreadableFileError(f"{name}: {kind}, not a regular file")
        if info.st_size > limit:
            raise UnreadableFileError(
                f"{name}: holds {_size(info.st_size)}, more than the {_size(limit)} it may"
            )
        chunks, total = [], 0
        while True:  # read to the end, whatever st_size said (a file still growing)
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UnreadableFileError(f"{name}: holds more than the {_size(limit)} it may")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_json(text: bytes | str, where: str, *, max_depth: int = JSON_DEPTH, finite: bool = True) -> Any:
    """``text`` as JSON; :class:`UnreadableFileError` naming ``where`` when it is not JSON, nests
    deeper than ``max_depth`` or (``finite``) holds ``NaN``/``Infinity`` or an integer beyond 64
    bits. ``UnicodeDecodeError`` and ``ValueError`` from the parser become that error too."""

    def constant(word: str) -> Any:
        raise UnreadableFileError(f"{where}: holds {word}, which JSON does not allow (write null)")

    def real(digits: str) -> float:
        value = float(digits)
        if not math.isfinite(value):
            raise UnreadableFileError(f"{where}: holds the number {digits[:40]}, beyond a float's range")
        return value

    def integer(digits: str) -> int:
        value = int(digits)
        if abs(value) >= _INT_LIMIT:
            raise UnreadableFileError(f"{where}: holds the integer {digits[:40]}, beyond 64 bits")
        return value

    hooks: dict[str, Any] = {"parse_constant": constant, "parse_float": real, "parse_int": integer}
    try:
        value = json.loads(text, **(hooks if finite else {}))
    except RecursionError:
        raise UnreadableFileError(f"{where}: nests arrays or objects too deeply to read") from None
    except UnicodeDecodeError as exc:
        raise UnreadableFileError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except UnreadableFileError:
        raise
    except ValueError as exc:
        raise UnreadableFileError(f"{where}: not valid JSON ({exc})") from None
    depth = _depth(value)
    if depth > max_depth:
        raise UnreadableFileError(
            f"{where}: nests arrays or objects {depth} levels deep (at most {max_depth})"
        )
    return value


def read_json(
    path: str | os.PathLike[str],
    *,
    limit: int = JSON_LIMIT,
    max_depth: int = JSON_DEPTH,
    finite: bool = True,
) -> Any:
    """A JSON file read as untrusted input (see the module docstring).

    Raises:
        UnreadableFileError: not a regular file, larger than ``limit``, or not acceptable JSON.
        OSError: the file cannot be opened (missing, no permission).
    """
    return parse_json(read_regular(path, limit=limit), os.fspath(path), max_depth=max_depth, finite=finite)


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in ``value`` (0 for a scalar), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        todo.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
