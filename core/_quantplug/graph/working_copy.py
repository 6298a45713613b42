"""Getting a GraphModule we may change without touching the caller's model.

``ExportedProgram.module()`` is what PT2E flows start from, but it is expensive: it deep-copies
the graph, generates and compiles Python code three times and adds an input-guard submodule.
``working_copy`` builds the same unlifted module directly from ``ep.graph`` and the graph
signature (same node names, same meta, same parameter objects, same pytree calling convention)
and compiles it at most once; ``lazy=True`` defers even that to the caller (``prepare`` compiles
once, after inserting its observers). Programs it does not handle (buffer or input mutations,
effect tokens, custom objects, higher-order-op submodules) go through ``ep.module()``.
"""

from __future__ import annotations

import copy
import gc
import linecache
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node, map_arg
from torch.fx.node import Argument, Target

from _quantplug.errors import QuantplugError
from _quantplug.graph.attrs import module_getattr
from _quantplug.graph.mutation import view_base, written_args

try:  # private torch helpers; without them we fall back to ep.module()
    from torch.export._unlift import _get_codegen
    from torch.export.graph_signature import InputKind, OutputKind
    from torch.fx._lazy_graph_module import _LazyGraphModule
except ImportError:  # pragma: no cover - depends on the torch version
    _get_codegen = None  # type: ignore[assignment]
    _LazyGraphModule = None  # type: ignore[assignment,misc]


#: ``GraphModule.meta`` key: the source ExportedProgram's ``range_constraints`` (lowering re-wraps
#: the converted program as an ExportedProgram with them)
RANGE_CONSTRAINTS = "export_range_constraints"


def working_copy(program: torch.export.ExportedProgram | GraphModule, *, lazy: bool = False) -> GraphModule:
    """A GraphModule with its own graph; parameters are shared, never written.

    An ``ExportedProgram`` is unlifted like ``ep.module()`` (parameters, buffers and constants
    become attributes holding the very same tensor objects; user inputs stay placeholders). A
    GraphModule gets its graph copied (node meta included) so annotations and observers never
    reach the caller's graph. Passes must replace tensors (new attributes), not modify them in
    place.

    Args:
        program: the program to copy.
        lazy: return a module whose code is generated on first use (call :func:`compile_now`
            when done editing the graph) instead of compiling it here.
    """
    if isinstance(program, torch.export.ExportedProgram):
        since = code_counter()
        gm = _unlift_directly(program, lazy=lazy)
        if gm is None:
            gm = program.module()  # compiles a few times, some of them for modules it discards
        release_code_with(gm, since=since)
        own_written_state(gm)
        # the ranges the user gave torch.export.Dim (the ShapeEnv keeps >= 2 for 0/1 specialization)
        gm.meta[RANGE_CONSTRAINTS] = dict(program.range_constraints)
        return gm
    if isinstance(program, GraphModule):
        graph = Graph(owning_module=None, tracer_cls=program.graph._tracer_cls)
        graph._codegen = program.graph._codegen
        copied = copy_graph(graph, program.graph)
        if copied is not None:
            graph.output(copied[0])
        cls = _LazyGraphModule if lazy and _LazyGraphModule is not None else GraphModule
        module = cls(program, graph, class_name=type(program).__name__)
        module.meta.update({k: v for k, v in program.meta.items() if not k.startswith("quantplug")})
        release_code_with(module)
        own_written_state(module)
        return module
    raise QuantplugError(
        f"expected a torch.export.ExportedProgram or a torch.fx.GraphModule, got {type(program).__name__}; "
        "capture the model with torch.export.export(model, example_inputs) first"
    )


def compile_now(gm: GraphModule) -> None:
    """Generate ``gm``'s code from its graph now (once), lazy module or not."""
    if _LazyGraphModule is not None and isinstance(gm, _LazyGraphModule):
        gm.recompile()  # marks it stale (the graph may have changed since it was last compiled)
        gm.real_recompile()
    else:
        gm.recompile()
    release_code_with(gm)


def release_code_with(gm: GraphModule, *, since: int | None = None) -> None:
    """Forget ``gm``'s generated Python source when ``gm`` is garbage collected.

    torch.fx keeps the source of every module it compiles, for tracebacks, in ``linecache`` and
    in its loader's cache, for the life of the process: tens of KiB per module, which grow
    without bound when a service prepares and converts models in a loop. Call after each
    compile (a recompile makes a new entry); ``since`` (a :func:`code_counter` value) also
    ties to ``gm`` every source compiled since then (torch's own intermediate modules).
    """
    keys = set()
    forward = type(gm).__dict__.get("forward")
    key = getattr(getattr(forward, "__code__", None), "co_filename", None)
    if isinstance(key, str) and key.startswith(_KEY_PREFIX):
        keys.add(key)
    loader = _fx_loader()
    if since is not None and loader is not None:
        keys.update(k for k in list(loader.eval_cache) if since <= _key_number(k) < loader.next_id)
    if keys:
        weakref.finalize(gm, _forget_sources, tuple(keys))


