"""``quantplug quantize --nproc N``: calibrate on N processes, one writer.

The command re-runs itself on N local processes through torch's elastic launcher (what
``torchrun --standalone --nproc-per-node N`` does). Each process is one rank of a gloo group: it
loads the model, prepares it, calibrates on its share of the data (every N-th batch,
:class:`~_quantplug.cli.inputs.CalibrationData`), and ``sync_observers`` merges the statistics.
Rank 0 then converts, lowers, compares and writes ``--out`` (atomically, as a one-process run);
the other ranks write nothing.

On several machines, start the same command under ``torchrun`` on each (no ``--nproc``)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 -m quantplug quantize model.pt2 -c data/ --out out/

A process started by torch's launcher (``WORLD_SIZE`` > 1, ``RANK`` and the launcher's
``TORCHELASTIC_RUN_ID`` in its environment) joins the group instead of launching; ``--out`` is
written on the machine of rank 0. ``WORLD_SIZE`` and ``RANK`` without the launcher's mark are
left over in a shell: refused at once, naming them, rather than waiting for a group that will
never form. Every rank reads the model and the calibration data from its own filesystem (a shared
one, or identical copies).

The launcher ends as a one-process run does: a signal it receives (SIGINT, SIGTERM) is passed to
the ranks, which clean up, and it exits 130 / 128 + N; a rank that fails stops the others, and the
launcher's last line names the rank and how it ended (its exit code, or the signal that killed it:
SIGKILL is what the out-of-memory killer sends).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from _quantplug.cli.console import Console
from _quantplug.cli.errors import InputError, Terminated

#: how long ranks wait for each other at the observer sync (seconds)
SYNC_TIMEOUT = float(os.environ.get("QUANTPLUG_SYNC_TIMEOUT", "600"))
_COUNTER_KEY = "quantplug/calibrated-batches"
#: whether this process made the launcher's group and has left it (see :func:`left_launched_group`)
_left = False


#: what torch's launcher (torchrun, --nproc) sets in every rank's environment
LAUNCHER_MARK = "TORCHELASTIC_RUN_ID"


def launched_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` when torch's launcher started this process as part of a group, else
    None.

    Raises:
        InputError: ``WORLD_SIZE``/``RANK`` describe a group but no launcher started this process
            (they were left in the shell), or they are not numbers.
    """
    size_text, rank_text = os.environ.get("WORLD_SIZE", "1") or "1", os.environ.get("RANK")
    try:
        size = int(size_text)
        rank = int(rank_text) if rank_text is not None else None
    except ValueError:
        raise InputError(
            f"WORLD_SIZE={size_text!r} and RANK={rank_text!r} in the environment are not numbers: unset them "
            "for a one-process run (--nproc N calibrates on N processes)"
        ) from None
    if size <= 1 or rank is None:
        return None
    if LAUNCHER_MARK not in os.environ:
        raise InputError(
            f"WORLD_SIZE={size} and RANK={rank} are set, but no torch launcher started this process "
            f"({LAUNCHER_MARK} is not set): unset WORLD_SIZE and RANK for a one-process run, pass --nproc N, "
            "or start the command under torchrun"
        )
    return rank, size


def launch(argv: list[str], nproc: int, console: Console) -> int:
    """Run ``quantplug <argv>`` on ``nproc`` local processes; the exit code of the run.

    A rank that fails makes the launcher stop the others; the exit code is the failed rank's
    (2 for bad input, as a one-process run would return; 128 + N for a rank killed by signal N),
    and the last line names that rank. A signal to the launcher is passed to the ranks and ends
    the launcher as it ends a one-process run (:class:`Terminated`, ``KeyboardInterrupt``).

    The launcher's per-rank log folders go to a temporary folder removed when the run ends: left
    to itself it makes ``torchelastic_*`` in the system's temporary folder on every run and never
    removes it. Nothing is lost: ranks print to the terminal, and a failed rank's error reaches
    the caller through its exit code and its own message.
    """
    import logging

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not console.verbose:  # what went wrong is said below, in quantplug's words
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    console.info(f"calibrating on {nproc} processes (torch.distributed, gloo)")
    with tempfile.TemporaryDirectory(prefix="quantplug-nproc-") as logs:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=str(uuid.uuid4()),
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            monitor_interval=0.1,
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        try:
            elastic_launch(config, sys.executable)("-m", "quantplug", *argv)
        except SignalException as exc:  # the launcher's own signal: torch's agent passed it on
            # as the signal it was (SIGINT included): a bare KeyboardInterrupt here would read as
            # one raised by code quantplug ran, since quantplug's own handler never saw the signal
            raise Terminated(int(exc.sigval)) from None
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()  # the cause; the others were stopped after it
            console.error(_rank_failure(rank, failure.pid, failure.exitcode))
            return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode or 1
    return 0


def _rank_failure(rank: int, pid: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (the out-of-memory killer sends it)" if code == -signal.SIGKILL else ""
        how = f"was killed by {name} (signal {-code}){why}"
    else:
        how = f"failed with exit code {code} (its error is above)"
    return f"rank {rank} (pid {pid}) {how}; the other ranks were stopped and --out is untouched"


@dataclass
class Group:
    """This process's place in the calibration group."""

    rank: int
    world_size: int

    @property
    def writer(self) -> bool:
        return self.rank == 0


@contextmanager
def joined_group() -> Iterator[Group | None]:
    """This process's place in the launcher's process group (gloo: calibration runs on the CPU), for
    the length of the run; None when not launched.

    The group is destroyed when the run ends, on success or failure: a gloo group left for the
    interpreter's exit tears its worker threads down during finalisation, and the process aborts
    ("terminate called without an active exception") after the run had succeeded. A group the
    caller had initialised before is theirs and left alone.
    """
    if launched_world() is None:
        yield None
        return
    import datetime

    import torch.distributed as dist

    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=SYNC_TIMEOUT))
    try:
        yield Group(dist.get_rank(), dist.get_world_size())
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()
            global _left
            _left = True


def left_launched_group() -> bool:
    """Whether this process joined a launcher's group through :func:`joined_group` and left it:
    a rank process, which ``_quantplug.cli.main`` ends without the interpreter's finalisation."""
    return _left


class SharedCount:
    """Batches calibrated over all ranks, for rank 0's progress bar: each rank adds what it did to
    a counter in the group's key-value store every ``every`` seconds (one small request); rank 0
    reads the sum back. Without a store, each rank counts its own."""

    def __init__(self, every: float = 0.5) -> None:
        self.every = every
        self.pending = 0
        self.last = 0.0
        self.store: Any = None
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                self.store = dist.distributed_c10d._get_default_store()
        except Exception:  # a private accessor: progress falls back to local counts
            self.store = None

    def add(self, n: int = 1, *, force: bool = False) -> int | None:
        """Record ``n`` batches; the total over all ranks when it was just read, else None."""
        self.pending += n
        now = time.monotonic()
        if self.store is None or not (force or now - self.last >= self.every):
            return None
        self.last = now
        total = int(self.store.add(_COUNTER_KEY, self.pending))
        self.pending = 0
        return total
