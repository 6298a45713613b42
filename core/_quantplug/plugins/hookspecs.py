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

The hooks are grouped below by the phase that calls them, in the order it does; each says who may
implement it. Plugins import ``hookimpl`` from ``quantplug.backend`` (or ``quantplug``).
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


# -- describing the backend (get_quantizer) ----------------------------------------------------


@hookspec(firstresult=True)
def quantplug_backend_info() -> BackendInfo:
    """Describe the backend: name, one-line description, options and precision presets.

    Implemented by the backend module only (an extension's is an error).

    Implemented by the backend module only. Called by ``get_quantizer`` (to validate options
    before anything else runs) and by ``quantplug backends --check``.
    """


# -- transforming the program before annotation (prepare, coverage) ----------------------------


@hookspec
def quantplug_passes_before_annotation(context: BackendContext) -> Sequence[NamedPass]:
    """Graph transforms run before annotation (decompose an op, lift scalars, replace -inf...).

    Implemented by the backend and its extensions (the backend's passes run first).

    Args:
        context: the backend name and resolved options.

    Returns:
        Passes in the order they must run; each receives the (already copied) GraphModule and
        the context and returns it, a replacement, or None.
    """


# -- annotating (prepare, coverage) ------------------------------------------------------------


@hookspec
def quantplug_annotation_rules(context: BackendContext) -> Sequence[RulesModule]:
    """List the modules holding annotation rules and the ops each covers.

    Implemented by the backend and its extensions (an extension's module wins an op both cover).

    Args:
        context: the backend name and resolved options.

    Returns:
        ``RulesModule(module="pkg.conv_rules", ops=["aten.conv2d.default", ...])`` entries;
        ``rules_from_index("pkg.rules")`` reads them from the package's generated index, so that
        the ops are written once, in the modules' ``register_annotator`` decorators. The core
        imports a module only if the graph being annotated contains one of its ops, then collects
        the functions decorated with ``register_annotator`` in it. When two modules cover one op,
        the later one (an extension's) wins.
    """


@hookspec(firstresult=True)
def quantplug_quantization_config(preset: str | None, context: BackendContext) -> QuantizationConfig | None:
    """Build the global ``QuantizationConfig`` for a preset and the options.

    Implemented by the backend, or an extension overriding it (an extension's answer wins).

    Args:
        preset: the preset name chosen by the user (``None``: the backend's default).
        context: the backend name and resolved options.

    Returns:
        The config applied to every node that no override claims, or None to defer.
    """


@hookspec
def quantplug_fusion_patterns(context: BackendContext) -> Sequence[FusionPattern]:
    """Declare which producer/consumer pairs run as one kernel (conv + relu...).

    Implemented by the backend and its extensions (the last declared pattern wins a head).

    Args:
        context: the backend name and resolved options.

    Returns:
        ``FusionPattern(heads, tails, when_tail_float=..., when=...)`` entries (``when``: a
        condition on the pair's nodes and the context, e.g. hardtanh fuses only as a relu). The
        core decides each matching pair from the configs selected for both nodes: fused (no
        encoding between
        them; rules see ``fused_tail``/``fused_head``), or, when the user keeps the tail float,
        the head quantized on its own (``"quantize_head"``) or the whole pair float
        (``"float"``). ``coverage()`` reports the decision. When several patterns match one
        head, the last declared (an extension's) wins.
    """


@hookspec
def quantplug_annotation_passes(context: BackendContext) -> Sequence[NamedPass]:
    """Whole-graph annotation stages, run once the rules annotated every node they claim.

    Implemented by the backend and its extensions (the backend's passes run first).

    A rule sees one node; some decisions need the graph's other annotations first: a
    data-movement op (a reshape, a transpose, a slice) takes the encoding of the consumers the
    rules already annotated, or stays float where they do. Such a stage runs here, after the
    fused pairs are decided and every rule ran, before the user's annotation callbacks and the
    input/output specs (``quantplug_io_config``, ``Quantizer.set_io``).

    Args:
        context: the backend name and resolved options; ``context.config_for(node)`` gives the
            config the user's overrides select for any node.

    Returns:
        Passes in order; each receives the annotated GraphModule and the context and edits the
        annotations in place (its return value is ignored). Afterwards the core removes any
        annotation a pass put on a node the user keeps float (``discard``, a config of None) or
        that must stay float for correctness (index arithmetic, tensors written in place), and
        ``coverage()`` reports the result like the rules'.
    """


