"""Tensors a program writes in place, which no quantize may be put on.

``torch.export`` keeps in-place ops on tensors the program creates itself: torchvision's Swin
builds its shifted-window mask as ``m = x.new_zeros(...)`` then ``m[a:b, c:d] = k`` for each
window (``slice`` views written by ``fill_``). A quantize/dequantize on ``m`` or on one of its
views makes a new tensor: the ``fill_`` then writes into the copy, and every reader of ``m`` sees
zeros -- the converted program silently computes another function (and the Q/DQ of the views
vanish from the ONNX model, which the exporter computes without them). Such tensors stay float:
the base tensor, every view of it, and the in-place ops themselves. Readers of the result quantize
it on their own input edge, after the writes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node


def _schema(node: Node) -> Any:
    target = node.target
    return target._schema if isinstance(target, torch._ops.OpOverload) else None


def writes_in_place(node: Node) -> bool:
    """An op that writes one of its arguments (``relu_``, ``add_``, ``fill_``...)."""
    schema = _schema(node)
    return node.op == "call_function" and schema is not None and schema.is_mutable


#: ops that write arguments their schema does not mark as written, when a flag argument is
#: true: batch norm in training mode updates its running statistics (positions 3, 4) in place
_IMPLICIT_WRITES: dict[str, tuple[tuple[int, ...], int]] = {
    "aten::batch_norm": ((3, 4), 5),
    "aten::instance_norm": ((3, 4), 5),
    "aten::_batch_norm_impl_index": ((3, 4), 5),
}
_NO_FLAG = 1 << 30
#: id(target) -> (target, (the (position, name) its schema marks as written, (implicit positions,
#: flag position))); graph copies ask this of every node, so each op's schema is read once. Keyed by
#: identity: an ``OpOverload`` hashes in Python, and prepare asks this over a thousand times (the
#: entry holds the target, so its id is not reused meanwhile)
_written_cache: dict[int, tuple[Any, tuple[tuple[tuple[int, str], ...], tuple[tuple[int, ...], int]]]] = {}


def _written_positions(target: Any) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[int, ...], int]]:
    entry = _written_cache.get(id(target))
    if entry is not None and entry[0] is target:
        return entry[1]
    schema = getattr(target, "_schema", None)
    if schema is None:
        found: tuple[tuple[tuple[int, str], ...], tuple[tuple[int, ...], int]] = ((), ((), _NO_FLAG))
    else:
        marked = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        found = (marked, _IMPLICIT_WRITES.get(schema.name, ((), _NO_FLAG)))
    _written_cache[id(target)] = (target, found)
    return found


def written_args(node: Node) -> list[Node]:
    """The node arguments an op writes: those its schema marks ``Tensor(a!)``, and batch norm's
    running statistics in training mode, which it updates without saying so."""
    if node.op != "call_function":
        return []
    marked, (implicit, flag) = _written_positions(node.target)
    written = []
    for i, name in marked:
        value = node.args[i] if i < len(node.args) else node.kwargs.get(name)
        if isinstance(value, Node):
            written.append(value)
    if flag < len(node.args) and node.args[flag] is True:
        written += [a for i in implicit if i < len(node.args) and isinstance(a := node.args[i], Node)]
    return written


def is_view(node: Node) -> bool:
    """An op whose output aliases its first argument (``Tensor(a)`` returned: slice, view...)."""
    schema = _schema(node)
    if node.op != "call_function" or schema is None or not schema.returns or schema.is_mutable:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write


def view_base(node: Node) -> Node:
    """The tensor ``node`` is a view of (through any chain of views), or ``node`` itself."""
    while is_view(node) and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def _views_of(base: Node) -> list[Node]:
    found, stack = {base: None}, [base]  # a dict: ordered, and a set for the membership tests
    while stack:
        for user in stack.pop().users:
            if is_view(user) and user.args and user.args[0] in found and user not in found:
                found[user] = None
                stack.append(user)
    return list(found)


def own_aliases(written: Node) -> list[Node] | None:
    """The tensor ``written`` belongs to and every view of it, when the program makes that tensor
    itself; None for placeholders and constants (``torch.export`` writes those back itself)."""
    base = view_base(written)
    return _views_of(base) if base.op == "call_function" else None


def mutated_aliases(graph: Graph) -> dict[Node, str]:
    """Node -> why it stays float: the in-place ops on tensors the program makes itself whose
    write is read through another name afterwards, the tensors they write and every view of
    those. An in-place op whose tensor nobody else reads later (``relu_(conv(x))``, torchvision's
    ``ReLU(inplace=True)``: readers take its return value) is harmless and left to the rules;
    placeholders, which ``torch.export`` writes back as mutated buffers, are left to it."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    reasons: dict[Node, str] = {}
    for node in graph.nodes:
        for written in written_args(node):
            aliases = own_aliases(written)
            if aliases is None or not read_after(node, aliases, order):
                continue
            why = (
                f"written in place by {node.target} (node {node.name!r}): a quantize on it would copy "
                "the tensor and the write would not reach its readers"
            )
            reasons.setdefault(node, why)
            for alias in aliases:
                reasons.setdefault(alias, why)
    return reasons


