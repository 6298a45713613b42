"""An ``ExportedProgram`` built directly from a converted program, without tracing it again.

``quantplug.convert`` returns a GraphModule whose graph is ATen IR captured by ``torch.export``
(the user's program plus Q/DQ nodes): every node already records its value (``meta["val"]``,
fake tensors whose sizes are SymInts where the user exported with ``torch.export.Dim``), so
tracing it again with ``torch.export.export`` only costs time (a few milliseconds per node),
fixes the shapes to whatever example inputs it is given, and writes into the nodes it shares
with the caller's program. :func:`to_exported_program` instead lifts the program's constants
(``get_attr`` nodes) back into placeholders, the way ``torch.export`` presents them, and wraps
the graph with its signature, calling convention and the range of every dynamic dimension,
read from the program itself.

The result is what the ONNX exporter translates and what ``torch.export.save`` writes.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

try:  # private torch helper; without it ExportedProgram compiles its code when built
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:  # pragma: no cover - depends on the torch version
    _LazyGraphModule = None  # type: ignore[assignment,misc]

from _quantplug.errors import LoweringError
from _quantplug.flow.loop_bodies import loop_bodies
from _quantplug.graph.attrs import fetch_attr
from _quantplug.graph.working_copy import RANGE_CONSTRAINTS, copy_graph
from _quantplug.lowering.onnx.provenance import where

GraphRewrite = Callable[[Graph], None]


def to_exported_program(
    gm: GraphModule, *, rewrite: GraphRewrite | None = None
) -> torch.export.ExportedProgram:
    """``gm`` as an ``ExportedProgram`` (its own graph; tensors shared, never written).

    Args:
        gm: a converted program (or any GraphModule whose nodes record ``meta["val"]``).
        rewrite: edits the copied graph (still holding ``get_attr`` nodes) before constants are
            lifted; nodes it adds may leave ``meta["val"]`` unset, it is computed here.

    Raises:
        LoweringError: a value cannot be computed, or the program cannot be wrapped (the message
            names the node).
    """
    from torch.export.graph_signature import ExportGraphSignature

    bodies = loop_bodies(gm)
    if bodies:  # each body is a program of its own, with constants and values not lifted here
        raise LoweringError(
            f"the converted program runs a loop (scan or while_loop; its body {bodies[0]!r}), which cannot "
            "be wrapped as an ExportedProgram for lowering yet; run the converted GraphModule itself, or "
            "unroll the loop in the model (a Python for loop over a fixed count) before torch.export"
        )
    graph = Graph(owning_module=gm)  # dead-code elimination asks it about submodules
    copied = copy_graph(graph, gm.graph)
    if copied is None:
        raise LoweringError("the program has no output node")
    outputs, old_output = copied
    out_node = graph.output(outputs)
    out_node.meta = dict(old_output.meta)
    _drop_input_guards(graph)
    if rewrite is not None:
        rewrite(graph)
    graph.eliminate_dead_code()
    fake_mode = _fake_mode(graph)
    lifted = _lift_constants(gm, graph)
    _fill_values(graph, fake_mode)
    user_inputs = [n for n in graph.nodes if n.op == "placeholder" and n not in lifted.nodes]
    signature = ExportGraphSignature(
        input_specs=lifted.specs + [_user_input_spec(n) for n in user_inputs],
        output_specs=[_user_output_spec(a) for a in _flat_outputs(graph)],
    )
    call_graph = _module_call_graph(gm, signature)
    try:
        with _code_on_first_use():
            return _exported_program(gm, graph, lifted, signature, call_graph, user_inputs, fake_mode)
    except Exception as exc:
        raise LoweringError(
            f"the converted program cannot be wrapped as an ExportedProgram ({type(exc).__name__}: {exc}); "
            "lower the GraphModule quantplug.convert() returned, with passes that keep it an ATen graph"
        ) from exc


def _exported_program(
    gm: GraphModule,
    graph: Graph,
    lifted: _Lifted,
    signature: Any,
    call_graph: list[Any],
    user_inputs: list[Node],
    fake_mode: Any,
) -> torch.export.ExportedProgram:
    return torch.export.ExportedProgram(
        root=lifted.root,
        graph=graph,
        graph_signature=signature,
        state_dict=lifted.state_dict,
        range_constraints=_range_constraints(user_inputs, fake_mode, gm.meta.get(RANGE_CONSTRAINTS)),
        module_call_graph=call_graph,
        constants=lifted.constants,
        verifiers=_verifiers(),
    )


_patch_lock = threading.Lock()
_patch_depth = 0
_torch_hook: list[Any] = []  # torch's function while patched


@contextlib.contextmanager
def _code_on_first_use() -> Iterator[None]:
    """``ExportedProgram`` generates and compiles its graph module's Python code when built
    (``torch.fx.GraphModule``): 0.05 s for the 2,564 nodes of mlp-256 (issue 12.10), and nothing
    in lowering runs that code. Within this block it builds torch.fx's lazy module instead,
    which compiles on its first call (if a caller ever runs it): the same module otherwise.

    The hook is torch's private ``_create_graph_module_for_export``; where it is missing, or the
    lazy module is, programs are built as before. The patch is counted, so concurrent lowerings
    restore torch's function only when the last one leaves.
    """
    global _patch_depth
    from torch.export import exported_program as ep_module

    original = getattr(ep_module, "_create_graph_module_for_export", None)
    if original is None or _LazyGraphModule is None:
        yield
        return
    with _patch_lock:
        if _patch_depth == 0:
            _torch_hook[:] = [original]
            ep_module._create_graph_module_for_export = _LazyGraphModule
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                ep_module._create_graph_module_for_export = _torch_hook.pop()


def _verifiers() -> list[Any] | None:
    """``torch.export``'s checks for its own IR (in-place ops on intermediates included)."""
    try:
        from torch._export.verifier import TrainingIRVerifier
    except ImportError:  # pragma: no cover - depends on the torch version
        return None
    return [TrainingIRVerifier]


