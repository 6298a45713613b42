"""The plugin contract: every hook a backend or extension can implement, in one place.

A backend is a module of ``@quantplug.hookimpl`` functions (or an object with such methods)
registered under the ``quantplug.backends`` entry-point group; the entry-point name is the
backend name. An extension registers under ``quantplug.extensions`` with the name of the backend it
extends (``"qnn_htp"``, or ``"*"`` for all) and implements any of the same hooks except
``quantplug_backend_info``.

Each backend gets its own plugin manager holding the backend and its extensions, so hooks never
see another backend's implementations. Hooks return data; the core decides what to do with it.
List-returning hooks are called on every implementation and concatenated, backend first, then
extensions in load order. ``firstresult`` hooks use the first non-None answer, extensions first,
so an extension can override a backend's choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from _quantplug.annotation.specs import QuantizationConfig
    from _quantplug.conformance.profile import ConformanceProfile
    from _quantplug.lowering.artifact import Artifact
    from _quantplug.plugins.contract import BackendInfo, NamedPass, RulesModule
    from _quantplug.quantizer.context import BackendContext
    from _quantplug.quantizer.fusion import FusionPattern
    from _quantplug.sharing.problem import SharingProblem
    from _quantplug.sharing.resolution import SharingGroups
    from _quantplug.validation.constraints import OpConstraint

PROJECT = "quantplug"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(firstresult=True)
def quantplug_backend_info() -> BackendInfo:
    """Describe the backend: name, one-line description, options and precision presets.

    Implemented by the backend module only. Called by ``get_quantizer`` (to validate options
    before anything else runs) and by ``quantplug backends --check``.
    """


@hookspec
def quantplug_annotation_rules(context: BackendContext) -> Sequence[RulesModule]:
    """List the modules holding annotation rules and the ops each covers.

    Args:
        context: the backend name and resolved options.

    Returns:
        ``RulesModule(module="pkg.conv_rules", ops=[torch.ops.aten.conv2d.default, ...])``
        entries. The core imports a module only if the graph being annotated contains one of its
        ops, then collects the functions decorated with ``register_annotator`` in it. When two
        modules cover one op, the later one (an extension's) wins.
    """


@hookspec(firstresult=True)
def quantplug_quantization_config(preset: str | None, context: BackendContext) -> QuantizationConfig | None:
    """Build the global ``QuantizationConfig`` for a preset and the options.

    Args:
        preset: the preset name chosen by the user (``None``: the backend's default).
        context: the backend name and resolved options.

    Returns:
        The config applied to every node that no override claims, or None to defer.
    """


@hookspec(firstresult=True)
def quantplug_target_arch(context: BackendContext) -> int | None:
    """The hardware architecture generation the options select (e.g. 73 for HTP V73).

    Args:
        context: the backend name and resolved options (an SoC name, say).

    Returns:
        An integer compared against ``ArchRequirement.min_arch`` by the validation engine, or
        None when the backend has no architecture gates.
    """


@hookspec
def quantplug_op_constraints(
    op: str, backend_op: str | None, context: BackendContext
) -> Sequence[OpConstraint]:
    """Give the quantization constraints of one op.

    Args:
        op: canonical ATen op name of the node (``"aten.conv2d.default"``).
        backend_op: the backend op the rule maps it to (``"Conv2d"``), if the rule names one.
        context: the backend name and resolved options (SoC, architecture...).

    Returns:
        Constraints to check; empty when the op is unconstrained. Several implementations'
        constraints all apply.
    """


@hookspec
def quantplug_fusion_patterns(context: BackendContext) -> Sequence[FusionPattern]:
    """Declare which producer/consumer pairs run as one kernel (conv + relu...).

    Args:
        context: the backend name and resolved options.

    Returns:
        ``FusionPattern(heads, tails, when_tail_float=...)`` entries. The core decides each
        matching pair from the configs selected for both nodes: fused (no encoding between
        them; rules see ``fused_tail``/``fused_head``), or, when the user keeps the tail float,
        the head quantized on its own (``"quantize_head"``) or the whole pair float
        (``"float"``). ``coverage()`` reports the decision. When several patterns match one
        head, the last declared (an extension's) wins.
    """


@hookspec(firstresult=True)
def quantplug_resolve_sharing(
    problem: SharingProblem,
    resolve: Callable[[SharingProblem], SharingGroups],
    context: BackendContext,
) -> SharingGroups | None:
    """Wrap the core observer-sharing resolution, e.g. to merge or split groups.

    Args:
        problem: the annotated keys, their spec facts and the graph they come from. A plugin may
            return ``resolve(problem.with_merges([...]))`` to request extra merges (concat
            unification), or post-process ``resolve(problem)``'s groups.
        resolve: the core resolution (pure union-find over keys).
        context: the backend name and resolved options.

    Returns:
        The groups to use, or None to let the core resolve ``problem`` unchanged.
    """


@hookspec
def quantplug_passes_before_annotation(context: BackendContext) -> Sequence[NamedPass]:
    """Graph transforms run before annotation (decompose an op, lift scalars, replace -inf...).

    Args:
        context: the backend name and resolved options.

    Returns:
        Passes in the order they must run; each receives the (already copied) GraphModule and
        the context and returns it, a replacement, or None.
    """


@hookspec
def quantplug_lowering_passes(context: BackendContext) -> Sequence[NamedPass]:
    """Passes that rewrite the quantized program before the artifact is written.

    Args:
        context: the backend name and resolved options.

    Returns:
        Passes in order; the backend's run first, then each extension's.
    """


@hookspec(firstresult=True)
def quantplug_artifact_writer(
    context: BackendContext,
) -> Callable[[torch.fx.GraphModule, BackendContext], Artifact] | None:
    """Give the function that turns the lowered program into an ``Artifact`` (files + metadata).

    Args:
        context: the backend name and resolved options.

    Returns:
        ``writer(program, context) -> Artifact``, or None to defer.
    """


@hookspec(firstresult=True)
def quantplug_conformance_profile(context: BackendContext) -> ConformanceProfile | None:
    """Declare what the conformance kit may expect (``quantplug conformance NAME``).

    Args:
        context: the backend name and resolved options.

    Returns:
        A ``ConformanceProfile``: capabilities the backend lacks (their checks are skipped with
        the reason given), SQNR floors, samples for ops the kit has none for, the files
        ``Artifact.save`` must write. None: the kit's defaults.
    """
