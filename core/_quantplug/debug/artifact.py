"""What the user ships, measured: a backend's artifact run on the same inputs as the float model
and the Q/DQ program.

The numeric debugger compares the Q/DQ program with float node by node; the artifact a backend
lowers it to (an ONNX model run by ONNX Runtime, a compiled binary...) is what a user deploys,
and it can differ from the program (a runtime kernel that saturates, a fusion that changes the
arithmetic). Any artifact with a ``run`` method is measured; the core knows nothing about the
runtime behind it.

The calling convention: ``artifact.run(*flat_inputs)`` with the program's inputs flattened in
placeholder order (tensors), returning one output or a tuple/list of outputs (torch tensors or
anything ``numpy.asarray`` accepts), in the order of the program's outputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from _quantplug.debug.decibels import format_db, json_float, sqnr

#: |artifact SQNR - program SQNR| past which the report flags the artifact
ARTIFACT_GAP_DB = 1.0
#: SQNRs past this are float rounding; the gap compares them at this cap
SQNR_CAP_DB = 100.0


@dataclass
class ArtifactComparison:
    """The artifact's outputs against the float model's and the Q/DQ program's.

    ``sqnr_db`` is the artifact against float (what ships), ``program_sqnr_db`` the program
    against float (what the per-node analysis describes), ``gap_db`` the program's minus the
    artifact's (positive: the artifact is worse), both capped at ``SQNR_CAP_DB``; ``flagged``
    when ``|gap_db| > ARTIFACT_GAP_DB``. ``ran`` is False when the artifact could not be run
    (``note`` says why): the report then shows the program alone.
    """

    ran: bool = False
    note: str = ""
    batches: int = 0
    sqnr_db: float | None = None
    program_sqnr_db: float | None = None
    vs_program_sqnr_db: float | None = None
    max_abs_error: float | None = None
    vs_program_max_abs_error: float | None = None
    threshold_db: float = ARTIFACT_GAP_DB
    _signal: float = field(default=0.0, repr=False)
    _noise: float = field(default=0.0, repr=False)
    _program_signal: float = field(default=0.0, repr=False)
    _program_noise: float = field(default=0.0, repr=False)

    @property
    def gap_db(self) -> float | None:
        if not self.ran or self.sqnr_db is None or self.program_sqnr_db is None:
            return None
        return min(self.program_sqnr_db, SQNR_CAP_DB) - min(self.sqnr_db, SQNR_CAP_DB)

    @property
    def flagged(self) -> bool:
        gap = self.gap_db
        return gap is not None and abs(gap) > self.threshold_db

    def describe(self) -> str:
        """One line: the artifact's SQNR beside the program's, and the flag."""
        if not self.ran:
            return f"not measured ({self.note})" if self.note else "not measured"
        gap = self.gap_db
        text = f"{format_db(self.sqnr_db)} (program {format_db(self.program_sqnr_db)})"
        if gap is not None and abs(gap) >= 0.05:
            text += f", {abs(gap):.1f} dB {'below' if gap > 0 else 'above'} the program"
        if self.flagged:
            text += f"  [GAP > {self.threshold_db:g} dB: the artifact does not compute what the program does]"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "ran": self.ran,
            "note": self.note,
            "batches": self.batches,
            "sqnr_db": json_float(self.sqnr_db),
            "identical": self.ran and self.sqnr_db == math.inf,
            "program_sqnr_db": json_float(self.program_sqnr_db),
            "vs_program_sqnr_db": json_float(self.vs_program_sqnr_db),
            "max_abs_error": json_float(self.max_abs_error),
            "vs_program_max_abs_error": json_float(self.vs_program_max_abs_error),
            "gap_db": json_float(self.gap_db),
            "threshold_db": self.threshold_db,
            "flagged": self.flagged,
        }


class ArtifactRunner:
    """Runs an artifact batch by batch beside the float model and the program, accumulating."""

    def __init__(self, artifact: Any) -> None:
        self.artifact = artifact
        self.result = ArtifactComparison()
        run = getattr(artifact, "run", None)
        self._run: Callable[..., Any] | None = run if callable(run) else None
        if self._run is None:
            kind = type(artifact).__name__
            self.result.note = f"the {kind} has no run() method (the backend cannot run it here)"
        self._failed = False

    @property
    def active(self) -> bool:
        return self._run is not None and not self._failed

    def add(self, flat_inputs: Sequence[Any], float_out: Any, program_out: Any, index: int) -> None:
        """Run batch ``index`` (the program's flat inputs) and accumulate its outputs."""
        if self._run is None or self._failed:
            return
        try:
            produced = self._run(*flat_inputs)
            leaves = _leaves(produced)
        except Exception as exc:  # any runtime's error: reported, not raised
            self._failed = True
            self.result.ran = False
            reason = f"{type(exc).__name__}: {_first_line(exc)}"
            self.result.note = f"artifact.run() failed on batch {index}: {reason}"
            return
        f_leaves = [t for t in pytree.tree_leaves(float_out) if isinstance(t, torch.Tensor)]
        q_leaves = [t for t in pytree.tree_leaves(program_out) if isinstance(t, torch.Tensor)]
        if len(leaves) != len(f_leaves) or any(a.shape != f.shape for a, f in zip(leaves, f_leaves)):
            self._failed = True
            self.result.ran = False
            self.result.note = (
                f"artifact.run() gave {len(leaves)} output(s) of shapes {[list(a.shape) for a in leaves]}, "
                f"the program {len(f_leaves)} of shapes {[list(f.shape) for f in f_leaves]}"
            )
            return
        r = self.result
        r.ran = True
        r.batches += 1
        for art, ref, prog in zip(leaves, f_leaves, q_leaves):
            ref64, art64, prog64 = ref.detach().double(), art.double(), prog.detach().double()
            r._signal += float(ref64.pow(2).sum())
            r._noise += float((art64 - ref64).pow(2).sum())
            r._program_signal += float(prog64.pow(2).sum())
            r._program_noise += float((art64 - prog64).pow(2).sum())
            if art.numel():
                r.max_abs_error = _max(r.max_abs_error, float((art64 - ref64).abs().max()))
                to_program = float((art64 - prog64).abs().max())
                r.vs_program_max_abs_error = _max(r.vs_program_max_abs_error, to_program)

    def finish(self, program_sqnr_db: float | None) -> ArtifactComparison:
        r = self.result
        if r.ran:
            r.sqnr_db = sqnr(r._signal, r._noise)
            r.vs_program_sqnr_db = sqnr(r._program_signal, r._program_noise)
            r.program_sqnr_db = program_sqnr_db
        return r


def _leaves(produced: Any) -> list[torch.Tensor]:
    """An artifact's outputs as float64 tensors (torch tensors or array-likes)."""
    import numpy as np

    items = list(produced) if isinstance(produced, (tuple, list)) else [produced]
    out = []
    for item in items:
        tensor = item if isinstance(item, torch.Tensor) else torch.from_numpy(np.asarray(item))
        out.append(tensor.detach().cpu())
    return out


def _max(current: float | None, value: float) -> float:
    return value if current is None else max(current, value)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