def _drop_input_guards(graph: Graph) -> None:
    """``ep.module()`` (what prepare starts from for programs with higher-order ops) calls an input
    guard submodule first; an ExportedProgram checks its inputs itself and holds no submodules."""
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn" and not node.users:
            graph.erase_node(node)
        elif node.op == "call_module":
            raise LoweringError(
                f"the converted program calls submodule {node.target!r} (node {node.name!r}); "
                "lowering takes programs of functions only: pass the output of quantplug.convert()"
            )


# --------------------------------------------------------------------------------- fake values


def _fake_mode(graph: Graph) -> Any:
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    for ops in (("placeholder",), ("call_function",)):  # the inputs' mode; else any node's
        vals = [n.meta.get("val") for n in graph.nodes if n.op in ops]
        mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
        if mode is not None:
            return mode
    return FakeTensorMode()


def _as_fake(value: Any, fake_mode: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        return fake_mode.from_tensor(value, static_shapes=True)
    return value


def _fill_values(graph: Graph, fake_mode: Any) -> None:
    """Compute ``meta["val"]`` of the nodes that lack one (convert leaves it off quantize nodes)."""
    for node in graph.nodes:
        if node.op != "call_function" or "val" in node.meta:
            continue

        def val(arg: Any) -> Any:
            return _as_fake(arg.meta.get("val"), fake_mode) if isinstance(arg, Node) else arg

        args = torch.fx.node.map_aggregate(node.args, val)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, val)
        try:
            with fake_mode:
                node.meta["val"] = node.target(*args, **kwargs)  # type: ignore[operator]
        except Exception as exc:
            raise LoweringError(
                f"cannot compute the output of node {node.name!r} ({node.target}{where(node)}) for export: "
                f"{type(exc).__name__}: {exc}. Nodes added to a converted program must be ops with a "
                "fake (meta) kernel, or carry node.meta['val']"
            ) from exc


# --------------------------------------------------------------------------------- constants


class _Lifted:
    def __init__(self) -> None:
        self.nodes: set[Node] = set()
        self.specs: list[Any] = []
        self.state_dict: dict[str, torch.Tensor] = {}
        self.constants: dict[str, Any] = {}
        self.root = nn.Module()


def _lift_constants(gm: GraphModule, graph: Graph) -> _Lifted:
    """``get_attr`` tensors -> placeholders (parameters, buffers, constants), ahead of user inputs."""
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

    lifted = _Lifted()
    buffers = {name for name, _ in gm.named_buffers()}
    persistent = set(gm.state_dict(keep_vars=True))
    by_target: dict[str, Node] = {}
    # lifted placeholders go first, before the user inputs (get_attr nodes are erased below)
    anchor = next(n for n in graph.nodes if n.op != "get_attr")
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        target = str(node.target)
        value = fetch_attr(gm, target)
        if not isinstance(value, torch.Tensor):  # a submodule (a higher-order op's body)
            _attach(lifted.root, target, value)
            continue
        placeholder = by_target.get(target)
        if placeholder is None:
            if isinstance(value, nn.Parameter):
                kind, prefix = InputKind.PARAMETER, "p_"
                lifted.state_dict[target] = value
            elif target in buffers and target in persistent:
                kind, prefix = InputKind.BUFFER, "b_"
                lifted.state_dict[target] = value
            else:
                kind, prefix = InputKind.CONSTANT_TENSOR, "c_"
                lifted.constants[target] = value
            with graph.inserting_before(anchor):
                placeholder = graph.placeholder(_placeholder_name(prefix, target))
            val = node.meta.get("val")  # fake, or the tensor itself (convert's constants)
            placeholder.meta["val"] = val if isinstance(val, torch.Tensor) else value
            by_target[target] = placeholder
            lifted.nodes.add(placeholder)
            persistent_flag = True if kind == InputKind.BUFFER else None
            lifted.specs.append(InputSpec(kind, TensorArgument(placeholder.name), target, persistent_flag))
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
    return lifted


