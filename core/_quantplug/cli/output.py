"""Writing ``--out`` all at once: afterwards it holds either the previous complete output or the
new one, never a mix, whatever the filesystem and however the run ends.

Everything a run writes goes to a private staging folder on the same filesystem as ``--out``'s
final location (``--out`` resolved through symbolic links), so that renames, never copies, put
it in place:

* the *anchor* folder holds the staging folder, the lock and the journal: the parent of the
  resolved ``--out``, or ``--out`` itself when it cannot be renamed (a mount point, a bind mount
  included; another user's folder in a sticky parent; a parent the user may not write), decided
  before the run, not found at its end;
* ``--out`` absent: the staging folder is renamed to it;
* ``--out`` holding nothing but quantplug outputs: the two folders are swapped in one system call
  (``renameat2(RENAME_EXCHANGE)`` on Linux, ``renamex_np(RENAME_SWAP)`` on macOS); where the
  filesystem has no such call, ``--out`` is renamed aside and the staging folder into place (for
  an instant ``--out`` is absent, never mixed; a run killed there is rolled back by the next);
* otherwise (``--out`` is a mount point, or holds files of the user's, which are kept): each
  output entry is renamed into ``--out`` under a journal, and rolled back on any error; a run
  killed meanwhile (SIGKILL, power loss) is rolled back by the next run targeting ``--out``.

The commit's renames run with SIGINT/SIGTERM/SIGHUP blocked; before it, the command line turns
those signals into exceptions, so the staging folder is removed however the run stops. A lock
(``flock``) makes a second run targeting the same ``--out`` fail at once with a clear error.

``--out`` is never reached through a symbolic link another user planted in a shared sticky
folder (:func:`~_quantplug.files.refuse_planted_links`); a full or read-only filesystem stops the
run with one line naming the path (:func:`storage_error`), the previous output in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from _quantplug.cli.errors import InputError
from _quantplug.files import read_json, refuse_planted_links, umask, write_atomic

#: what ``quantplug quantize`` writes into --out (plus whatever this run staged)
OUTPUT_NAMES = frozenset({"quantized.pt2", "artifact", "report.html", "report.json"})

_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


#: a full or read-only filesystem: the user's to fix (exit 2, naming the path), not quantplug's
_STORAGE = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space", errno.EFBIG: "free some space"}
_STORAGE[errno.EROFS] = "make it writable"


def storage_cause(exc: BaseException) -> OSError | None:
    """The error of a full or read-only filesystem ``exc`` is or was raised from, if any."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno in _STORAGE:
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def storage_error(exc: BaseException, what: str) -> InputError | None:
    """The one-line error for a run stopped by a full or read-only filesystem, naming ``what``
    (``--out 'DIR'``) and the file being written; None when ``exc`` is something else."""
    cause = storage_cause(exc)
    if cause is None or cause.errno is None:
        return None
    name = f" ({cause.filename})" if cause.filename else ""
    return InputError(
        f"cannot write {what}: {cause.strerror or os.strerror(cause.errno)}{name}; "
        f"{_STORAGE[cause.errno]} or choose another folder (nothing was replaced)"
    )