_KEY_PREFIX = "<eval_with_key>."


def _fx_loader() -> Any:
    loader = getattr(torch.fx.graph_module, "_loader", None)
    return loader if isinstance(getattr(loader, "eval_cache", None), dict) else None


def code_counter() -> int:
    loader = _fx_loader()
    return int(getattr(loader, "next_id", 0)) if loader is not None else 0


def _key_number(key: str) -> int:
    digits = key[len(_KEY_PREFIX) :].split(" ", 1)[0] if key.startswith(_KEY_PREFIX) else ""
    return int(digits) if digits.isdigit() else -1


def _forget_sources(keys: tuple[str, ...]) -> None:
    loader = _fx_loader()
    for key in keys:
        linecache.cache.pop(key, None)
        if loader is not None:
            loader.eval_cache.pop(key, None)


def own_written_state(gm: GraphModule) -> list[str]:
    """Give ``gm`` private copies of the tensors its forward writes in place; returns their names.

    Working copies share the caller's parameters and buffers; a forward that updates one (batch
    norm in training mode, a counter buffer, ``copy_`` into a buffer) would change the caller's
    model during calibration. Only written tensors are copied, so inference programs cost nothing.
    """
    written = _written_targets(gm)
    for target in written:
        holder_path, _, name = target.rpartition(".")
        holder = gm.get_submodule(holder_path)
        value = getattr(holder, name)
        if not isinstance(value, torch.Tensor):
            continue
        copy_ = value.detach().clone()
        if name in holder._parameters:
            holder._parameters[name] = nn.Parameter(copy_, requires_grad=value.requires_grad)
        elif name in holder._buffers:
            holder._buffers[name] = copy_
        else:
            setattr(holder, name, copy_)
    return written


def own_parameters(gm: GraphModule) -> None:
    """Give ``gm`` private copies of all its parameters and buffers (training updates them: QAT
    must not write the caller's weights, nor its batch-norm statistics)."""
    for module in gm.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.detach().clone(), param.requires_grad)
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.detach().clone()


def written_parameters(gm: GraphModule) -> list[str]:
    """The parameters (not buffers) ``gm``'s forward writes in place, by qualified name.

    Buffers are state by design (batch-norm statistics, caches); a parameter written at every call
    is a model that prepares its weights on its first forward and was exported before it."""
    found = []
    for target in _written_targets(gm):
        holder_path, _, name = target.rpartition(".")
        if name in gm.get_submodule(holder_path)._parameters:
            found.append(target)
    return found


