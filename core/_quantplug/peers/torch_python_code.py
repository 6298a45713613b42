"""torch.fx's ``Graph.python_code`` for the graphs quantplug generates code for, in one pass.

``GraphModule.recompile`` asks ``graph.python_code(root_module="self")`` for the source of
``forward``. torch.fx's generator is general (type annotations, verbose stack traces, profiler
records, custom code generators, body transformers) and pays for it on every node: a temporary
``_repr_fn`` per node, a namespace lookup per printed node, an ``isinstance`` chain per constant,
the body assembled with counter comments and taken apart again by a regular expression.

:func:`python_code` writes the same text, with the same globals, line map and prologue start,
for the graphs quantplug produces: placeholders, ``get_attr``, ``call_function``, ``call_module``
and ``call_method`` nodes without type annotations, under torch's default or pytree code
generator. Everything it does not know it leaves to torch (it returns ``None``): another code
generator or a body transformer, annotated or wrapped nodes, any option of ``python_code`` but
the root module, the ``FX_GRAPH_SHOW_*`` environment, an unverified torch. The per-node
decisions follow ``CodeGen._gen_python_code`` of torch 2.13 statement by statement (names are
created in the same order, so the same collisions get the same suffixes);
``tests/core/test_peers.py`` compares text, globals and line maps with torch's own.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.graph as fx_graph
from torch.fx import Graph, Node
from torch.fx.immutable_collections import immutable_dict

from _quantplug.peers.versions import verified

#: what torch.fx's generator reads besides the graph; a torch.fx without one of them is not ours
_NEEDED = (
    "CodeGen",
    "_PyTreeCodeGen",
    "PythonCode",
    "_name_regex",
    "_illegal_char_regex",
    "_illegal_names",
    "_custom_builtins",
    "_format_target",
    "magic_methods",
    "inplace_methods",
    "_get_qualified_name",
    "_is_from_torch",
    "is_opaque_value_type",
)
_ENVIRONMENT = ("FX_GRAPH_SHOW_STRIDE", "FX_GRAPH_SHOW_DEVICE", "FX_GRAPH_SHOW_META")
#: constants printed with ``repr`` by torch's ``_get_repr`` (none is a Node, tuple, operator,
#: Enum, Tensor, list or slice); each is still asked ``is_opaque_value_type`` once per call
_PLAIN: frozenset[type] = frozenset(
    {
        int,
        float,
        bool,
        complex,
        str,
        type(None),
        type(...),
        torch.dtype,
        torch.device,
        torch.memory_format,
        torch.layout,
    }
)

#: dicts torch prints with ``dict.__repr__``
_DICTS = frozenset(cls for cls in (dict, immutable_dict) if cls.__repr__ is dict.__repr__)


class Namespace:
    """torch.fx's ``_Namespace`` (unique names for objects, builtins not shadowed), with the
    number suffix of a plain ASCII name split off by string methods instead of its regular
    expression (``_name_regex``: the shortest base followed by ``_<digits>``, which for an ASCII
    identifier is the split at its last underscore); other names take torch's own steps."""

    __slots__ = ("_base_count", "_obj_to_name", "_used_names")

    def __init__(self) -> None:
        self._obj_to_name: dict[Any, str] = {}
        self._used_names: set[str] = set()
        self._base_count: dict[str, int] = {}

    def create_name(self, candidate: str, obj: Any) -> str:
        """The name ``_Namespace.create_name(candidate, obj)`` gives after the same calls."""
        if obj is not None:
            named = self._obj_to_name.get(obj)
            if named is not None:
                return named
        if candidate.isascii() and candidate.isidentifier():
            head, _, tail = candidate.rpartition("_")
            base, suffix = (head, tail) if head and tail.isdigit() else (candidate, None)
        else:  # torch's steps
            match = fx_graph._name_regex.match(candidate)
            if match is None:
                candidate = fx_graph._illegal_char_regex.sub("_", candidate)
                if not candidate:
                    candidate = "_unnamed"
                if candidate[0].isdigit():
                    candidate = f"_{candidate}"
                match = fx_graph._name_regex.match(candidate)
                if match is None:
                    raise AssertionError(f"Name regex failed to match candidate: {candidate}")
            base, suffix = match.group(1, 2)
        used = self._used_names
        if suffix is None or candidate in used:
            num = self._base_count.get(base, 0)
            if fx_graph._illegal_names.get(candidate, obj) is not obj:
                num += 1
                candidate = f"{base}_{num}"
        else:
            num = int(suffix)
        while candidate in used:
            num += 1
            candidate = f"{base}_{num}"
        used.add(candidate)
        self._base_count[base] = num
        if obj is not None:
            self._obj_to_name[obj] = candidate
        return candidate


