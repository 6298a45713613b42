"""Translating an ``ExportedProgram`` to ONNX with torch's exporter, in time linear in its size.

``torch.onnx.export(program, dynamo=True)`` does four things: it decomposes the program (a full
re-trace, about 10 ms per node, even when every op already has an ONNX translation), inserts
explicit type promotions (a fake-tensor interpretation of the whole graph), translates each node
with torchlib's functions (under a millisecond per node) and, by default, runs onnxscript's
optimizer, whose pattern rewriter is quadratic in the graph size (20 s on 1,500 nodes) and which
folds and deduplicates the very Q/DQ nodes a quantized model is made of.

:func:`translate` runs the same translation with the same registry and passes, but only the
passes that change something: decomposition only when some op has no ONNX translation (or has
a registered decomposition the exporter would apply), type promotion only when some node mixes
dtypes the promotion rules would cast. Skipping a pass that would change nothing gives exactly
the model the exporter would have produced. The optimizer is not run: callers clean up what
they need in linear time. The registry (torchlib's ~1,000 functions, about a second to build) is
built once per opset and process.

These are torch's private exporter internals (``torch.onnx._internal.exporter``); on a torch
version they were not verified on (:mod:`_quantplug.peers.versions`), or where they are missing,
the public ``torch.onnx.export`` runs instead (slower, the same model).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import operator
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from _quantplug.errors import LoweringError
from _quantplug.peers.versions import verified

logger = logging.getLogger("quantplug.lowering.onnx_translate")

#: the opset torchlib's functions are written for; lower targets are converted from it
TORCHLIB_OPSET = 18


def translate(
    program: torch.export.ExportedProgram,
    *,
    opset: int,
    translations: Mapping[Callable[..., Any], Callable[..., Any]],
    drop_unused: bool = False,
) -> Any:
    """``program`` as an ``onnx_ir.Model`` at ``opset``; every ONNX node records its FX node
    (``node.meta["node"]``). ``translations`` add to (or override) torchlib's. ``drop_unused``:
    without the nodes and initializers nothing reads (once: converting the opset drops them)."""
    with _quiet():
        internals = _internals()
        if internals is None:
            model = _translate_public(program, opset, translations)
            cleaned = False
        else:
            registry = _registry(opset, translations)
            program = _prepare(program, registry, internals)
            model = internals.core._exported_program_to_onnx_program(program, registry=registry).model
            cleaned = _convert_version(model, opset)
        if drop_unused and not cleaned:
            remove_unused(model)
        return model


# --------------------------------------------------------------------------------- internals


class _Internals:
    def __init__(self) -> None:
        from torch.onnx._internal.exporter import _core, _decomp, _fx_passes, _registration
        from torch.onnx._internal.fx.passes import type_promotion

        self.core = _core
        self.decomp = _decomp
        self.fx_passes = _fx_passes
        self.registration = _registration
        self.type_promotion = type_promotion


@functools.cache
def _internals() -> _Internals | None:
    if not verified("onnx_translate"):
        logger.info(
            "torch %s: the exporter's internals are not verified here; using torch.onnx.export",
            torch.__version__,
        )
        return None
    try:
        return _Internals()
    except (ImportError, AttributeError) as exc:  # torch moved them: use the public exporter
        logger.info("torch.onnx exporter internals unavailable (%s); using torch.onnx.export", exc)
        return None


@functools.cache
def _base_registry(opset: int) -> Any:
    internals = _internals()
    assert internals is not None
    return _from_torchlib(internals.registration, max(opset, TORCHLIB_OPSET))


def _from_torchlib(registration: Any, opset: int) -> Any:
    """``ONNXRegistry.from_torchlib(opset)``, the same entries in the same order, without
    compiling every torchlib function's IR: the exporter lists onnxscript's functions through
    ``get_torchlib_ops``, which builds each one's ``function_ir`` (its source parsed and
    translated, about 1.3 ms a function, 500 of them) only to read a domain the registry never
    uses. Iterating onnxscript's registry directly saves four fifths of the registry's build
    (0.2 s instead of 1.1 s), in every process that lowers to ONNX."""
    from onnxscript.function_libs.torch_lib import ops  # importing it registers torchlib's functions
    from onnxscript.function_libs.torch_lib import registration as torchlib
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    del ops
    registry = registration.ONNXRegistry()
    registry._opset_version = opset
    for meta in _torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    for qualified_name, functions in torchlib.default_registry.items():
        if qualified_name.startswith("internal::"):  # onnxscript's own helpers, as get_torchlib_ops
            continue
        listed = [(f, False) for f in functions.overloads] + [(f, True) for f in functions.complex]
        for function, is_complex in listed:
            try:  # the exporter's own guard: one function that fails is skipped, not the registry
                target = registration._get_overload(qualified_name)
                if target is None:
                    continue
                meta = registration.OnnxDecompMeta(
                    onnx_function=function,
                    fx_target=target,
                    signature=None,
                    is_custom=False,
                    is_complex=is_complex,
                )
                registry._register(target, meta)
            except Exception:
                logger.exception("Failed to register '%s'. Skipped", qualified_name)
    registry._cleanup_registry_based_on_opset_version()
    return registry


@functools.cache
def _decomposition_table(opset: int) -> dict[Any, Any]:
    """The ops the exporter would decompose (ATen decompositions of ops torchlib lacks)."""
    internals = _internals()
    assert internals is not None
    registered = set(internals.decomp.get_onnx_implemented_overloads(_base_registry(opset)))
    table: dict[Any, Any] = internals.decomp.create_onnx_friendly_decomposition_table(registered)
    return table


def _registry(opset: int, translations: Mapping[Callable[..., Any], Callable[..., Any]]) -> Any:
    """torchlib's registry plus ``translations`` (a copy: the cached one stays torchlib's)."""
    registry = copy.copy(_base_registry(opset))
    registry.functions = {k: list(v) for k, v in registry.functions.items()}
    for op, function in translations.items():
        registry.register_op(op, function, is_complex=False)
    return registry


def _prepare(program: torch.export.ExportedProgram, registry: Any, internals: _Internals) -> Any:
    """The exporter's ``_prepare_exported_program_for_export``, each pass run only if it would act."""
    opset = registry.opset_version
    table = _decomposition_table(opset)
    nodes = _call_nodes(program)
    if any(_needs_decomposition(n, registry, table) for n in nodes):
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            program = internals.fx_passes.decompose_with_registry(program, registry)
        nodes = _call_nodes(program)
    promotions = internals.type_promotion.TypePromotionTable()
    if any(_needs_type_promotion(n, promotions, internals) for n in nodes):
        internals.fx_passes.insert_type_promotion_nodes(program.graph_module)
        nodes = _call_nodes(program)  # its casts are retraced: each ``to`` brings an assertion
    if any(n.target in _ASSERTIONS for n in nodes):
        program._graph_module = internals.fx_passes.remove_assertion_nodes(program.graph_module)
    return program


