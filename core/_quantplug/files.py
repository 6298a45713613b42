"""Writing files in folders others may write into: never follow a link, never leave half a file.

``write_atomic`` replaces a file all at once. The new content goes to a temporary file with a
unique name created exclusively (``O_CREAT | O_EXCL | O_NOFOLLOW``, as ``tempfile.mkstemp``
does) and is written through the descriptor that creation returned, so nobody can substitute a
symbolic link for it; ``rename`` then replaces the destination's directory entry (a link there is
replaced, not followed). A writer that needs a path (ONNX, torch.save) gets one inside a private
folder (``mkdtemp``: mode 0700, unique name) for the same reason.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Union

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