class _Unknown(Exception):
    """Raised inside the generator where torch's path must answer instead."""


def python_code(graph: Graph, root_module: str, **options: Any) -> Any:
    """``graph.python_code(root_module, **options)`` as torch.fx writes it, or ``None`` where
    this generator does not know the graph or the options (torch's own path then runs)."""
    if any(options.values()) or type(graph) is not Graph or not verified("torch_python_code"):
        return None
    if any(os.environ.get(name, "0") == "1" for name in _ENVIRONMENT):
        return None
    if not all(hasattr(fx_graph, name) for name in _NEEDED):
        return None
    codegen = graph._codegen
    if (
        type(codegen) not in (fx_graph.CodeGen, fx_graph._PyTreeCodeGen)
        or codegen._body_transformer is not None
    ):
        return None
    nodes = list(graph.nodes)
    if not nodes or nodes[-1].op != "output":
        return None
    for node in nodes:
        if node.type is not None or node.meta.get("is_wrapped", False):
            return None
    try:
        return _generate(codegen, nodes, root_module)
    except _Unknown:
        return None


def _generate(codegen: Any, nodes: list[Node], root_module: str) -> Any:
    """``CodeGen._gen_python_code`` (torch 2.13) without options, one statement per node."""
    create_name = Namespace().create_name
    globals_: dict[str, Any] = {}
    qualified_names: dict[int, tuple[Any, str]] = {}  # by identity: an OpOverload hashes in Python
    from_torch: dict[int, tuple[Any, bool]] = {}
    call_globals: dict[int, tuple[Any, str]] = {}  # a call's target -> its global name, once added
    plain = {cls for cls in _PLAIN if not fx_graph.is_opaque_value_type(cls)}
    names: dict[Node, str] = {}
    names_get = names.get  # a node's name once given (never empty)
    format_target = fx_graph._format_target
    magic_methods = fx_graph.magic_methods
    inplace_methods = fx_graph.inplace_methods

    def qualified_name(obj: Any) -> str:
        found = qualified_names.get(id(obj))
        if found is None or found[0] is not obj:
            found = qualified_names[id(obj)] = (obj, fx_graph._get_qualified_name(obj))
        return found[1]

    def is_from_torch(obj: Any) -> bool:
        found = from_torch.get(id(obj))
        if found is None or found[0] is not obj:
            found = from_torch[id(obj)] = (obj, fx_graph._is_from_torch(obj))
        return found[1]

    def add_global(name_hint: str, obj: Any) -> str:
        if is_from_torch(obj) and obj != torch.device:
            return qualified_name(obj)
        global_name = create_name(name_hint, obj)
        if global_name in globals_:
            if globals_[global_name] != obj:
                raise AssertionError(f"Global name {global_name} already assigned to different object")
            return global_name
        globals_[global_name] = obj
        return global_name

    def name_of(node: Node) -> str:  # repr(node) under torch's override_node_repr
        name = names.get(node)
        if name is None:
            name = names[node] = create_name(node.name, node)
        return name

    def call_global(target: Any) -> str:  # add_global of a call's target answers the same again
        found = call_globals.get(id(target))
        if found is None or found[0] is not target:
            found = call_globals[id(target)] = (target, add_global(qualified_name(target), target))
        return found[1]

    def get_repr(arg: Any) -> str:  # _gen_python_code's _get_repr, colours off
        cls = type(arg)
        if cls is Node:
            return names_get(arg) or name_of(arg)
        if cls in plain:
            return repr(arg)
        if isinstance(arg, Node):
            return name_of(arg)
        if isinstance(arg, tuple) and hasattr(arg, "_fields"):
            return f"{add_global(qualified_name(cls), cls)}{tuple(arg)!r}"
        if isinstance(arg, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            return add_global(qualified_name(arg), arg)
        if isinstance(arg, enum.Enum):
            return f"{add_global(cls.__name__, cls)}.{arg.name}"
        if isinstance(arg, torch.Tensor):
            dtype = str(arg.dtype).split(".")[-1]
            return f"torch.Tensor(size={list(arg.size())}, dtype={dtype})"
        if isinstance(arg, tuple):
            if len(arg) == 1:
                return f"({get_repr(arg[0])},)"
            return "(" + ", ".join([get_repr(a) for a in arg]) + ")"
        if isinstance(arg, list):
            return "[" + ", ".join([get_repr(a) for a in arg]) + "]"
        if isinstance(arg, slice):
            return f"slice({get_repr(arg.start)}, {get_repr(arg.stop)}, {get_repr(arg.step)})"
        if cls in _DICTS and all(
            type(k) in plain and (type(v) in plain or type(v) is Node) for k, v in arg.items()
        ):
            # torch prints it with ``repr``: its nodes through their temporary repr functions
            return "{" + ", ".join([f"{k!r}: {get_repr(v)}" for k, v in arg.items()]) + "}"
        # opaque values, other containers and objects: their repr may print nodes through torch's
        # temporary repr functions, which only torch's path installs
        raise _Unknown

    def format_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        # get_repr, its commonest cases inline: a node already named, a plain constant
        res = [
            (names_get(a) or get_repr(a)) if type(a) is Node else repr(a) if type(a) in plain else get_repr(a)
            for a in args
        ]
        if kwargs:
            res.extend([f"{k} = {get_repr(v)}" for k, v in kwargs.items()])
        return ", ".join(res)

    for name, (_, obj) in fx_graph._custom_builtins.items():
        add_global(name, obj)

    # each value's last use, found walking backwards: where torch frees it (``;  x = None``)
    last_uses: dict[Node, list[Node]] = {}
    seen: set[Node] = set()
    for node in reversed(nodes):
        for used in node._input_nodes:
            if used not in seen:
                seen.add(used)
                last_uses.setdefault(node, []).append(used)

    free_vars: list[str] = []
    lines: list[str] = []  # the body, a statement per line, not indented
    line_nodes: list[int | None] = []  # the index of the node each line is of
    for index, node in enumerate(nodes):
        op = node.op
        target: Any = node.target
        if op == "placeholder":
            default = "" if not node.args else f" = {get_repr(node.args[0])}"
            free_vars.append(f"{target}{default}")
            raw_name = target.replace("*", "")
            if raw_name != name_of(node):
                lines.append(f"{name_of(node)} = {raw_name}")
                line_nodes.append(index)
            continue
        if op == "output":
            lines.append(codegen.generate_output(node.args[0], repr_fn=get_repr))
            line_nodes.append(index)
            break
        if op == "call_function":
            operator_name = target.__name__ if getattr(target, "__module__", "") == "_operator" else None
            if operator_name in magic_methods:
                lhs = name_of(node)  # named before its operands, as torch does
                text = f"{lhs} = {magic_methods[operator_name].format(*[get_repr(a) for a in node.args])}"
            elif operator_name in inplace_methods:
                return None
            else:
                global_name = call_global(target)
                args = node.args
                if (
                    global_name == "getattr"
                    and isinstance(args, tuple)
                    and isinstance(args[1], str)
                    and args[1].isidentifier()
                    and len(args) == 2
                ):
                    text = f"{name_of(node)} = {format_target(get_repr(args[0]), args[1])}"
                else:
                    text = f"{name_of(node)} = {global_name}({format_args(args, node.kwargs)})"
        elif op == "get_attr":
            text = f"{name_of(node)} = {format_target(root_module, target)}"
        elif op == "call_module":
            module = format_target(root_module, target)
            text = f"{name_of(node)} = {module}({format_args(node.args, node.kwargs)})"
        elif op == "call_method":
            lhs = name_of(node)
            receiver = format_target(get_repr(node.args[0]), target)
            text = f"{lhs} = {receiver}({format_args(node.args[1:], node.kwargs)})"
        else:
            return None
        freed = last_uses.get(node)
        if not node.users:  # kept for a side effect: its value is freed at once
            freed = [*freed, node] if freed else [node]
        if freed:
            text = f"{text};  {' = '.join([name_of(n) for n in freed])} = None"
        lines.append(text)
        line_nodes.append(index)
    else:
        return None

    body = "\n".join(lines)
    if body.count("\n") != len(lines) - 1:  # a statement over several lines: torch maps them
        return None
    for name, value in codegen.additional_globals():
        add_global(name, value)
    prologue = codegen.gen_fn_def(free_vars, "")
    first = prologue.count("\n") + 1
    line_nodes.append(line_nodes[-1])  # torch's body ends with a newline: an empty last line
    lineno_map = {first + i: n for i, n in enumerate(line_nodes)}
    code = "    " + body.replace("\n", "\n    ") + "\n    "
    return fx_graph.PythonCode(
        f"\n\n\n{prologue}\n{code}", globals_, _lineno_map=lineno_map, _prologue_start=4
    )


def bound_to(graph: Graph) -> Callable[..., Any]:
    """``graph.python_code`` answering from :func:`python_code` where it can, torch's otherwise."""
    torch_python_code = type(graph).python_code

    def generate(root_module: str, **options: Any) -> Any:
        code = python_code(graph, root_module, **options)
        return code if code is not None else torch_python_code(graph, root_module, **options)

    return generate