def writes_an_input(graph: Graph) -> bool:
    """Whether the program writes one of its own inputs in place (``x.add_(1)`` in ``forward``),
    directly or through a view, an observer or a quantize (which a prepared program puts on it).

    Calling such a program changes the caller's tensors: quantplug, which runs the float, prepared
    and converted programs on the same calibration batches several times (calibration, the
    algorithm guard, ``compare``), must then give each run copies (:func:`private_inputs`), or the
    second run sees the first one's writes (``compare`` measured 3.5 dB for a program at 40.3).
    """
    for node in graph.nodes:
        for written in written_args(node):
            base = written
            while base.op != "placeholder" and base.args and isinstance(base.args[0], Node):
                if not (is_view(base) or base.op == "call_module" or _is_qdq(base)):
                    break
                base = base.args[0]
            if base.op == "placeholder":
                return True
    return False


def _is_qdq(node: Node) -> bool:
    name = str(getattr(node.target, "__name__", node.target))
    return node.op == "call_function" and name.startswith(("quantize_per", "dequantize_per"))


def private_inputs(batch: Any) -> Any:
    """``batch`` with every tensor in it replaced by a copy (see :func:`writes_an_input`)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(torch.Tensor, torch.clone, batch)


def read_after(write: Node, aliases: list[Node], order: dict[Node, int]) -> bool:
    """Some node other than the write reads one of the aliases after the write."""
    members = set(aliases)
    return any(
        user is not write and user not in members and order[user] > order[write]
        for alias in aliases
        for user in alias.users
    )


def buffer_writes(graph: Graph) -> set[tuple[str, str]]:
    """(tensor, op) name pairs: an op writing one of its arguments in place where that argument is
    a buffer of the module or a view of one (``buf.index_put_(...)``, ``buf.select(0, 0).add_(x)``).

    A quantize on such an edge would hand the op a copy: the write would never reach the buffer,
    and convert would store the buffer's first value as integers for good. torchao's prepare_pt2e
    inserts no observer there either; the op's other inputs and its output are quantized as
    annotated, and ``torch.export`` of the converted program still sees the buffer mutated.
    """
    return {
        (written.name, node.name)
        for node in graph.nodes
        for written in written_args(node)
        if view_base(written).op == "get_attr"
    }


def _returns_written(node: Node) -> bool:
    """An in-place op whose result is the tensor it writes (``add_``, ``index_put_``, ``copy_``)."""
    schema = _schema(node)
    if not writes_in_place(node) or schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and info.is_write


def buffer_aliases(graph: Graph) -> dict[Node, str]:
    """Node -> buffer name: every buffer the program writes in place, its views, and the in-place
    ops whose result is the buffer (``calls.add_(1)`` returns ``calls``)."""
    state: dict[Node, str] = {}
    for node in graph.nodes:
        for target in written_args(node):
            base = view_base(target)
            if base.op == "get_attr":
                state.setdefault(base, str(base.target))
    stack = list(state)
    while stack:
        alias = stack.pop()
        for user in alias.users:
            if user in state or not user.args or user.args[0] is not alias:
                continue
            if is_view(user) or _returns_written(user):
                state[user] = state[alias]
                stack.append(user)
    return state


def buffer_state(graph: Graph) -> dict[Node, str]:
    """Node -> why it stays float: the ops that read a buffer the program writes in place (a
    counter ``calls.add_(1)``, a running state ``state.copy_(...)``, an accumulator), before or
    after the write, and the views and in-place results that are the buffer itself.

    Such a buffer is state: not a constant (convert must not freeze it) and not an activation
    either, because calibration sees only its first values. A quantize on its reads takes the
    range of those first calls, and the converted program then clamps every later value (a
    counter read stops counting at the number of calibration batches). Its readers therefore get
    no spec on their inputs, nor on their output, which follows the state as well. Ops that only
    write it (batch norm's running statistics in training) are :func:`buffer_writes`.
    """
    aliases = buffer_aliases(graph)
    reasons: dict[Node, str] = {}
    for alias, buffer in aliases.items():
        if alias.op == "call_function":
            reasons.setdefault(
                alias,
                f"is buffer {buffer!r} (or a view of it), which the program writes in place: state "
                "whose later values calibration never sees, so it stays float",
            )
        for user in alias.users:
            if user.op != "call_function" or user in aliases or alias in written_args(user):
                continue
            reasons.setdefault(
                user,
                f"reads buffer {buffer!r}, which the program writes in place ({alias.name!r}): state "
                "whose later values calibration never sees, so no quantize may clamp it to the "
                "calibrated range",
            )
    return reasons


def buffer_state_keys(graph: Graph) -> set[str | tuple[str, str]]:
    """The quantization keys :func:`buffer_state` keeps float, for quantizers that annotated them
    anyway (torchao's XNNPACKQuantizer quantizes ``calls.add_(1)`` and ``x + calls`` as any add):
    the edges from the buffer into its readers, and the outputs of the readers and of the
    in-place results that are the buffer. Other inputs of those nodes (the value an
    ``index_put_`` writes) stay as annotated."""
    aliases = buffer_aliases(graph)
    keys: set[str | tuple[str, str]] = set()
    for node in buffer_state(graph):
        keys.add(node.name)
        keys.update((a.name, node.name) for a in node.all_input_nodes if a in aliases)
    return keys
