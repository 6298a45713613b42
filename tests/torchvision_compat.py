"""``import torchvision`` next to the CPU build of torch, for the test session only.

PyPI's torchvision 0.28.0 wheel is built against CUDA torch; next to ``torch==2.13.0+cpu`` its
``_C`` extension does not load, and ``import torchvision`` then fails registering fake kernels for
``torchvision::nms``/``qnms`` (``operator torchvision::nms does not exist``). So
``scripts/setup.sh --test`` leaves such a build out of ``.venv`` (a user's environment imports
transformers, and says plainly that torchvision is absent) and installs it for the tests in
:data:`TEST_PACKAGES`, which ``tests/conftest.py`` puts on the session's path. Declaring those two
schemas lets its pure-Python models import; no test calls a detection op.
``tests/test_environment.py`` checks, in a subprocess without this module, that ``.venv`` itself
imports what it holds.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

#: where ``scripts/setup.sh --test`` installs the tests' torchvision when ``.venv`` can hold none
TEST_PACKAGES = Path(__file__).resolve().parent.parent / ".test-packages"

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None  # the Library declaring the schemas, kept alive for the session


def ensure_importable() -> None:
    """Make ``import torchvision`` work (a no-op where it already does or is not installed)."""
    global _library
    if importlib.util.find_spec("torchvision") is None or _library is not None:
        return
    try:
        importlib.import_module("torchvision")
        return
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
    import torch

    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package
    _library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        _library.define(schema)
    importlib.import_module("torchvision")