def _written_targets(gm: GraphModule) -> list[str]:
    """The attributes (parameters, buffers, constants) ``gm``'s forward writes in place."""
    written: dict[str, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":  # only calls write
            continue
        for arg in _written_args(gm, node):
            base = view_base(arg)  # a write into a view (``buf.select(0, 1).add_(x)``) writes its base
            if base.op == "get_attr":
                written[str(base.target)] = None
    return list(written)


def _written_args(gm: GraphModule, node: Node) -> list[Node]:
    """The node arguments ``node`` writes in place: by its schema (``written_args``), or, for a
    higher-order op that runs a subgraph (torch.export's ``with torch.no_grad():`` regions), the
    operands that subgraph writes. transformers' RWKV rescales its weights in place
    (``weight.div_(...)``) in such a region on its first forward; exported before that call,
    every run of the program divides them again, and calibration divided the caller's
    parameters."""
    if node.op != "call_function":
        return []
    found = written_args(node)
    for i, arg in enumerate(node.args):
        if not isinstance(arg, Node) or arg.op != "get_attr":
            continue
        # (a weight's dotted target misses as an attribute name: answered without torch's error)
        body = module_getattr(gm, str(arg.target), None)
        if not isinstance(body, GraphModule):
            continue
        operands = node.args[i + 1 :]  # a region op's operands follow its subgraph
        for index in _written_placeholders(body):
            operand = operands[index] if index < len(operands) else None
            if isinstance(operand, Node):
                found.append(operand)
        break
    return found


def _written_placeholders(body: GraphModule) -> list[int]:
    """Indices of the placeholders of ``body`` that it (or a region inside it) writes in place."""
    inputs = {n: i for i, n in enumerate(n for n in body.graph.nodes if n.op == "placeholder")}
    return sorted(
        {inputs[arg] for node in body.graph.nodes for arg in _written_args(body, node) if arg in inputs}
    )


@contextmanager
def paused_gc() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector while a graph is built.

    Building a graph creates thousands of long-lived objects (nodes, their dicts, modules), and
    every few hundred allocations the collector walks the young generation, every so often all
    of memory: on a 5,000-node program with its observers that is up to a third of prepare or
    convert. Reference counting still frees what it can meanwhile; cycles are collected as usual
    once the block ends.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_LIFTED_KINDS = ("PARAMETER", "BUFFER", "CONSTANT_TENSOR")
_NON_WORD = re.compile(r"\W")


def call_specs(ep: torch.export.ExportedProgram) -> tuple[Any, Any]:
    """``(ep.call_spec.in_spec, ep.call_spec.out_spec)``, read where that property reads them.

    ``ExportedProgram.call_spec`` defines a ``NamedTuple`` class at every read: 35 us, and
    0.25 ms of a prepare after a ``gc.collect()`` (typing's class machinery out of the caches).
    Its two specs are the root entry's of ``module_call_graph``; any other case (no entry, a root
    that is not the first, no signature) asks the property, which answers or raises as before."""
    graph = ep.module_call_graph
    if graph and graph[0].fqn == "" and graph[0].signature is not None:
        signature = graph[0].signature
        return signature.in_spec, signature.out_spec
    spec = ep.call_spec
    return spec.in_spec, spec.out_spec


def _simple_program(ep: torch.export.ExportedProgram, call_spec: tuple[Any, Any]) -> bool:
    """Only plain inference programs: user inputs, lifted state, user outputs, no submodules.

    ``call_spec``: :func:`call_specs` of ``ep``."""
    if _get_codegen is None or _LazyGraphModule is None or call_spec[0] is None:
        return False
    sig = ep.graph_signature
    # the kinds by identity (members are singletons): an Enum's ``name`` and hash are Python-level
    # calls, which cost a tenth of a copy's time on a program of hundreds of weights
    kinds = {id(kind) for kind in InputKind if kind == InputKind.USER_INPUT or kind.name in _LIFTED_KINDS}
    if any(id(s.kind) not in kinds for s in sig.input_specs):
        return False
    if any(s.kind != OutputKind.USER_OUTPUT for s in sig.output_specs):
        return False
    placeholders = 0
    higher_order = torch._ops.HigherOrderOperator
    for node in ep.graph.nodes:
        op = node.op
        if op == "placeholder":
            placeholders += 1
        elif op == "call_function":
            if isinstance(node.target, higher_order):
                return False
        elif op == "get_attr" or op == "call_module":
            return False
    return placeholders == len(sig.input_specs)


def _unlift_directly(ep: torch.export.ExportedProgram, *, lazy: bool) -> GraphModule | None:
    """``ep.module()`` without its deep copy, guard module and repeated compiles (None: not simple)."""
    call_spec = call_specs(ep)
    if not _simple_program(ep, call_spec):
        return None
    sig = ep.graph_signature
    graph = Graph(tracer_cls=ep.graph._tracer_cls)
    copied = copy_graph(graph, ep.graph)
    if copied is None:
        return None
    outputs, old_output = copied
    # lifted inputs -> get_attr, in place of their placeholders (torch's node names and order)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind == InputKind.USER_INPUT or _become_get_attr(graph, node, spec.target):
            continue
        with graph.inserting_after(node):  # a torch.fx without the tables the shortcut keeps up
            attr = graph.get_attr(spec.target)
        node.replace_all_uses_with(attr)
        meta = node.meta
        graph.erase_node(node)
        attr.meta = meta
    flat_outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    out_node = graph.output(tuple(flat_outputs), type_expr=getattr(old_output, "type", None))
    out_node.meta = dict(old_output.meta)
    forward_arg_names = (
        s.forward_arg_names if ep.module_call_graph and (s := ep.module_call_graph[0].signature) else None
    )
    graph._codegen = _get_codegen(call_spec[0], call_spec[1], forward_arg_names)

    cls = _LazyGraphModule if lazy else GraphModule
    gm = cls(nn.Module(), Graph())  # empty graph: nothing to copy or compile yet
    _register_state(gm, ep)
    gm.graph = graph  # one compile (none if lazy)
    gm.meta.update(ep.graph_module.meta)
    return gm


def _become_get_attr(graph: Graph, node: Node, target: str) -> bool:
    """Turn placeholder ``node`` into the ``get_attr`` of ``target`` that ``ep.module()`` puts in
    its place, as that node: the name ``graph.get_attr(target)`` would get now, no type, the
    placeholder's meta, users and position. Inserting that node, moving the users over and erasing
    the placeholder cost four graph edits per weight (a quarter of copying a decoder's graph);
    here the node changes its op, target and name under the graph's lookup table and namespace,
    which keep the same entries in the same order as after those edits (torch.fx 2.13's private
    tables; False, nothing done, on a torch.fx without them: then the caller makes the edits).
    """
    namespace = getattr(graph, "_graph_namespace", None)
    table = getattr(graph, "_find_nodes_lookup_table", None)
    if not (
        hasattr(namespace, "_rename_object") and hasattr(table, "remove") and hasattr(graph, "_target_to_str")
    ):
        return False
    assert namespace is not None and table is not None
    name = namespace.create_name(graph._target_to_str(target), None)
    namespace._rename_object(node, name)
    table.remove(node)  # filed under its op: taken out before the op changes, filed again after
    for attribute, value in (("op", "get_attr"), ("target", target), ("name", name), ("type", None)):
        object.__setattr__(node, attribute, value)
    table.insert(node)
    return True


def _register_state(gm: GraphModule, ep: torch.export.ExportedProgram) -> None:
    """Parameters, buffers and constants of ``ep`` on ``gm`` under their FQNs (the same tensors)."""
    sig = ep.graph_signature
    non_persistent = set(sig.non_persistent_buffers)
    modules: dict[str, nn.Module] = {"": gm}

    def module_at(path: str) -> nn.Module:
        module = modules.get(path)
        if module is None:
            outer_path, _, name = path.rpartition(".")
            module = nn.Module()
            module_at(outer_path).add_module(name, module)
            modules[path] = module
        return module

    def holder(fqn: str) -> tuple[nn.Module, str]:
        parent, _, attr = fqn.rpartition(".")
        return module_at(parent), attr

    for name in sig.parameters:
        module, attr = holder(name)
        value = ep.state_dict[name]
        if isinstance(value, nn.Parameter):
            module.register_parameter(attr, value)
        else:
            setattr(module, attr, value)
    for name in sig.buffers:
        module, attr = holder(name)
        if name in non_persistent:
            module.register_buffer(attr, ep.constants[name], persistent=False)
        else:
            module.register_buffer(attr, ep.state_dict[name])
    for name in sig.lifted_tensor_constants:
        module, attr = holder(name)
        setattr(module, attr, ep.constants[name])


def add_node(
    graph: Graph,
    op: str,
    target: Target,
    args: tuple[Argument, ...] = (),
    kwargs: dict[str, Argument] | None = None,
    name: str | None = None,
    type_expr: Any | None = None,
) -> Node:
    """``graph.create_node(...)``, without the per-node scan that makes it slow on big graphs.

    torch 2.13's ``create_node`` walks every argument with pytree to warn about raw SymInts
    (which exported graphs keep inside Nodes); that walk is a quarter of the cost of copying a
    graph. The node is created bare and then given its arguments in the one step ``Node``'s own
    constructor takes (the same users, the same node): through the public ``args``/``kwargs``
    setters it took two, each through ``Node.__setattr__``, which takes the node out of the
    graph's lookup table and files it again on every assignment.
    """
    node = graph.create_node(op, target, None, None, name, type_expr)
    if args or kwargs:
        node._update_args_kwargs(args, kwargs if kwargs else node.kwargs)
    return node


def copy_node(graph: Graph, node: Node, arg_transform: Callable[[Node], Argument]) -> Node:
    """``graph.node_copy(node, arg_transform)`` through :func:`add_node`."""
    args = map_arg(node.args, arg_transform)
    kwargs = map_arg(node.kwargs, arg_transform)
    new = add_node(graph, node.op, node.target, args, kwargs, node.name, node.type)
    if type(node.meta) is dict:  # into the new node's own empty dict: no Node.__setattr__
        new.meta.update(node.meta)
    else:
        new.meta = copy.copy(node.meta)
    return new


def copy_graph(graph: Graph, source: Graph) -> tuple[Argument, Node] | None:
    """``graph.graph_copy(source, {}, return_output_node=True)`` through :func:`copy_node`.

    Returns the copied output value and ``source``'s output node (None without an output).
    """
    value_map: dict[Node, Node] = {}
    lookup = value_map.__getitem__
    for node in source.nodes:
        if node.op == "output":
            return map_arg(node.args[0], lookup), node
        value_map[node] = copy_node(graph, node, lookup)
    return None


class AttrNamer:
    """Fresh attribute names in O(1): a counter per prefix instead of probing prefix0, prefix1..."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._counters: dict[str, int] = {}

    def __call__(self, prefix: str) -> str:
        # an identifier: generated code (and torch.export's lifted inputs) names arguments after
        # attributes, and module paths may hold any character (torchvision's RegNet: "block1-0")
        if not (prefix.isascii() and prefix.isidentifier()):  # an ASCII identifier has no \W
            prefix = _NON_WORD.sub("_", prefix)
        i = self._counters.get(prefix, 0)
        while True:
            name = f"{prefix}{i}"
            i += 1
            if not hasattr(self._module, name):
                self._counters[prefix] = i
                return name
