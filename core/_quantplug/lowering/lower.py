"""lower(): run a backend's lowering passes, then its artifact writer."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

import torch
from torch.fx import GraphModule

from _quantplug.errors import LoweringError, QuantplugError
from _quantplug.graph.working_copy import working_copy
from _quantplug.lowering.artifact import Artifact
from _quantplug.meta import BACKEND_KEY, QPARAMS_KEY, STATE_KEY


def lower(quantized: GraphModule, quantizer: Any) -> Artifact:
    """Turn a converted program into the backend's files.

    Args:
        quantized: the output of :func:`quantplug.convert`.
        quantizer: the quantplug ``Quantizer`` it was prepared with (its backend lowers it).

    Raises:
        LoweringError: the backend has no artifact writer, or a pass/writer failed (the message
            names the pass).
    """
    _check_lowerable(quantized, quantizer)
    with _own_garbage_only():
        return _run_plan(quantized, quantizer)


def _run_plan(quantized: GraphModule, quantizer: Any) -> Artifact:
    plan_fn = getattr(quantizer, "lowering_plan", None)
    if not callable(plan_fn):
        raise LoweringError(
            f"{type(quantizer).__name__} has no lowering plan; lower() needs a quantplug Quantizer "
            "(quantplug.get_quantizer(name, ...))"
        )
    plan = plan_fn()
    if plan.writer is None:
        raise LoweringError(f"backend {quantizer.backend!r} provides no artifact writer")
    # passes may edit in place; the user's copy stays. Its code is generated only if a pass runs it.
    program: GraphModule = working_copy(quantized, lazy=True)
    for p in plan.passes:
        try:
            out = p.fn(program, quantizer.context)
        except QuantplugError:
            raise
        except Exception as exc:
            raise LoweringError(
                f"lowering pass {p.name!r} of backend {quantizer.backend!r} failed: {exc}"
            ) from exc
        if isinstance(out, torch.nn.Module):
            program = out  # type: ignore[assignment]
    try:
        artifact = plan.writer(program, quantizer.context)
    except QuantplugError:
        raise
    except Exception as exc:
        raise LoweringError(f"artifact writer of backend {quantizer.backend!r} failed: {exc}") from exc
    if not isinstance(artifact, Artifact):
        raise LoweringError(
            f"artifact writer of backend {quantizer.backend!r} returned {type(artifact).__name__}"
        )
    return artifact


@contextlib.contextmanager
def _own_garbage_only() -> Iterator[None]:
    """Hold Python's cyclic garbage collector while lowering, then collect what lowering left.

    Lowering builds and drops graph copies and an ONNX graph, a few hundred objects per node
    (cycles: FX nodes link to each other, ONNX values to their nodes). Each time that many
    objects outlive a young collection, CPython runs a full collection, which walks every
    object of the process (the user's model, programs, fake tensors): on the 1,026-node MLP
    bench, one full collection took 0.4 s of a 0.9 s lowering. Held, lowering pays only for its
    own objects: one young-generation collection at the end (0.1 s there), whose cost grows
    with the graph, not with the process. A collector already disabled by the caller stays so.
    The switch is process-wide: other threads' cycles wait for the end of the lowering.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect(0)


_QDQ_NAMESPACES = ("quantized_decomposed", "quantplug")


def _check_lowerable(quantized: Any, quantizer: Any) -> None:
    """A converted program, lowered by the backend it was quantized for."""
    gm = quantized.graph_module if isinstance(quantized, torch.export.ExportedProgram) else quantized
    if not isinstance(gm, GraphModule):
        raise LoweringError(
            f"lower() expects the GraphModule from quantplug.convert(), got {type(quantized).__name__}"
        )
    if STATE_KEY in gm.meta:
        raise LoweringError(
            "lower() got a prepared module: calibrate it, then lower quantplug.convert(prepared)"
        )
    converted = QPARAMS_KEY in gm.meta  # quantplug.convert's output, even with nothing quantized
    if not converted and not any(
        n.op == "call_function" and getattr(n.target, "namespace", None) in _QDQ_NAMESPACES
        for n in gm.graph.nodes
    ):
        raise LoweringError(
            "lower() got a float program (no quantize/dequantize op in it): prepare, calibrate and convert "
            "it first (quantplug.convert(prepared))"
        )
    made_for = gm.meta.get(BACKEND_KEY)
    backend = getattr(quantizer, "backend", None)
    if made_for is not None and backend is not None and made_for != backend:
        raise LoweringError(
            f"this program was quantized for backend {made_for!r}; lower it with that quantizer "
            f"(lower() got a {backend!r} quantizer)"
        )
