"""What lowering produces: named files plus metadata, saved together."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

FileContent = Union[bytes, str, Callable[[Path], None]]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@dataclass
class Artifact:
    """A backend's deployable output.

    ``files`` maps relative file names to bytes, text, or a writer callable ``write(path)`` (for
    large files produced by another library). ``metadata`` is saved as ``artifact.json``.
    Backends subclass this to add behaviour (e.g. ``run()`` through a runtime).
    """

    backend: str
    files: dict[str, FileContent] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def save(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Write every file into ``directory`` (created if needed); returns the paths written.

        Files are written to temporary names first and renamed, so an error leaves no
        half-written file behind.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        contents: Mapping[str, FileContent] = {
            **self.files,
            "artifact.json": json.dumps({"backend": self.backend, **self.metadata}, indent=2, default=str),
        }
        for name, content in contents.items():
            final = out / name
            final.parent.mkdir(parents=True, exist_ok=True)
            # the temporary name keeps the suffix (.model.XXXX.pt2): writers that check it accept it
            fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.stem}.", suffix=final.suffix)
            os.close(fd)
            tmp = Path(tmp_name)
            try:
                if isinstance(content, bytes):
                    tmp.write_bytes(content)
                elif isinstance(content, str):
                    tmp.write_text(content)
                else:
                    content(tmp)
                os.chmod(tmp, 0o644 & ~_umask())  # mkstemp creates 0600; saved files are ordinary files
                tmp.replace(final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            written.append(final)
        return written