def _call_nodes(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The op nodes of the program's graph and of every subgraph it calls (an autocast region,
    Falcon's rotary embedding, is one): the exporter translates those too."""
    return [
        n
        for module in program.graph_module.modules()
        if isinstance(module, torch.fx.GraphModule)
        for n in module.graph.nodes
        if n.op == "call_function"
    ]


_ASSERTIONS = {
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_tensor_metadata.default,
}


def _needs_decomposition(node: torch.fx.Node, registry: Any, table: Mapping[Any, Any]) -> bool:
    target = node.target
    if target is operator.getitem or target in _ASSERTIONS:
        return False
    if target in table:
        return True
    return isinstance(target, torch._ops.OpOverload) and not registry.is_registered(target)


def _needs_type_promotion(node: torch.fx.Node, table: Any, internals: _Internals) -> bool:
    """Whether the exporter's type promotion pass would insert a cast before or after ``node``
    (its ``_maybe_promote_node``, evaluated on the recorded values instead of re-running it)."""
    rule = internals.type_promotion.get_type_promotion_rule(node, table)
    if rule is None:
        return False

    def val(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg

    args = torch.fx.node.map_aggregate(node.args, val)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
    try:
        info = rule.preview_type_promotion(args, kwargs)
    except Exception:  # let the pass itself decide (and report)
        return True
    wanted = [(args[i], d) for i, d in info.args_dtypes.items() if i < len(args)]
    wanted += [(kwargs[k], d) for k, d in info.kwargs_dtypes.items() if k in kwargs]
    return any(_differs(value, dtype) for value, dtype in wanted)


def _differs(value: Any, dtype: torch.dtype | None) -> bool:
    from torch.onnx._internal.fx import type_utils

    if dtype is None:
        return False
    if isinstance(value, (list, tuple)):
        return any(_differs(v, dtype) for v in value)
    if isinstance(value, torch.Tensor):
        return value.dtype != dtype
    scalar = type_utils.from_scalar_type_to_torch_dtype(type(value))
    return scalar is not None and scalar != dtype


def _convert_version(model: Any, opset: int) -> bool:
    """Bring the default domain to ``opset`` (torchlib writes opset 18 ops). True when it
    converted, which also removed the nodes nothing reads (onnxscript's converter's cleanup)."""
    from onnxscript import version_converter

    converted = model.opset_imports.get("", opset) != opset
    if converted and not _renumber(model, opset):
        version_converter.convert_version(model, opset, fallback=True)
    model.opset_imports[""] = opset
    return converted


def _renumber(model: Any, opset: int) -> bool:
    """onnxscript's version converter, for models it would only renumber: no functions to
    inline, and no node of an op whose definition changed on the way (an adapter: DFT,
    GridSample, GroupNormalization from 18 to 21). For those (most models) it sets every
    default-domain node to ``opset`` and cleans up as the converter does (unused nodes, then
    unused opsets), without inlining or visiting every node once per version step. False, and
    ``model`` untouched, for the others."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedOpsetsPass
    from onnxscript.version_converter import _version_converter as converter

    current = model.opset_imports.get("")
    if model.functions or "ai.onnx" in model.opset_imports or current is None:
        return False
    if not converter.version_supported(model, opset):
        return False
    adapters = {
        (op, version) for (domain, op, version, up) in converter.registry.op_adapters if up and not domain
    }
    nodes = [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain == ""]
    for node in nodes:
        version = node.version or current
        if version > opset or any(a.is_ref() for a in node.attributes.values()):
            return False
        if any((node.op_type, v) in adapters for v in range(version, opset)):
            return False
    for node in nodes:
        node.version = opset
    model.opset_imports[""] = opset
    remove_unused(model)
    RemoveUnusedOpsetsPass()(model)
    return True


def remove_unused(model: Any) -> None:
    """Drop nodes and initializers nothing reads (one backward pass)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)


def _translate_public(
    program: torch.export.ExportedProgram,
    opset: int,
    translations: Mapping[Callable[..., Any], Callable[..., Any]],
) -> Any:
    onnx_program = torch.onnx.export(
        program,
        (),
        dynamo=True,
        opset_version=opset,
        custom_translation_table=dict(translations),
        optimize=False,
        verbose=False,
    )
    if onnx_program is None:
        raise LoweringError("torch.onnx.export returned no ONNX program")
    return onnx_program.model


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter warns about optional packages it skips and nodes without module stacks:
    not the user's concern."""
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def registered(opset: int) -> Callable[[Any], bool] | None:
    """``is_registered(op)`` of torchlib's registry at ``opset`` (None without the internals)."""
    if _internals() is None:
        return None
    with _quiet():
        return _base_registry(opset).is_registered  # type: ignore[no-any-return]
