"""Bounded collectors that several algorithms share (see :class:`~_quantplug.algorithms.spec.Collector`).

* :class:`InputSample` -- a fixed-size, seeded reservoir sample of a layer's inputs (rows of a
  linear layer's input, whole samples of a convolution's): what output-error searches (SeqMSE,
  AdaRound) re-run the layer on.
* :class:`Gram` -- the running ``X^T X`` of a linear layer's input rows (GPTQ's Hessian), one
  ``[in, in]`` matrix whatever the data size.

Both merge across processes (:class:`~_quantplug.algorithms.spec.MergeableCollector`): a Gram
matrix is a sum, merged as one in rank order (:func:`sum_in_order`); samples merge by
:func:`merge_samples`, a uniform sample of every rank's rows (not the sample one process draws).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch


def sum_in_order(terms: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """``terms[0] + terms[1] + ...`` left to right, Nones skipped (None when all are).

    The merge of sums across ranks: added in rank order on every rank, so every rank gets the same
    bits whatever the backend's reduction order. One process adds batch by batch instead; the
    two agree up to the rounding of the additions' order (float64: ~1e-16 relative).
    """
    total: torch.Tensor | None = None
    for term in terms:
        if term is None:
            continue
        total = term.clone() if total is None else total + term.to(total.device)
    return total


def like(value: torch.Tensor | None, reference: torch.Tensor | None) -> torch.Tensor | None:
    """``value`` on ``reference``'s device (merged states arrive on the CPU; a collector fed on a
    GPU keeps its statistics there)."""
    if value is None or reference is None:
        return value
    return value.to(reference.device)


def mixed_seed(seed: int, salt: str) -> int:
    """A seed derived from ``seed`` and ``salt`` (a 63-bit integer; the same on every machine)."""
    data = hashlib.sha256(f"{int(seed)}/{salt}".encode()).digest()
    return int.from_bytes(data[:8], "little") >> 1


def rank_seed(seed: int) -> int:
    """The seed this process draws with: ``seed`` on one process (and on rank 0), mixed with the
    rank in the other processes of a ``torch.distributed`` group.

    A sampler seeded alike on every rank draws the same slots on every rank; merged, such samples
    are not a uniform sample of the union (rows at the same slot of two ranks come together). Per
    rank seeds make the ranks' draws independent, which :func:`merge_samples` relies on.
    """
    rank = 0
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    return int(seed) if rank == 0 else mixed_seed(seed, f"rank {rank}")


def merge_samples(
    samples: Sequence[tuple[torch.Tensor | None, int]], max_rows: int, generator: torch.Generator
) -> tuple[torch.Tensor | None, int]:
    """One uniform sample of at most ``max_rows`` rows from the union of several rows streams,
    given a uniform sample of each: ``(rows, seen)`` per stream, in rank order.

    Each ``rows`` must be a uniform sample without replacement of its stream's ``seen`` rows,
    ``min(max_rows, seen)`` of them, drawn independently of the others (:func:`rank_seed`). The
    merge draws how many rows each stream gives as one sample of ``k = min(max_rows, total)``
    draws from the union would (multivariate hypergeometric: each draw picks a stream with
    probability its rows not yet drawn over all rows not yet drawn), then that many rows of the
    stream's sample, uniformly. A uniform subset of a uniform subset is a uniform subset, so every
    ``k``-subset of the union is equally likely: a valid uniform sample of all the rows, as the
    one-process reservoir is, but not the same sample (different draws). When the union fits in
    ``max_rows`` every row is kept (the same rows as one process, in rank order).

    Streams whose rows have another shape than the first stream's with rows are left out (a
    sample stays homogeneous, as :class:`InputSample` keeps it in one process), with their counts.
    Returns the merged rows (streams in rank order, each stream's rows in slot order) and the
    rows seen by the streams kept. Deterministic: a function of the inputs and ``generator``.
    """
    shape: torch.Size | None = next((rows.shape[1:] for rows, _ in samples if rows is not None), None)
    kept = [(rows, int(seen)) for rows, seen in samples if rows is not None and rows.shape[1:] == shape]
    total = sum(seen for _, seen in kept)
    if not kept or total == 0:
        return None, 0
    for rows, seen in kept:
        if rows.shape[0] != min(int(max_rows), seen):
            raise ValueError(
                f"a sample of {rows.shape[0]} rows from {seen} seen with max_rows={max_rows}: not a "
                "reservoir of this size (merged samples come from collectors of one configuration)"
            )
    k = min(int(max_rows), total)
    remaining = [seen for _, seen in kept]
    counts = [0] * len(kept)
    left = total
    for u in torch.rand(k, generator=generator, dtype=torch.float64).tolist():
        target = min(int(u * left), left - 1)  # the target-th row not yet drawn, over all streams
        stream = 0
        while target >= remaining[stream]:
            target -= remaining[stream]
            stream += 1
        counts[stream] += 1
        remaining[stream] -= 1
        left -= 1
    parts = []
    for (rows, _), count in zip(kept, counts):
        if count:
            chosen = torch.randperm(rows.shape[0], generator=generator)[:count].sort().values
            parts.append(rows[chosen])
    return torch.cat(parts), total


class InputSample:
    """Up to ``max_rows`` rows (linear) or samples (conv: ``conv=True``), chosen uniformly at random.

    Reservoir sampling with a seeded generator: the sample depends only on the data and its order,
    never on the machine, and memory stays ``max_rows`` rows however many batches run. On several
    processes each rank draws with its own seed (:func:`rank_seed`) and the samples merge into a
    uniform sample of every rank's rows (:func:`merge_samples`).
    """

    def __init__(self, max_rows: int = 1024, *, conv: bool = False, seed: int = 0) -> None:
        self.max_rows = int(max_rows)
        self.conv = conv
        self.seed = seed
        self.seen = 0
        self.rows: torch.Tensor | None = None
        self._generator: torch.Generator | None = None  # seeded at the first update (per rank)

    def update(self, x: torch.Tensor) -> None:
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(rank_seed(self.seed))
        x = x.detach()
        rows = (x if x.dim() > 1 else x.unsqueeze(0)) if self.conv else x.reshape(-1, x.shape[-1])
        if self.rows is not None and rows.shape[1:] != self.rows.shape[1:]:
            return  # another spatial size: keep the sample homogeneous
        room = self.max_rows - (0 if self.rows is None else self.rows.shape[0])
        if room > 0:
            take = rows[:room].to(torch.float32).clone()
            self.rows = take if self.rows is None else torch.cat([self.rows, take])
            self.seen += take.shape[0]
            rows = rows[room:]
        if rows.shape[0] == 0:
            return
        assert self.rows is not None
        # reservoir: row number i (0-based, counting all seen) replaces a random slot with prob max/(i+1)
        index = torch.arange(self.seen, self.seen + rows.shape[0], dtype=torch.float64)
        draws = torch.rand(rows.shape[0], generator=self._generator, dtype=torch.float64)
        slots = (draws * (index + 1)).floor().to(torch.int64)
        keep = slots < self.max_rows
        for row, slot in zip(rows[keep], slots[keep].tolist()):
            self.rows[slot] = row.to(torch.float32)
        self.seen += rows.shape[0]

    def result(self) -> torch.Tensor | None:
        return self.rows

    def state(self) -> dict[str, Any]:
        return {"rows": self.rows, "seen": self.seen}

    def merge_(self, states: Sequence[dict[str, Any]]) -> None:
        generator = torch.Generator().manual_seed(mixed_seed(self.seed, "merge"))
        rows, self.seen = merge_samples([(s["rows"], s["seen"]) for s in states], self.max_rows, generator)
        self.rows = like(rows, self.rows)
        self._generator = generator  # every rank goes on drawing alike


class Gram:
    """``sum x x^T`` over every input row of a linear layer and the number of rows (float64)."""

    def __init__(self) -> None:
        self.matrix: torch.Tensor | None = None
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        product = rows.t() @ rows
        self.matrix = product if self.matrix is None else self.matrix + product
        self.count += rows.shape[0]

    def result(self) -> tuple[torch.Tensor, int] | None:
        return None if self.matrix is None else (self.matrix, self.count)

    def state(self) -> dict[str, Any]:
        return {"matrix": self.matrix, "count": self.count}

    def merge_(self, states: Sequence[dict[str, Any]]) -> None:
        self.matrix = like(sum_in_order([s["matrix"] for s in states]), self.matrix)
        self.count = sum(int(s["count"]) for s in states)