def _placeholder_name(prefix: str, target: str) -> str:
    """``p_`` + the attribute path as an identifier: the graph's code names its inputs after
    placeholders, and a module name need not be one (RegNet's ``block1-0``, ``nn.ModuleDict`` keys
    with spaces); ``torch.fx`` does not clean it, so ``block1-0`` left the generated ``forward``
    a ``SyntaxError`` for every model whose parameters under such a name stay float."""
    return prefix + re.sub(r"\W", "_", target)


def _attach(root: nn.Module, target: str, value: Any) -> None:
    *path, name = target.split(".")
    module = root
    for part in path:
        child = getattr(module, part, None)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if isinstance(value, nn.Module):
        module.add_module(name, value)
    else:
        setattr(module, name, value)


# --------------------------------------------------------------------------------- signature


def _argument(node: Node) -> Any:
    from torch.export.graph_signature import SymIntArgument, TensorArgument

    val = node.meta.get("val")
    return SymIntArgument(node.name) if isinstance(val, torch.SymInt) else TensorArgument(node.name)


def _user_input_spec(node: Node) -> Any:
    from torch.export.graph_signature import InputKind, InputSpec

    return InputSpec(InputKind.USER_INPUT, _argument(node), None)


def _flat_outputs(graph: Graph) -> list[Any]:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    return list(torch.utils._pytree.tree_leaves(out.args[0]))


def _user_output_spec(arg: Any) -> Any:
    from torch.export.graph_signature import ConstantArgument, OutputKind, OutputSpec

    if isinstance(arg, Node):
        return OutputSpec(OutputKind.USER_OUTPUT, _argument(arg), None)
    return OutputSpec(OutputKind.USER_OUTPUT, ConstantArgument(name="", value=arg), None)


def _module_call_graph(gm: GraphModule, signature: Any) -> list[Any]:
    """The calling convention of ``gm`` (its pytree specs), as ``torch.export`` records it.

    The root entry lists no input or output arguments, as ``torch.export`` writes it: its
    arguments are the graph signature's. Naming the nodes here (as 0.1.0 did) ties the entry to
    node names that every later pass may change: ExecuTorch's ``to_edge`` decomposes the program,
    its outputs get new names, and torch's verifier then refused the program
    (``SpecViolationError: Output ... does not exist in the graph``, issue 45.1).
    """
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.utils import _pytree as pytree

    info = getattr(gm.graph._codegen, "pytree_info", None)
    users = [s.arg for s in signature.input_specs if s.kind.name == "USER_INPUT"]
    outs = [s.arg for s in signature.output_specs]
    if info is not None and info.in_spec is not None:
        in_spec, out_spec, names = info.in_spec, info.out_spec, list(info.orig_args)
    else:
        in_spec = pytree.tree_flatten((tuple(users), {}))[1]
        out_spec = pytree.tree_flatten(tuple(outs))[1]
        names = [a.name for a in users]
    if out_spec is None:
        out_spec = pytree.tree_flatten(tuple(outs))[1]
    entry = ModuleCallSignature(
        inputs=[], outputs=[], in_spec=in_spec, out_spec=out_spec, forward_arg_names=names
    )
    return [ModuleCallEntry(fqn="", signature=entry)]


def _range_constraints(
    user_inputs: list[Node], fake_mode: Any, given: Mapping[Any, Any] | None
) -> dict[Any, Any]:
    """Each symbol of the inputs' dynamic dimensions with its range: the one the source program
    declared (``given``, what the user passed to ``torch.export.Dim``), else its ShapeEnv's."""
    shape_env = getattr(fake_mode, "shape_env", None)
    ranges: dict[Any, Any] = {}
    for node in user_inputs:
        val = node.meta.get("val")
        dims = val.shape if isinstance(val, torch.Tensor) else (val,) if isinstance(val, torch.SymInt) else ()
        for dim in dims:
            if not isinstance(dim, torch.SymInt):
                continue
            for sym in dim.node.expr.free_symbols:
                bound = (given or {}).get(sym)
                if bound is None and shape_env is not None:
                    bound = shape_env.var_to_range.get(sym)
                if bound is not None:
                    ranges[sym] = bound
    return ranges


def dimension_names(program: torch.export.ExportedProgram) -> dict[str, str]:
    """``{"s77": "batch"}``: each input symbol's name as the user gave it (``Dim("batch")``)."""
    names: dict[str, str] = {}
    for node in program.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if not isinstance(val, torch.Tensor):
            continue
        shape_env = getattr(getattr(val, "fake_mode", None), "shape_env", None)
        debug = getattr(shape_env, "source_name_to_debug_name", None) or {}
        for dim in val.shape:
            if not isinstance(dim, torch.SymInt) or not dim.node.expr.is_symbol:
                continue
            sym = dim.node.expr
            for source in getattr(shape_env, "var_to_sources", {}).get(sym, []):
                label = source.name() if callable(source.name) else source.name
                name = debug.get(label)
                if name and name.isidentifier():
                    names.setdefault(str(sym), name)
    return names
