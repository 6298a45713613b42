"""``quantplug new-backend NAME``: a complete, installable backend distribution to start from.

The generated distribution passes ``quantplug conformance NAME`` as soon as it is installed:
an entry point, a plugin module implementing the hooks a backend needs, presets and configs
(uint8 activations, int8 per-channel weights, int32 derived bias), one rules module (linear,
conv2d, relu, add), a constraint table (with "add inputs share one scale"), a fusion pattern,
an artifact writer, a conformance profile, tests and a README. ``docs/writing-a-backend.md``
walks through each file.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from _quantplug.errors import QuantplugError
from _quantplug.files import UnsafePathError, refuse_planted_links, umask
from _quantplug.scaffold.templates import FILES, RULES_INDEX_TEMPLATE

#: a backend name: a lowercase identifier (matched with ``fullmatch``: ``$`` would accept a
#: trailing newline, and a folder named ``quantplug-abc\n`` would be written)
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
#: the longest backend name: it is a folder name, a package name and a distribution name
#: (``quantplug-`` plus the name must fit a file name, 255 bytes, with room to spare)
NAME_LIMIT = 64


class ScaffoldError(QuantplugError, ValueError):
    """A backend name or target directory ``new-backend`` cannot use, or a write that failed
    (nothing is left behind: the distribution appears whole or not at all)."""


def names(name: str) -> dict[str, str]:
    """The names derived from a backend name: distribution, import package, title."""
    if not NAME_PATTERN.fullmatch(name) or name.endswith("_") or "__" in name or len(name) > NAME_LIMIT:
        shown = repr(name) if len(name) <= NAME_LIMIT else f"{name[:20]!r}... ({len(name)} characters)"
        raise ScaffoldError(
            f"backend name {shown} must be a lowercase identifier of at most {NAME_LIMIT} characters "
            "([a-z][a-z0-9_]*, e.g. 'my_npu'); it is what users type in get_quantizer(name)"
        )
    return {
        "name": name,
        "dist": "quantplug-" + name.replace("_", "-"),
        "package": "quantplug_" + name,
        "title": " ".join(part.upper() if len(part) <= 3 else part.capitalize() for part in name.split("_")),
    }


def render(name: str) -> dict[str, str]:
    """Relative path -> content of every file of the distribution for backend ``name``."""
    values = names(name)
    rendered: dict[str, str] = {}
    for path, text in FILES.items():
        for key, value in values.items():
            path = path.replace("{{" + key + "}}", value)
            text = text.replace("{{" + key + "}}", value)
        rendered[path] = text
    return rendered


def create_backend(name: str, directory: str | Path = ".") -> Path:
    """Write the distribution of backend ``name`` into ``directory/quantplug-<name>/``.

    The files are written into a private folder beside the target and renamed into place at
    once: a full or read-only disk, or any other failure, leaves nothing behind (a rerun finds
    the target as it was). ``directory`` is created if missing.

    Raises:
        ScaffoldError: the name is not a lowercase identifier, ``directory`` is not a folder (or
            reached through a link another user planted in a shared sticky folder), the target
            exists and is not empty (nothing is overwritten), or the files cannot be written
            (the message names the path and the reason: no space, read-only...).
    """
    files = render(name)
    folder = Path(directory)
    try:
        refuse_planted_links(folder, f"--dir {str(folder)!r}")
    except UnsafePathError as exc:
        raise ScaffoldError(str(exc)) from None
    root = folder / names(name)["dist"]
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise ScaffoldError(
            f"--dir {str(folder)!r} is not a folder; give the folder to create {root.name}/ in"
        )
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ScaffoldError(f"{root} already exists and is not empty; choose another --dir or remove it")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=folder))
    except OSError as exc:
        raise _write_error(exc, folder) from None
    try:
        for rel, text in files.items():
            target = private / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        os.chmod(private, 0o777 & ~umask())
        os.rename(private, root)  # replaces an empty folder; the files appear all at once
    except OSError as exc:
        shutil.rmtree(private, ignore_errors=True)
        raise _write_error(exc, root) from None
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    return root


def expected_files() -> list[tuple[Path, str]]:
    """The template of the rules index a generated distribution ships, and the text it must hold.

    It is the index of the generated rules module's declarations, found as a vendor's is: the
    distribution is written into a scratch folder and its rules package imported from there.
    """
    import sys
    import tempfile

    from _quantplug.quantizer.rules_index import expected_index

    probe = names("scaffold_probe")
    with tempfile.TemporaryDirectory() as scratch:
        root = str(create_backend(probe["name"], scratch))
        sys.path.insert(0, root)
        try:
            _, text = expected_index(f"{probe['package']}.rules")
        finally:
            sys.path.remove(root)
            for module in [m for m in sys.modules if m.split(".")[0] == probe["package"]]:
                del sys.modules[module]
    return [(RULES_INDEX_TEMPLATE, text.replace(probe["package"], "{{package}}"))]


def _write_error(exc: OSError, where: Path) -> ScaffoldError:
    remedy = "free some space or choose" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "choose"
    return ScaffoldError(
        f"cannot write {where}: {exc.strerror or exc}; nothing was written ({remedy} another --dir)"
    )
