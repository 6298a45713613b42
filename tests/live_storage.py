"""Memory counted tensor by tensor: the bytes of the storages alive and their high-water mark.

The memory tests (tests/algorithms/test_gptq_memory.py, tests/core/test_convert_memory.py) count
what a computation holds through a torch dispatch mode, never by reading the machine's RSS: a
storage is counted from the first tensor counted on it until the last of those is collected.
Which tensors to count is each subclass's own rule (its ``__torch_dispatch__``).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveStorage(TorchDispatchMode):
    """Bookkeeping of the storages counted: ``live`` bytes now, ``peak`` their high-water mark."""

    def __init__(self) -> None:
        super().__init__()
        self.views: dict[int, list[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.live = 0
        self.peak = 0

    def count(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage until ``tensor`` (and every other tensor counted on it) is gone."""
        storage = tensor.untyped_storage()
        entry = self.views.get(storage.data_ptr())
        if entry is None:
            entry = self.views[storage.data_ptr()] = [storage.nbytes(), 0]
            self.live += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        weakref.finalize(tensor, self._gone, storage.data_ptr())

    def _gone(self, address: int) -> None:
        entry = self.views[address]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.views[address]
