"""Fixtures of the distributed tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tests.distributed.launch import free_port


@pytest.fixture
def group() -> Iterator[None]:
    """A one-process gloo group for the test (sync_observers' own rules without starting processes)."""
    if dist.is_initialized():  # pragma: no cover - another test left one
        dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