@hookspec(firstresult=True)
def quantplug_io_config(context: BackendContext) -> QuantizationConfig | None:
    """Specs for the program's own inputs and outputs, when the backend quantizes its I/O.

    Implemented by the backend, or an extension overriding it (an extension's answer wins).

    A chip that takes quantized tensors in and gives them out (its runtime passes integers
    across its boundary) wants each float input of the program observed where it enters and each
    float output where it leaves: ``input_activation`` is the spec of every float input of the
    program, ``output_activation`` of every float output. The user's ``quantizer.set_io(config)``
    overrides it (``set_io(None)``: inputs and outputs as the rules leave them).

    Args:
        context: the backend name and resolved options.

    Returns:
        The config, or None: the rules alone decide (the default).
    """


# -- validating (prepare; again at convert, on the calibrated encodings) -----------------------


@hookspec(firstresult=True)
def quantplug_target_arch(context: BackendContext) -> int | None:
    """The hardware architecture generation the options select (e.g. 73 for HTP V73).

    Implemented by the backend, or an extension overriding it (an extension's answer wins).

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

    Implemented by the backend and its extensions (every implementation's constraints apply).

    Args:
        op: canonical ATen op name of the node (``"aten.conv2d.default"``).
        backend_op: the backend op the rule maps it to (``"Conv2d"``), if the rule names one.
        context: the backend name and resolved options (SoC, architecture...).

    Returns:
        Constraints to check; empty when the op is unconstrained. Several implementations'
        constraints all apply.
    """


# -- observer sharing (prepare) ----------------------------------------------------------------


@hookspec(firstresult=True)
def quantplug_resolve_sharing(
    problem: SharingProblem,
    resolve: Callable[[SharingProblem], SharingGroups],
    context: BackendContext,
) -> SharingGroups | None:
    """Wrap the core observer-sharing resolution, e.g. to merge or split groups.

    Implemented by the backend, or an extension overriding it (an extension's answer wins).

    Args:
        problem: the annotated keys, their spec facts and the graph they come from. A plugin may
            return ``resolve(problem.with_merges([...]))`` to request extra merges (concat
            unification), or post-process ``resolve(problem)``'s groups.
        resolve: the core resolution (pure union-find over keys).
        context: the backend name and resolved options.

    Returns:
        The groups to use, or None to let the core resolve ``problem`` unchanged.
    """


# -- lowering (lower) --------------------------------------------------------------------------


@hookspec
def quantplug_lowering_passes(context: BackendContext) -> Sequence[NamedPass]:
    """Passes that rewrite the quantized program before the artifact is written.

    Implemented by the backend and its extensions (the backend's passes run first).

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

    Implemented by the backend, or an extension overriding it (an extension's answer wins).

    Args:
        context: the backend name and resolved options.

    Returns:
        ``writer(program, context) -> Artifact``, or None to defer.
    """


# -- the conformance kit (quantplug conformance) -----------------------------------------------


@hookspec(firstresult=True)
def quantplug_conformance_profile(context: BackendContext) -> ConformanceProfile | None:
    """Declare what the conformance kit may expect (``quantplug conformance NAME``).

    Implemented by the backend, or an extension overriding it (an extension's answer wins).

    Args:
        context: the backend name and resolved options.

    Returns:
        A ``ConformanceProfile``: capabilities the backend lacks (their checks are skipped with
        the reason given), SQNR floors, samples for ops the kit has none for, the files
        ``Artifact.save`` must write. None: the kit's defaults.
    """
