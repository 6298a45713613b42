"""Make ``import torchvision`` work where its compiled extension cannot load.

PyPI's ``torchvision==0.28.0`` wheel for Linux links its ``_C`` extension against the CUDA build
of torch (``libc10_cuda.so``); next to the CPU build of torch that the project installs, the
extension fails to load and torchvision's own import then stops at
``register_fake("torchvision::nms")`` (an operator only the extension defines). The zoo uses
torchvision's model definitions only, never its compiled operators, so the two schemas that the
import registers fakes for are declared here, and only when the extension really cannot load.
transformers imports torchvision when it is installed, so this runs before either.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
#: the fragment declaring the schemas (kept alive: a dropped Library unregisters them)
_LIBRARIES: list[torch.library.Library] = []


def _extension_loads(package: Path) -> bool:
    for candidate in sorted(package.glob("_C*.so")) + sorted(package.glob("_C*.pyd")):
        try:
            torch.ops.load_library(str(candidate))
        except (OSError, RuntimeError):
            return False
        return True
    return False


@functools.cache
def ensure_importable() -> bool:
    """Prepare for ``import torchvision``; False where torchvision is not installed at all."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    if not _extension_loads(Path(spec.origin).parent):
        library = torch.library.Library("torchvision", "FRAGMENT")
        for schema in _SCHEMAS:
            library.define(schema)
        _LIBRARIES.append(library)
    return True
