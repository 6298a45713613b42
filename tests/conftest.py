"""Session-wide test environment fixes (see each helper)."""

from __future__ import annotations

from tests.torchvision_compat import ensure_importable


def pytest_configure(config: object) -> None:
    ensure_importable()  # torchvision (and transformers, which imports it) next to CPU torch
