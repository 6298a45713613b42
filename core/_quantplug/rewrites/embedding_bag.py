"""Fixed-size embedding bags rewritten as an embedding and a reduction before annotation.

``nn.EmbeddingBag`` called on a 2-D ``[batch, bag]`` tensor of ids exports as
``embedding_bag(weight, ids.reshape(-1), arange(0, ids.numel(), bag), mode=...)``: every bag has
the same size. The ONNX exporter writes that op as a ``Loop`` over the bags whose quantized form
ONNX Runtime 1.32's constant folding crashes on (a segmentation fault of the user's process, in
the reference backend's lowering), no backend has a quantization rule for it (its table stays
float), and HTP has no loop. ``embedding(weight, ids)`` followed by ``sum``/``mean``/``amax`` over
the bag dimension computes the same bags with ops every backend quantizes (the table becomes an
integer weight) and exports without control flow. Bags given by explicit offsets are left alone.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from _quantplug.meta import kept_meta

aten = torch.ops.aten

_BAGS = (aten.embedding_bag.default, aten.embedding_bag.padding_idx, aten._embedding_bag.default)
#: embedding_bag's ``mode`` -> the reduction over the bag dimension
_REDUCTIONS = {0: aten.sum.dim_IntList, 1: aten.mean.dim, 2: aten.amax.default}


def _arg(node: Node, index: int, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else default


def fixed_bag_ids(node: Node) -> Node | None:
    """The ``[batch, bag]`` ids of a fixed-size bag op (indices ``ids.reshape(-1)``, offsets
    ``arange(0, n, bag)``, no per-sample weights, no last offset), else None."""
    indices, offsets = _arg(node, 1), _arg(node, 2)
    if _arg(node, 6) is not None or _arg(node, 7, False) or _arg(node, 8) not in (None, -1):
        return None
    if not (isinstance(indices, Node) and isinstance(offsets, Node)):
        return None
    if indices.target not in (aten.reshape.default, aten.view.default) or list(indices.args[1]) != [-1]:  # type: ignore[arg-type]
        return None
    ids = indices.args[0]
    shape: tuple[Any, ...] = tuple(
        getattr(ids.meta.get("val") if isinstance(ids, Node) else None, "shape", ())
    )
    if len(shape) != 2 or not isinstance(shape[1], int):
        return None
    if offsets.target != aten.arange.start_step or offsets.args[0] != 0 or offsets.args[2] != shape[1]:
        return None
    return ids if isinstance(ids, Node) else None


def _call(gm: GraphModule, anchor: Node, target: Any, *args: Any) -> Node:
    from torch._guards import detect_fake_mode

    vals = [a.meta.get("val") if isinstance(a, Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with gm.graph.inserting_before(anchor):
        node = gm.graph.call_function(target, tuple(args))
    node.meta.update(kept_meta(anchor))
    if mode is not None:
        with mode:
            node.meta["val"] = target(*vals)
    else:
        node.meta["val"] = target(*vals)
    return node


def rewrite_fixed_bags(gm: GraphModule) -> None:
    """Replace every fixed-size bag whose only output used is the bags themselves (see the
    module docstring); the graph is edited in place."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _BAGS:
            continue
        ids, reduction = fixed_bag_ids(node), _REDUCTIONS.get(int(_arg(node, 4, 0)))
        users = list(node.users)
        if ids is None or reduction is None or not all(u.target is operator.getitem for u in users):
            continue
        if any(u.args[1] != 0 and u.users for u in users):  # offsets/bag sizes are read
            continue
        rows = _call(gm, node, aten.embedding.default, node.args[0], ids)
        bags = _call(gm, node, reduction, rows, [1])
        for user in users:
            if user.args[1] == 0:
                user.replace_all_uses_with(bags)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
