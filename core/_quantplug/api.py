"""The top-level calls: pick a backend by name, and the one-call ``quantize``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from _quantplug.algorithms.config import Algorithms, configured
from _quantplug.errors import QuantplugError
from _quantplug.flow.convert import convert
from _quantplug.flow.prepare import prepare
from _quantplug.graph.mutation import private_inputs, writes_an_input
from _quantplug.plugins.registry import load_backend
from _quantplug.quantizer.quantizer import Quantizer, make_quantizer


def get_quantizer(name: str, **options: Any) -> Quantizer:
    """A quantizer for backend ``name`` with its options (``strict`` is accepted by every backend).

    Imports that backend's plugin and the extensions targeting it, nothing else.

    Raises:
        UnknownBackendError: no such backend (the message lists the installed ones).
        BackendLoadError: the plugin failed to import.
        OptionError: an unknown option, a wrong type or a value outside its choices.
    """
    return make_quantizer(load_backend(name), dict(options))


def _as_args(batch: Any) -> tuple[Any, ...]:
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


def quantize(
    model: torch.nn.Module | torch.export.ExportedProgram,
    example_inputs: Sequence[Any] | None = None,
    *,
    backend: str,
    calibration: Iterable[Any] | None = None,
    nonfinite: str = "error",
    algorithms: Algorithms | Sequence[Any] | None = None,
    **options: Any,
) -> torch.fx.GraphModule:
    """Export (if needed), prepare, calibrate and convert in one call.

    Args:
        model: an ``nn.Module`` (exported in eval mode with ``example_inputs``; its own
            train/eval flags are left as they were) or an ``ExportedProgram``.
        example_inputs: a tuple of inputs, needed when ``model`` is a module.
        backend: the backend name.
        calibration: batches (a tensor or a tuple of tensors each); defaults to the example inputs.
        nonfinite: NaN/inf values in calibration data: ``"error"`` or ``"ignore"`` (see
            :func:`quantplug.prepare`).
        algorithms: accuracy algorithms, a list or ``quantplug.Algorithms`` (see
            :func:`quantplug.prepare`); those needing data before annotation get ``calibration``
            unless the ``Algorithms`` holds batches of its own.
        **options: backend options. ``algorithm_guard=`` and ``held_out=`` (before
            ``Algorithms(..., guard=, held_out=)``) work until 0.4.0 with a ``DeprecationWarning``.

    Returns:
        The converted (reference Q/DQ) GraphModule.
    """
    old: dict[str, Any] = {k: options.pop(k) for k in ("algorithm_guard", "held_out") if k in options}
    config = configured(algorithms, old, function="quantize")
    program = model if isinstance(model, torch.export.ExportedProgram) else _export(model, example_inputs)
    quantizer = get_quantizer(backend, **options)
    batches = list(calibration) if calibration is not None else [tuple(example_inputs or ())]
    if config.algorithms and config.calibration is None:  # the algorithms see the calibration data
        config = Algorithms(
            config.algorithms,
            calibration=[_as_args(b) for b in batches],
            guard=config.guard,
            held_out=config.held_out,
        )
    prepared = prepare(program, quantizer, nonfinite=nonfinite, algorithms=config)
    copies = writes_an_input(prepared.graph)  # the caller's batches stay as given
    with torch.no_grad():
        for batch in batches:
            prepared(*(private_inputs(_as_args(batch)) if copies else _as_args(batch)))
    # the prepared module is this call's own: convert drops its float weights as their integers are
    # written, so a model built for this call (no other reference to it) is freed weight by weight
    # during convert; a caller's model and program keep their weights (only our references go)
    del model, program
    return convert(prepared, release_float_weights=True)


def _export(model: torch.nn.Module, example_inputs: Sequence[Any] | None) -> torch.export.ExportedProgram:
    """``model`` exported in eval mode, its own train/eval flags left as they were."""
    if example_inputs is None:
        raise QuantplugError("quantize() needs example_inputs to export an nn.Module")
    flags = {m: m.training for m in model.modules()}
    try:
        return torch.export.export(model.eval(), tuple(example_inputs))
    finally:
        for module, training in flags.items():
            module.training = training
