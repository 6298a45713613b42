"""Calibration data factories for ``quantplug quantize -c tests.distributed.data:NAME``."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, TensorDataset


def _images(count: int = 8) -> torch.Tensor:
    from _quantplug.demo.model import demo_calibration

    return torch.cat([b[0] for b in demo_calibration(count)])


def loader() -> DataLoader:  # type: ignore[type-arg]
    """A torch DataLoader yielding (images,) batches of one: the demo's 8 calibration batches."""
    return DataLoader(TensorDataset(_images()), batch_size=1)


def sharded(rank: int, world_size: int) -> Iterator[torch.Tensor]:
    """A factory that shards itself: it is given its rank and yields only its share."""
    images = _images()
    for i in range(rank, images.shape[0], world_size):
        yield images[i : i + 1]


def broken() -> Iterator[torch.Tensor]:
    yield _images(1)
    yield torch.randn(1, 3, 8, 8)  # item 1 does not fit the model


def norm_mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """A model factory: LayerNorm -> linear -> ReLU -> linear (SmoothQuant folds into the norm)."""
    from tests.distributed.worker import AlgoNet, algo_batches

    torch.manual_seed(0)
    return AlgoNet().eval(), (algo_batches(1)[0],)


def norm_mlp_marking_its_exit() -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """``norm_mlp``, and an exit handler (user code's cleanup) that writes ``rank-N`` into the
    folder ``QUANTPLUG_TEST_MARKS`` names when the process exits."""
    import atexit
    import os
    from pathlib import Path

    marks, rank = Path(os.environ["QUANTPLUG_TEST_MARKS"]), os.environ.get("RANK", "-")
    atexit.register(lambda: (marks / f"rank-{rank}").write_text("exit handlers ran"))
    return norm_mlp()


def augmented() -> Iterator[torch.Tensor]:
    """Items that differ on every call (an unseeded random augmentation), for ``norm_mlp``: a
    factory that does not shard itself yields other items on every rank."""
    import random

    from tests.distributed.worker import algo_batches

    for x in algo_batches(8):
        yield x * (1.0 + random.random())


def fitting_on_rank_0_only() -> Iterator[torch.Tensor]:
    """``augmented``'s items on rank 0; on any other rank, items of the wrong width: a rank that
    reads this itself instead of receiving rank 0's batches fails the shape check."""
    import os

    from tests.distributed.worker import algo_batches

    for x in algo_batches(4):
        yield x if os.environ.get("RANK", "0") == "0" else x[..., :-1]


def slow(rank: int, world_size: int) -> Iterator[torch.Tensor]:
    """The demo's images, one every 0.2 s for ever, after writing this rank's pid into
    ``QUANTPLUG_TEST_PIDS/rank<N>``: a run to stop while every rank calibrates."""
    import os
    import time
    from pathlib import Path

    Path(os.environ["QUANTPLUG_TEST_PIDS"], f"rank{rank}").write_text(str(os.getpid()))
    images = _images(1)
    while True:
        time.sleep(0.2)
        yield images
