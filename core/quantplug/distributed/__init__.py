"""Calibration over several processes: ``torch.distributed`` groups, merged observers.

    import torch.distributed as dist, quantplug
    from quantplug.distributed import shard, sync_observers

    dist.init_process_group("gloo")            # or "nccl"; torchrun sets the environment
    prepared = quantplug.prepare(program, quantizer)
    for batch in shard(batches):               # this rank's share of the data
        prepared(*batch)
    sync_observers(prepared)                   # every rank now holds the merged statistics
    quantized = quantplug.convert(prepared)    # the same program on every rank

The merge rules are those of :mod:`quantplug.observers.merge`: min/max statistics merge exactly
(the same qparams as one process calibrating on every batch), histograms on a range the ranks
agree, moving averages by batch-weighted mean. QAT under ``DistributedDataParallel``: wrap the
prepared module with :func:`ddp` (which keeps DDP from overwriting the observers with rank 0's)
and call ``sync_observers`` after each optimizer step, or every few steps, and before convert.
"""

from __future__ import annotations

from quantplug.distributed.ddp import ddp, ignore_observer_buffers
from quantplug.distributed.fingerprint import fingerprint
from quantplug.distributed.shard import shard
from quantplug.distributed.sync import SyncResult, sync_observers

__all__ = ["SyncResult", "ddp", "fingerprint", "ignore_observer_buffers", "shard", "sync_observers"]
