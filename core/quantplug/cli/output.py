"""Writing --out all at once: files go to a temporary folder next to it, renamed into place at
the end, so a failed run leaves --out as it was."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

from quantplug.cli.inputs import InputError


class StagedOutput:
    """``with StagedOutput(out) as stage: write into stage.path; stage.commit()``.

    Without ``commit()`` (an error) the staging folder is removed and ``out`` is untouched.
    ``commit()`` renames the staging folder to ``out`` when ``out`` does not exist; otherwise it
    replaces, entry by entry, only the names this run wrote (other files in ``out`` are kept).
    """

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise InputError(f"--out {str(self.out)!r} exists and is not a folder")
        parent = self.out.absolute().parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=parent))
        except OSError as exc:
            raise InputError(f"cannot write --out {str(self.out)!r}: {exc.strerror or exc}") from exc
        self.committed = False

    def __enter__(self) -> StagedOutput:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)

    def files(self) -> list[tuple[str, int]]:
        """(relative path, bytes) of every file staged so far, sorted."""
        found = []
        for root, _, names in os.walk(self.path):
            for name in names:
                p = Path(root) / name
                found.append((p.relative_to(self.path).as_posix(), p.stat().st_size))
        return sorted(found)

    def _normalize_modes(self) -> None:
        """mkdtemp/mkstemp create private (0700/0600) entries; give them the usual umask modes."""
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.path, 0o777 & ~umask)
        for root, dirs, names in os.walk(self.path):
            for d in dirs:
                os.chmod(Path(root) / d, 0o777 & ~umask)
            for name in names:
                os.chmod(Path(root) / name, 0o666 & ~umask)

    def commit(self) -> None:
        self._normalize_modes()
        if not self.out.exists():
            os.replace(self.path, self.out)
        else:
            for entry in sorted(self.path.iterdir()):
                target = self.out / entry.name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()
                os.replace(entry, target)
            shutil.rmtree(self.path, ignore_errors=True)
        self.committed = True
