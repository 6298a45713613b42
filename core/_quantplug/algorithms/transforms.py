"""prepare, before annotation: the algorithms' ``transform_program`` hooks on the float working copy.

Each algorithm's transform (CLE, SmoothQuant) runs in the order given, on prepare's private copy of
the float program, seeing the calibration batches as the program's flat inputs. With the guard,
a transform whose quantized program does worse than without it is undone
(:func:`~_quantplug.algorithms.guard.quantized_error`, which quantizes with the prepare and
convert flow hands over: :class:`~_quantplug.algorithms.guard.FlowSteps`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Interpreter

from _quantplug.algorithms.guard import (
    FlowSteps,
    GuardLoss,
    change,
    guard_batches,
    lower,
    output_tensors,
    quantized_error,
)
from _quantplug.algorithms.sequential import HELD_OUT_EVERY
from _quantplug.algorithms.spec import TransformContext, algorithm_name
from _quantplug.errors import QuantplugError
from _quantplug.graph.attrs import fetch_attr, put_attr
from _quantplug.graph.calls import Call, check_flat_inputs

logger = logging.getLogger("quantplug.algorithms")


def run_transforms(
    gm: GraphModule,
    algorithms: Sequence[Any],
    calibration: Sequence[Any] | None,
    in_spec: Any = None,
    quantizer: Any = None,
    guard: FlowSteps | None = None,
    nonfinite: str = "error",
    held_out: Sequence[tuple[Any, ...]] | None = None,
    split: bool = True,
    guard_loss: GuardLoss | None = None,
) -> tuple[GraphModule, list[tuple[str, float, float]]]:
    """Every algorithm's ``transform_program``, in order, on the float working copy.

    ``calibration`` batches come as the user gives them to the prepared module (a tuple, a dict of
    keyword inputs, one tensor); the transforms see them as the program's flat inputs. With a
    ``guard`` (flow's prepare and convert, to quantize with; None: no guard) and calibration
    batches, a transform whose quantized model, calibrated on the first batches, does worse on
    the flat ``held_out`` batches (by default every :data:`HELD_OUT_EVERY`-th calibration batch,
    which the transforms then do not see, unless ``split`` is off; with fewer batches than that,
    the calibration batches)
    than without it is undone
    (:func:`_quantplug.algorithms.guard.quantized_error`); those come back as
    ``(algorithm, error with it, error without it)``.
    """
    misfit = ""  # the first calibration batch whose shape or dtype the program did not record
    if calibration is not None:
        flat = []
        for index, batch in enumerate(calibration):
            inputs = Call.of(batch).flat(in_spec, what=f"calibration batch {index}")
            if not misfit:  # not refused: a static batch size often runs at another size
                try:
                    check_flat_inputs(gm, inputs, what=f"calibration batch {index}")
                except QuantplugError as exc:
                    misfit = str(exc)
            flat.append(tuple(inputs))
        calibration = flat
    if (
        split
        and guard is not None
        and held_out is None
        and calibration
        and len(calibration) >= HELD_OUT_EVERY
    ):
        # the default split (HELD_OUT_EVERY): the transforms and the quantized candidates'
        # calibration see the other batches, the guard measures on these
        held_out = [b for i, b in enumerate(calibration, 1) if i % HELD_OUT_EVERY == 0]
        calibration = [b for i, b in enumerate(calibration, 1) if i % HELD_OUT_EVERY]
    judged = guard_batches(calibration) if guard is not None and calibration and quantizer is not None else []
    measured = list(held_out) if held_out is not None else judged
    reference: list[list[torch.Tensor]] = []
    if judged:
        with torch.no_grad(), _naming(misfit, "the algorithm guard"):
            reference = [output_tensors(Interpreter(gm).run(*batch)) for batch in measured]

    def quantized_error_of(program: GraphModule) -> float:  # called only with judged batches
        assert guard is not None
        with _naming(misfit, "the algorithm guard"):
            return quantized_error(
                guard, program, quantizer, judged, reference, nonfinite, measured, guard_loss
            )

    error: float | None = None  # the quantized error of the program as transformed so far
    left_out: list[tuple[str, float, float]] = []
    for algorithm in algorithms:
        hook = getattr(algorithm, "transform_program", None)
        if not callable(hook):
            continue
        name = algorithm_name(algorithm)
        before = _constants(gm) if judged else {}
        code = gm.code
        with _naming(misfit, f"algorithm {name!r}"):
            result = hook(gm, TransformContext(name, calibration, quantizer))
        if isinstance(result, GraphModule):
            gm = result
        gm.graph.lint()
        gm.recompile()
        now = _constants(gm) if judged else {}
        changed = {t: v for t, v in before.items() if now.get(t) is not v}  # target -> the old tensor
        if not changed or gm.code != code:
            continue  # nothing to judge, or a rewritten graph (kept as it is)
        if error is None:  # the program before this transform, quantized (later: the last kept one)
            for target, value in changed.items():
                put_attr(gm, target, value)
            error = quantized_error_of(gm)
            for target in changed:
                put_attr(gm, target, now[target])
        found = quantized_error_of(gm)
        if not lower(error, found):  # not worse beyond the tie margin: kept
            error = found
            continue
        for target, value in changed.items():  # undone: the program as it was before
            put_attr(gm, target, value)
        left_out.append((name, found, error))
        logger.info(
            "algorithm guard: %s undone: the quantized model did worse with it on the %s batches (%s)",
            name,
            "held-out" if held_out is not None else "calibration",
            change(found, error, guard_loss is not None),
        )
    return gm, left_out


@contextlib.contextmanager
def _naming(misfit: str, who: str) -> Iterator[None]:
    """Where running the program fails and a calibration batch does not fit it (``misfit``: what
    :func:`~_quantplug.graph.calls.check_flat_inputs` said), a QuantplugError naming that batch."""
    try:
        yield
    except QuantplugError:
        raise
    except Exception as exc:
        if not misfit:
            raise
        raise QuantplugError(
            f"{who} failed running the program on the calibration batches, and {misfit} "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _constants(gm: GraphModule) -> dict[str, Any]:
    """Every tensor the program reads through get_attr, by target (the objects, not copies)."""
    return {str(n.target): fetch_attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
