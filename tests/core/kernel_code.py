"""Choosing which code of the native kernels runs in a test: their AVX2 code (where the CPU has
AVX2) or their SSE2/scalar code, which must give the same results."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def simd(avx2: bool) -> Iterator[None]:
    """Run the block with the kernels' AVX2 code (``avx2``) or their scalar code, then restore."""
    from _quantplug.observers import _histogram_kernels as raw

    was = raw._use_avx2(avx2)
    try:
        yield
    finally:
        raw._use_avx2(was)
