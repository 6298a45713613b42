"""Quantization-aware training under ``DistributedDataParallel``.

DDP broadcasts every buffer from rank 0 before each forward (``broadcast_buffers=True``, its
default): for a prepared QAT program that overwrites every rank's observer statistics with rank
0's, so the other ranks' data never reaches the quantization ranges. :func:`ddp` wraps the
prepared module with the observers' buffers excluded from that broadcast (other buffers, such as
batch-norm statistics, keep DDP's behaviour); ``sync_observers`` then merges the observers of all
ranks, after each optimizer step or every few (the fake-quantize grids are the same on every
rank right after a sync) and always before ``convert``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from _quantplug.distributed.sync import prepared_of
from _quantplug.meta import observer_children


def observer_buffer_names(prepared: nn.Module) -> list[str]:
    """Fully qualified names of the observers' buffers in ``prepared``."""
    return [
        f"{name}.{buffer}"
        for name, observer in observer_children(prepared_of(prepared))
        for buffer, _ in observer.named_buffers()
    ]


def ignore_observer_buffers(prepared: nn.Module) -> None:
    """Tell DistributedDataParallel (constructed afterwards) to leave the observers' buffers alone."""
    from torch.nn.parallel import DistributedDataParallel

    module = prepared_of(prepared)
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        module, sorted(ignored | set(observer_buffer_names(module)))
    )


def ddp(prepared: nn.Module, **ddp_options: Any) -> nn.Module:
    """``DistributedDataParallel(prepared, **ddp_options)`` that does not overwrite the observers."""
    from torch.nn.parallel import DistributedDataParallel

    ignore_observer_buffers(prepared)
    return DistributedDataParallel(prepared, **ddp_options)
