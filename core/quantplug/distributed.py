"""Calibration over several processes: ``torch.distributed`` groups, merged observers.

    import torch.distributed as dist, quantplug
    from quantplug.distributed import shard, sync_observers

    dist.init_process_group("gloo")            # or "nccl"; torchrun sets the environment
    prepared = quantplug.prepare(program, quantizer)
    for batch in shard(batches):               # this rank's share of the data
        prepared(*batch)
    sync_observers(prepared)                   # every rank now holds the merged statistics
    quantized = quantplug.convert(prepared)    # the same program on every rank

Min/max statistics merge exactly (the same qparams as one process calibrating on every batch),
histograms on a range the ranks agree, moving averages by batch-weighted mean. QAT under
``DistributedDataParallel``: wrap the prepared module with :func:`ddp` (which keeps DDP from
overwriting the observers with rank 0's) and call ``sync_observers`` after each optimizer step,
or every few steps, and before convert. See ``docs/distributed.md``.
"""

from __future__ import annotations

from _quantplug import lazy as _lazy

_DECLARATION: dict[str, tuple[str, ...]] = {
    "_quantplug.distributed.ddp": ("ddp", "ignore_observer_buffers"),
    "_quantplug.distributed.fingerprint": ("fingerprint",),
    "_quantplug.distributed.shard": ("shard",),
    "_quantplug.distributed.sync": ("SyncResult", "sync_observers"),
}

__path__: list[str] = []  # the 0.1.0 submodules (quantplug.distributed.sync ...) resolve, deprecated
__all__ = _lazy.install(__name__, _DECLARATION)
