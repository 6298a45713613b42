"""Projected LSTMs, decomposed into their arithmetic before the ONNX export.

torch's ONNX exporter translates ``aten.lstm.input`` into ONNX's ``LSTM`` op, which has no
projection: for an ``nn.LSTM(..., proj_size=P)`` it writes a ``Concat`` of the projected state
with the hidden size declared, and ONNX Runtime refuses to load the model ("Can't merge shape
info", the float model exported by ``torch.onnx.export`` alone fails the same way). An LSTM
without a projection is translated correctly and keeps its one ``LSTM`` node.

So each projected LSTM op is replaced, in lowering's own copy of the program, by torch's
decomposition of that op (``torch._decomp``: per step ``linear``, gates, cell update,
projection), traced on the op's own values, so that a dynamic batch stays dynamic. The program
computes the same (the decomposition is the op's reference arithmetic); the weights keep their
dequantize nodes and encodings, read by the decomposed products instead of the op.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.utils import _pytree as pytree

from _quantplug.errors import LoweringError
from _quantplug.graph.recurrent import recurrent_layout

aten = torch.ops.aten

#: node notes copied from the op onto every node of its decomposition (where it came from)
_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


def _projected(node: Node) -> bool:
    layout = recurrent_layout(node) if node.op == "call_function" else None
    return layout is not None and layout.lstm and layout.stride in (3, 5)


def decompose_projected_lstms(graph: Graph) -> int:
    """Replace every projected ``aten.lstm.input`` of ``graph`` by its decomposition; returns how
    many were replaced.

    Raises:
        LoweringError: an op's values are not recorded, or its decomposition cannot be traced
            (the message names the node).
    """
    ops = [n for n in graph.nodes if _projected(n)]
    for node in ops:
        _decompose(graph, node)
    return len(ops)


def _hint(size: Any) -> int:
    """A dimension's example value (a static one is its own)."""
    if isinstance(size, int):
        return size
    node = size.node
    return int(node.hint if node.hint is not None else node.shape_env.size_hint(node.expr))


def _decompose(graph: Graph, node: Node) -> None:
    from torch._decomp import decomposition_table
    from torch.fx.experimental.proxy_tensor import make_fx

    whole = [u.name for u in node.users if u.op != "call_function" or u.target is not operator.getitem]
    if whole:
        raise LoweringError(
            f"cannot decompose the projected LSTM {node.name!r} for the ONNX export: {whole[0]!r} "
            "reads its result as a whole"
        )
    leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
    inputs = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Node)]
    values = [leaves[i].meta.get("val") for i in inputs]
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise LoweringError(
            f"cannot decompose the projected LSTM {node.name!r} for the ONNX export: its inputs' values "
            "are not recorded (lower the program quantplug.convert returned)"
        )

    def op(*tensors: torch.Tensor) -> Any:
        flat = list(leaves)
        for i, tensor in zip(inputs, tensors):
            flat[i] = tensor
        args, kwargs = pytree.tree_unflatten(flat, spec)
        return aten.lstm.input(*args, **kwargs)

    dynamic = any(not isinstance(d, int) for v in values for d in v.shape)
    if dynamic:  # traced on hint-sized tensors with symbolic sizes: its sizes are read off its inputs
        values = [torch.zeros([_hint(d) for d in v.shape], dtype=v.dtype) for v in values]
    try:
        traced = make_fx(
            op,
            decomposition_table={aten.lstm.input: decomposition_table[aten.lstm.input]},
            tracing_mode="symbolic" if dynamic else "real",
        )(*values)
    except Exception as exc:  # tracing errors have no common type
        raise LoweringError(
            f"cannot decompose the projected LSTM {node.name!r} for the ONNX export "
            f"(torch's ONNX exporter mistranslates projected LSTMs): {exc}"
        ) from exc
    env: dict[Node, Any] = {}
    placeholders = iter(leaves[i] for i in inputs)
    meta = {k: node.meta[k] for k in _PROVENANCE if k in node.meta}
    outputs: Any = None
    with graph.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                outputs = pytree.tree_map(lambda a: env[a] if isinstance(a, Node) else a, n.args[0])
            elif n.op == "call_function":
                copied = graph.node_copy(n, lambda a: env[a])
                copied.meta = dict(meta)  # its value is computed with the program's others
                env[n] = copied
            else:  # a constant the decomposition made: lowering's copy has nowhere to keep it
                raise LoweringError(
                    f"cannot decompose the projected LSTM {node.name!r} for the ONNX export: its "
                    f"decomposition holds a {n.op} node {n.name!r}"
                )
    for user in list(node.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
