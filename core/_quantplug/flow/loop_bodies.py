"""The loop bodies of higher-order ops, quantized as programs of their own.

``torch.export`` keeps ``scan`` and ``while_loop`` as one node each, whose body is a GraphModule
of its own (an attribute of the program, read by a ``get_attr`` node): the ops of a loop body are
not nodes of the program's graph, so annotation never reaches them. torchao's ``prepare_pt2e``
prepares the combine function of every ``scan`` and the body of every ``while_loop`` with the
same quantizer as the program, and ``convert_pt2e`` converts them likewise; quantplug does the
same (the loop condition of a ``while_loop`` and the branches of a ``cond`` stay float there).
Each body is prepared from a copy, so the caller's program, which may share its body modules
with other copies of the program (``ExportedProgram.module()`` does), is never changed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from _quantplug.graph.attrs import fetch_attr, put_attr

#: the higher-order ops whose body is quantized, and the position of that body among their
#: arguments (torchao's choice: a scan's combine function, a while loop's body)
LOOP_BODY_ARGUMENT = {
    torch.ops.higher_order.scan: 0,
    torch.ops.higher_order.while_loop: 1,
}


def loop_bodies(gm: GraphModule) -> list[str]:
    """The attribute paths of ``gm``'s loop bodies (each once, in graph order)."""
    found: dict[str, None] = {}
    for node in gm.graph.nodes:
        index = LOOP_BODY_ARGUMENT.get(node.target) if node.op == "call_function" else None
        if index is None or len(node.args) <= index:
            continue
        body = node.args[index]
        if isinstance(body, Node) and body.op == "get_attr":
            found[str(body.target)] = None
    return list(found)


def replace_loop_bodies(
    source: GraphModule, target: GraphModule, step: Callable[[GraphModule], GraphModule]
) -> None:
    """Put ``step(body)`` on ``target`` for every loop body of ``source`` (same attribute path):
    ``step`` is prepare (``source`` is ``target``, the prepared program) or convert (``source``
    the prepared program, ``target`` the converted one)."""
    for path in loop_bodies(source):
        body = fetch_attr(source, path)
        if isinstance(body, GraphModule):
            put_attr(target, path, step(body))
