"""Bounded collectors that several algorithms share (see :class:`~quantplug.algorithms.spec.Collector`).

* :class:`InputSample` -- a fixed-size, seeded reservoir sample of a layer's inputs (rows of a
  linear layer's input, whole samples of a convolution's): what output-error searches (SeqMSE,
  AdaRound) re-run the layer on.
* :class:`Gram` -- the running ``X^T X`` of a linear layer's input rows (GPTQ's Hessian), one
  ``[in, in]`` matrix whatever the data size.
"""

from __future__ import annotations

import torch


class InputSample:
    """Up to ``max_rows`` rows (linear) or samples (conv: ``conv=True``), chosen uniformly at random.

    Reservoir sampling with a seeded generator: the sample depends only on the data and its order,
    never on the machine, and memory stays ``max_rows`` rows however many batches run.
    """

    def __init__(self, max_rows: int = 1024, *, conv: bool = False, seed: int = 0) -> None:
        self.max_rows = int(max_rows)
        self.conv = conv
        self.seen = 0
        self.rows: torch.Tensor | None = None
        self._generator = torch.Generator().manual_seed(seed)

    def update(self, x: torch.Tensor) -> None:
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
