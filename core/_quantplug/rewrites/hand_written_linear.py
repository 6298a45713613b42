"""``x @ W.T (+ b)`` written by hand, made the ``linear`` it is.

Falcon's ``FalconLinear`` (and any model that keeps a weight ``[out, in]`` and multiplies by its
transpose) exports as ``matmul(x, numpy_T(W))`` with the bias, if any, added after. No backend
rule sees a weight there: the second operand is a computed tensor, not a parameter. The reference
backend quantized it on the activation grid (one scale per tensor) at int8 and left it float at
weight-only int4, without a word, so the layers a user picked int4 for shipped in float; and no
weight algorithm (GPTQ, AdaRound, SeqMSE...) took those layers for layers.

:func:`linear_from_matmul` rewrites the product (and a bias add that only it feeds) as
``linear(x, W, b)`` reading the same parameter: the same function, in the form every backend's
linear rule and every weight algorithm knows. No parameter is made or copied, so it runs in every
flow, QAT included (training keeps updating the one weight).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

_PRODUCTS = (aten.matmul.default, aten.mm.default)


def _value(node: Any) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _is_transpose(node: Node) -> bool:
    """Whether ``node`` swaps the two dimensions of a 2-D tensor (every spelling export keeps)."""
    if node.op != "call_function":
        return False
    if node.target in (aten.t.default, aten.numpy_T.default):
        return True
    dims: Any = node.args[1:3] if node.target == aten.transpose.int else node.args[1]
    if node.target == aten.permute.default:  # a 2-D tensor: -1 is dim 1, -2 is dim 0
        return [int(d) % 2 for d in dims] == [1, 0]
    return node.target == aten.transpose.int and sorted(int(d) % 2 for d in dims) == [0, 1]


def _weight(product: Node) -> Node | None:
    """``W`` when ``product`` is ``x @ W.T`` with ``W`` a 2-D float constant of the module."""
    if product.target not in _PRODUCTS or len(product.args) != 2:
        return None
    operand = product.args[1]
    if not isinstance(operand, Node) or not _is_transpose(operand):
        return None
    weight = operand.args[0]
    value = _value(weight)
    if not isinstance(weight, Node) or weight.op != "get_attr" or value is None:
        return None
    x = _value(product.args[0])
    if value.dim() != 2 or not value.is_floating_point() or x is None or x.dtype != value.dtype:
        return None
    return weight


def bias_add(product: Node, features: int, dtype: torch.dtype) -> tuple[Node, Node] | None:
    """``(add, b)`` when the product's one user is ``add(product, b)`` (either order, ``alpha``
    1) with ``b`` a 1-D constant of one value per output feature (``features`` of them) and of
    the weight's ``dtype``: a bias a ``linear`` can take."""
    if len(product.users) != 1:
        return None
    add = next(iter(product.users))
    if add.op != "call_function" or add.target != aten.add.Tensor or add.kwargs.get("alpha", 1) != 1:
        return None
    if len(add.args) != 2 or add.args[0] is add.args[1]:
        return None
    bias = add.args[1] if add.args[0] is product else add.args[0]
    value = _value(bias)
    if not isinstance(bias, Node) or bias.op != "get_attr" or value is None:
        return None
    if tuple(value.shape) != (features,) or value.dtype != dtype:
        return None
    return add, bias  # one value per feature broadcasts over the product: the same shape


def fold_into_linear(gm: GraphModule, product: Node, x: Node, weight: Node, value: torch.Tensor) -> None:
    """Replace ``product`` (``x`` times the weight ``value`` ``[out, in]`` that ``weight`` reads),
    and a bias add only it feeds (:func:`bias_add`), by one ``linear(x, weight[, b])``, which keeps
    the metadata (debug handle, value) of the node whose value it computes."""
    folded = bias_add(product, value.shape[0], value.dtype)
    replaced, args = (product, (x, weight)) if folded is None else (folded[0], (x, weight, folded[1]))
    with gm.graph.inserting_before(replaced):
        linear = gm.graph.call_function(aten.linear.default, args)
    linear.meta.update(replaced.meta)
    replaced.replace_all_uses_with(linear)
    gm.graph.erase_node(replaced)
    if folded is not None:
        gm.graph.erase_node(product)


def linear_from_matmul(gm: GraphModule) -> int:
    """Rewrite every ``matmul``/``mm(x, W.T)`` (``W`` a 2-D float constant) as ``linear(x, W)``,
    folding a bias add the product alone feeds into ``linear(x, W, b)``; returns how many were
    rewritten. The graph is edited in place."""
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        weight = _weight(node)
        if weight is None:
            continue
        fold_into_linear(gm, node, node.args[0], weight, weight.meta["val"])  # _weight read it
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count