class StagedOutput:
    """``with StagedOutput(out) as stage: write into stage.path; stage.commit()``.

    Creating it takes the lock on ``out`` (or raises ``InputError`` naming the run holding it)
    and finishes or rolls back a previous run's interrupted commit. Without ``commit()`` (an
    error, a signal) the staging folder is removed and ``out`` is untouched.
    """

    def __init__(self, out: str | os.PathLike[str]) -> None:
        self.out = Path(out)
        refuse_planted_links(self.out, f"--out {str(self.out)!r}")
        self.target = Path(os.path.realpath(self.out))
        if self.target.exists() and not self.target.is_dir():
            raise InputError(f"--out {str(self.out)!r} exists and is not a folder")
        parent = self.target.parent
        # a folder that cannot be renamed (a mount point, bind mounts included; one of another
        # user's in a sticky folder) is replaced entry by entry: found now, not at the commit
        movable = not (self.target.exists() and not _renamable(self.target))
        if movable:
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InputError(f"cannot write --out {str(self.out)!r}: {exc.strerror or exc}") from exc
            movable = os.access(parent, os.W_OK | os.X_OK)
        if movable:
            self.anchor, self.prefix = parent, f".{self.target.name}.quantplug-"
        elif self.target.is_dir():
            self.anchor, self.prefix = self.target, ".quantplug-"
        else:
            raise InputError(
                f"cannot create --out {str(self.out)!r}: its folder {str(parent)!r} is not writable"
            )
        self.committed = False
        self._lock = _Lock(self.anchor / f"{self.prefix}lock", self.out)
        try:
            self._recover()
            self.path = Path(tempfile.mkdtemp(prefix=f"{self.prefix}stage-", dir=self.anchor))
        except OSError as exc:
            self._lock.release()
            raise InputError(f"cannot write --out {str(self.out)!r}: {exc.strerror or exc}") from exc
        except BaseException:
            self._lock.release()
            raise

    def __enter__(self) -> StagedOutput:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if not self.committed:
                shutil.rmtree(self.path, ignore_errors=True)
            self._remove_leftovers()
        finally:
            self._lock.release()

    def files(self) -> list[tuple[str, int]]:
        """(relative path, bytes) of every file staged so far, sorted."""
        found = []
        for root, _, names in os.walk(self.path):
            for name in names:
                p = Path(root) / name
                found.append((p.relative_to(self.path).as_posix(), p.stat().st_size))
        return sorted(found)

    # -- commit ---------------------------------------------------------------------------------

    def commit(self) -> None:
        """Put the staged output in place (see the module docstring for how)."""
        self._prepare_tree()
        with _signals_blocked():
            if not self.target.exists():
                os.rename(self.path, self.target)
            elif self.anchor != self.target and self._only_outputs_in_target():
                self._swap_folders()
            else:
                self._replace_entries()
            self.committed = True
            _fsync_dir(self.target.parent)

    def _prepare_tree(self) -> None:
        """Usual modes (mkdtemp/mkstemp make 0700/0600 entries), contents on disk before renames."""
        mask = umask()
        for root, dirs, names in os.walk(self.path):
            for d in dirs:
                os.chmod(Path(root) / d, 0o777 & ~mask)
            for name in names:
                p = Path(root) / name
                os.chmod(p, 0o666 & ~mask)
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            _fsync_dir(Path(root))
        mode = stat.S_IMODE(os.stat(self.target).st_mode) if self.target.is_dir() else 0o777 & ~mask
        os.chmod(self.path, mode)

    def _only_outputs_in_target(self) -> bool:
        names = {p.name for p in self.path.iterdir()} | OUTPUT_NAMES
        return all(entry.name in names for entry in self.target.iterdir())

    def _swap_folders(self) -> None:
        if exchange(self.path, self.target):
            return  # the previous output is now at self.path, removed on exit
        old = Path(tempfile.mkdtemp(prefix=f"{self.prefix}old-", dir=self.anchor))
        os.rmdir(old)  # a unique name for the previous output
        write_atomic(self._journal_path, json.dumps({"kind": "swap", "old": old.name}))
        os.rename(self.target, old)
        try:
            os.rename(self.path, self.target)
        except BaseException:
            os.rename(old, self.target)
            self._journal_path.unlink()
            raise
        self._journal_path.unlink()
        shutil.rmtree(old, ignore_errors=True)

    def _replace_entries(self) -> None:
        names = sorted({p.name for p in self.path.iterdir()} | OUTPUT_NAMES)
        old = Path(tempfile.mkdtemp(prefix=f"{self.prefix}old-", dir=self.anchor))
        existed = {n: os.path.lexists(self.target / n) for n in names}
        journal = {"kind": "entries", "stage": self.path.name, "old": old.name, "entries": existed}
        write_atomic(self._journal_path, json.dumps(journal))
        try:
            for name in names:
                if existed[name]:
                    os.rename(self.target / name, old / name)
                if os.path.lexists(self.path / name):
                    os.rename(self.path / name, self.target / name)
        except BaseException:
            _roll_back(self.target, self.path, old, existed)
            self._journal_path.unlink()  # (kept if the rollback itself failed: the next run retries)
            raise
        self._journal_path.unlink()
        shutil.rmtree(old, ignore_errors=True)

    # -- after an interrupted run -----------------------------------------------------------------

    @property
    def _journal_path(self) -> Path:
        return self.anchor / f"{self.prefix}journal"

    def _recover(self) -> None:
        """Roll back a commit a killed run left half done, then drop its staging folders.

        Only what this user's runs wrote is trusted (the anchor may be a shared folder): a
        journal of someone else's, or naming more than plain entry names, is ignored.
        """
        journal = _own_journal(self._journal_path)
        if journal is not None:
            old = self.anchor / journal["old"]
            if journal["kind"] == "swap":  # killed between the two renames of a folder swap
                if not self.target.exists() and _owned(old):
                    os.rename(old, self.target)
            else:
                _roll_back(self.target, self.anchor / journal["stage"], old, journal["entries"])
        if os.path.lexists(self._journal_path) and _owned(self._journal_path):
            self._journal_path.unlink()
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Staging and previous-output folders of this run, or of runs that died (we hold the lock)."""
        for kind in ("stage-", "old-"):
            for p in self.anchor.glob(f"{self.prefix}{kind}*"):
                if (p != getattr(self, "path", None) or self.committed) and _owned(p):
                    shutil.rmtree(p, ignore_errors=True)


def _renamable(folder: Path) -> bool:
    """Whether this process may rename ``folder`` (an existing folder): not a mount point, and
    not in a sticky parent unless this user owns it or the parent (or is root)."""
    if os.path.ismount(folder) or str(folder) in _mount_points():
        return False
    if not hasattr(os, "geteuid"):
        return True
    parent = os.stat(folder.parent)
    if not parent.st_mode & stat.S_ISVTX:
        return True
    me = os.geteuid()
    return me == 0 or me in (os.lstat(folder).st_uid, parent.st_uid)


def _mount_points() -> set[str]:
    """Every mount point (Linux's /proc/self/mountinfo), bind mounts included: ``os.path.ismount``
    misses a bind mount of a folder of the same filesystem (same device, another inode)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split()
        if len(fields) > 4:  # the 5th field, with spaces and the like octal-escaped (\040)
            points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def _owned(path: Path) -> bool:
    """Whether ``path`` (not followed) belongs to this user (always true where uids do not exist)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return not hasattr(os, "getuid") or info.st_uid == os.getuid()


def _own_journal(path: Path) -> dict[str, Any] | None:
    """A previous run's journal, if it is this user's and well formed."""
    if not os.path.lexists(path) or path.is_symlink() or not _owned(path):
        return None
    try:
        journal = read_json(path, limit=2**20)
    except (OSError, ValueError):
        return None
    if not isinstance(journal, dict) or not isinstance(journal.get("entries", {}), dict):
        return None
    plain = re.compile(r"[^/\\\n]+")
    names = [journal.get("old"), *journal.get("entries", {})]
    if journal.get("kind") == "entries":
        names.append(journal.get("stage"))
    if journal.get("kind") not in ("swap", "entries") or not all(
        isinstance(n, str) and plain.fullmatch(n) and n not in (".", "..") for n in names
    ):
        return None
    return journal


def _roll_back(target: Path, stage: Path, old: Path, entries: dict[str, bool]) -> None:
    """Undo an entry-by-entry commit: every entry back as it was before it started."""
    for name, existed in entries.items():
        current, saved, staged = target / name, old / name, stage / name
        if existed:
            if os.path.lexists(saved):  # moved aside; what is in place now (if anything) is new
                if os.path.lexists(current):
                    _remove(current)
                os.rename(saved, current)
        elif not os.path.lexists(staged) and os.path.lexists(current):
            _remove(current)  # did not exist before and was put in place
    shutil.rmtree(old, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: folders cannot be opened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP until the block ends (a commit's renames run to completion)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# ------------------------------------------------------------------------------------------------
# swapping two folders in one system call
# ------------------------------------------------------------------------------------------------

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # Linux renameat2 flag
_RENAME_SWAP = 2  # macOS renamex_np flag
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "arm64": 276}


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None


def exchange(a: Path, b: Path) -> bool:
    """Swap the entries ``a`` and ``b`` (same filesystem) atomically; False where unsupported."""
    libc = _libc()
    if libc is None:
        return False
    src, dst = os.fsencode(a), os.fsencode(b)
    if sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        result = libc.renamex_np(src, dst, ctypes.c_uint(_RENAME_SWAP))
    elif sys.platform.startswith("linux"):
        if hasattr(libc, "renameat2"):
            result = libc.renameat2(_AT_FDCWD, src, _AT_FDCWD, dst, ctypes.c_uint(_RENAME_EXCHANGE))
        elif os.uname().machine in _SYS_RENAMEAT2:
            number = _SYS_RENAMEAT2[os.uname().machine]
            result = libc.syscall(number, _AT_FDCWD, src, _AT_FDCWD, dst, ctypes.c_uint(_RENAME_EXCHANGE))
        else:
            return False
    else:
        return False
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # the filesystem (or kernel) cannot: the caller renames instead
    raise OSError(err, os.strerror(err), str(b))


# ------------------------------------------------------------------------------------------------
# the lock
# ------------------------------------------------------------------------------------------------


class _Lock:
    """An exclusive, non-blocking lock on a file holding the owner's pid; removed on release."""

    def __init__(self, path: Path, out: Path) -> None:
        self.path = path
        self.fd: int | None = None
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            except OSError as exc:
                raise InputError(f"cannot lock --out {str(out)!r}: {exc.strerror or exc}") from exc
            if not _try_lock(fd):
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise InputError(
                    f"another quantplug run (pid {holder}) is writing --out {str(out)!r}; wait for it to "
                    "finish or choose another --out"
                )
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed that file as we opened it: take a fresh one
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)  # closing releases the lock
        self.fd = None


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
        except OSError:
            return False
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:  # a filesystem without locks: run unlocked rather than not at all
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            return True
        raise
    return True
