"""What lowering produces: named files plus metadata, saved together."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _quantplug.errors import LoweringError
from _quantplug.files import FileContent, write_atomic
from _quantplug.peers.torch_export_save import saving

#: files checked to be strict JSON before anything is written (encodings must never hold NaN)
JSON_SUFFIXES = (".json", ".encodings")


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

        JSON files (``.json``, ``.encodings``) must be strict JSON: a NaN or infinite number in
        one (a non-finite encoding) is refused before anything is written. Each file is written
        to a fresh temporary name created exclusively and renamed over its final name (see
        :func:`_quantplug.files.write_atomic`): an error leaves no half-written file, and no
        symbolic link planted in ``directory`` is followed. A writer's ``torch.export.save``
        (``model.pt2``) skips most of torch's slow copy (:mod:`_quantplug.peers.torch_export_save`).
        """
        out = Path(directory)
        try:
            metadata = json.dumps(
                {"backend": self.backend, **self.metadata}, indent=2, default=str, allow_nan=False
            )
        except ValueError as exc:
            raise LoweringError(
                f"artifact.json of backend {self.backend!r} would hold a NaN or infinite number ({exc})"
            ) from None
        contents: Mapping[str, FileContent] = {**self.files, "artifact.json": metadata}
        for name, content in contents.items():
            if name.endswith(JSON_SUFFIXES) and isinstance(content, (str, bytes)):
                _check_strict_json(name, content, self.backend)
        out.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        with saving():
            for name, content in contents.items():
                final = out / name
                final.parent.mkdir(parents=True, exist_ok=True)
                written += write_atomic(final, content)
        return written


def _check_strict_json(name: str, content: str | bytes, backend: str) -> None:
    def refuse(token: str) -> Any:
        raise LoweringError(
            f"{name} written by backend {backend!r} holds {token}: a non-finite encoding (the calibration "
            "data or the model held NaN/inf values); nothing was written"
        )

    try:
        json.loads(content, parse_constant=refuse)
    except ValueError:
        pass  # not JSON at all (another format with that suffix): the backend's business
