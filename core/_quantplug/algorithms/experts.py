"""Mixture-of-experts weights as layers of the weight algorithms.

A mixture-of-experts layer keeps every expert's weights in one ``[experts, out, in]`` parameter
and multiplies each token by the slices of the experts its router chose: transformers'
``experts_implementation="batched_mm"`` exports it as ``bmm(W[ids], x)`` (Mixtral, Qwen2-MoE,
OLMoE, Jamba: ``x`` ``[rows, in, k]``), or, for weights stored ``[experts, in, out]``, as
``bmm(x, W[ids])`` (GPT-OSS, Aria: ``x`` ``[rows, k, in]``); ``ids`` names one expert per row.
No linear reads those parameters, so GPTQ, AdaRound and SeqMSE left them, most of such a model's weights, to
round-to-nearest whatever was asked.

As a layer, expert ``e`` is a linear ``[out, in]`` over the rows routed to it, so its Hessian is
``H_e = sum x x^T`` over those rows alone: the algorithms see the weight as the matrix
``[experts * out, in]`` whose row block ``e`` is expert ``e``, and a stack ``[experts, in, in]``
of Hessians, one per row block, as they see a grouped convolution
(:func:`~_quantplug.algorithms.weight_matrix.rows_times`).

A collector of such a layer is fed :func:`packed_rows`: ``[experts, R, in]``, each expert's rows
from the front and zero rows after (``R`` the most rows any expert got in that batch). Zero rows
add nothing to ``x x^T``. A weight stored ``[experts, in, out]`` is seen through its transpose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from _quantplug.errors import AlgorithmError
from _quantplug.graph.attrs import behind_parked

aten = torch.ops.aten

#: the op a mixture-of-experts weight site names (:attr:`WeightSite.op`): the gather of the
#: experts' slices, whose one user is the product
GATHER_OP = "aten.index.Tensor"


@dataclass(frozen=True)
class ExpertsLayer:
    """Where the program applies a stacked experts weight: the gather ``W[ids]``, the ``bmm``
    reading it, the node of the expert ids, how many experts the weight holds, and which
    argument of the product is the input (1: ``bmm(W[ids], x)``; 0: ``bmm(x, W[ids])``, the
    weight stored ``[experts, in, out]``)."""

    gather: str
    product: str
    ids: str
    experts: int
    input_index: int = 1

    @property
    def in_out(self) -> bool:
        """Whether the weight is stored ``[experts, in, out]``."""
        return self.input_index == 0


def experts_layer(node: Node, weight: Node) -> ExpertsLayer | None:
    """``node`` as the gather of a mixture-of-experts layer over ``weight``, else None: ``node`` is
    ``weight[ids]`` (one 1-D integer index on the experts' axis of a 3-D float weight) and its one
    user is ``bmm(node, x)`` or ``bmm(x, node)``, ``x`` of ``in``-wide rows (through the observer
    prepare puts between them where the backend quantizes the gathered rows)."""
    if (
        node.op != "call_function"
        or node.target is not aten.index.Tensor
        or behind_parked(node.args[0]) is not weight
    ):
        return None
    indices = node.args[1]
    if not isinstance(indices, (list, tuple)) or len(indices) != 1 or not isinstance(indices[0], Node):
        return None
    ids, w = indices[0].meta.get("val"), weight.meta.get("val")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point:
        return None
    if ids.dtype == torch.bool:  # a mask selects rows; it names no expert
        return None
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_floating_point() or len(node.users) != 1:
        return None
    gathered, product = node, next(iter(node.users))
    while product.op == "call_module" and product.args == (gathered,) and len(product.users) == 1:
        gathered, product = product, next(iter(product.users))  # prepare's observer on the gather
    if product.op != "call_function" or product.target is not aten.bmm.default or len(product.args) != 2:
        return None
    if gathered not in product.args or product.args[0] is product.args[1]:
        return None
    input_index = 1 if product.args[0] is gathered else 0
    x = product.args[input_index]
    value = x.meta.get("val") if isinstance(x, Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        return None
    width, inputs = (value.shape[1], w.shape[2]) if input_index == 1 else (value.shape[2], w.shape[1])
    if width != inputs:  # bmm(W[ids], x): x [rows, in, k]; bmm(x, W[ids]): x [rows, k, in]
        return None
    return ExpertsLayer(node.name, product.name, indices[0].name, int(w.shape[0]), input_index)


def routed_rows(
    x: torch.Tensor, ids: torch.Tensor, in_out: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows the product multiplies (``[rows * k, in]``) and the expert of each: ``x`` is
    ``[rows, in, k]`` in ``bmm(W[ids], x)``, ``[rows, k, in]`` in ``bmm(x, W[ids])`` (``in_out``)."""
    n = x.shape[0]
    if ids.numel() != n:
        raise AlgorithmError(
            f"a mixture-of-experts product read {n} input rows for {ids.numel()} expert ids; "
            "the program's gather and product disagree"
        )
    rows = x if in_out else x.transpose(1, 2)  # [rows, k, in]
    k = rows.shape[1]
    return rows.reshape(n * k, rows.shape[2]), ids.reshape(-1).repeat_interleave(k)


def packed_rows(rows: torch.Tensor, owner: torch.Tensor, experts: int) -> torch.Tensor:
    """``[experts, R, in]``: the rows of each expert, in their order, from the front of its slice,
    zero rows after. Each expert's rows stay together whatever the routing, so a collector
    summing ``x x^T`` per slice sums each expert's alone."""
    owner = owner.to(torch.int64)
    if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= experts):
        raise AlgorithmError(
            f"expert ids run from {int(owner.min())} to {int(owner.max())}, outside the weight's "
            f"{experts} experts"
        )
    counts = torch.bincount(owner, minlength=experts)
    order = torch.argsort(owner, stable=True)
    ranked = owner[order]
    position = torch.arange(ranked.numel()) - (torch.cumsum(counts, 0) - counts)[ranked]
    packed = rows.new_zeros(experts, int(counts.max()) if owner.numel() else 0, rows.shape[1])
    packed[ranked, position] = rows[order]
    return packed


def experts_forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The layer's output on packed rows ``[experts, R, in]``: ``[experts, R, out]``."""
    return x.to(weight.dtype) @ weight.transpose(1, 2)


def experts_forward_in_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`experts_forward` for a weight stored ``[experts, in, out]``."""
    return x.to(weight.dtype) @ weight
