"""Mixture-of-experts weights as layers of the weight algorithms.

A mixture-of-experts layer keeps every expert's weights in one ``[experts, out, in]`` parameter
and multiplies each token by the slices of the experts its router chose: transformers'
``experts_implementation="batched_mm"`` (Mixtral, Qwen2-MoE, OLMoE, Jamba) exports it as
``bmm(W[ids], x)``, ``ids`` one expert per row of ``x`` (``[rows, in, k]``). No linear reads
those parameters, so GPTQ, AdaRound and SeqMSE left them, most of such a model's weights, to
round-to-nearest whatever was asked.

As a layer, expert ``e`` is a linear ``[out, in]`` over the rows routed to it, so its Hessian is
``H_e = sum x x^T`` over those rows alone: the algorithms see the weight as the matrix
``[experts * out, in]`` whose row block ``e`` is expert ``e``, and a stack ``[experts, in, in]``
of Hessians, one per row block, as they see a grouped convolution
(:func:`~quantplug.algorithms.weight_matrix.rows_times`).

A collector of such a layer is fed :func:`packed_rows`: ``[experts, R, in]``, each expert's rows
from the front and zero rows after (``R`` the most rows any expert got in that batch). Zero rows
add nothing to ``x x^T``. A product written ``bmm(x, W[ids])`` (weights ``[experts, in, out]``)
is not taken: it keeps the codes it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from quantplug.errors import AlgorithmError

aten = torch.ops.aten

#: the op a mixture-of-experts weight site names (:attr:`WeightSite.op`): the gather of the
#: experts' slices, whose one user is the product
GATHER_OP = "aten.index.Tensor"


@dataclass(frozen=True)
class ExpertsLayer:
    """Where the program applies a stacked experts weight: the gather ``W[ids]``, the ``bmm``
    reading it, the node of the expert ids, and how many experts the weight holds."""

    gather: str
    product: str
    ids: str
    experts: int


def experts_layer(node: Node, weight: Node) -> ExpertsLayer | None:
    """``node`` as the gather of a mixture-of-experts layer over ``weight``, else None: ``node`` is
    ``weight[ids]`` (one 1-D integer index on the experts' axis of a 3-D float weight) and its one
    user is ``bmm(node, x)``, ``x`` of ``in`` rows (through the observer prepare puts between them
    where the backend quantizes the gathered rows)."""
    if node.op != "call_function" or node.target is not aten.index.Tensor or node.args[0] is not weight:
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
    if (
        product.op != "call_function"
        or product.target is not aten.bmm.default
        or product.args[0] is not gathered
    ):
        return None
    x = product.args[1].meta.get("val") if isinstance(product.args[1], Node) else None
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != w.shape[2]:
        return None
    return ExpertsLayer(node.name, product.name, indices[0].name, int(w.shape[0]))


def routed_rows(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``bmm(W[ids], x)`` multiplies (``[rows * k, in]``) and the expert of each."""
    n, inputs, k = x.shape
    if ids.numel() != n:
        raise AlgorithmError(
            f"a mixture-of-experts product read {n} input rows for {ids.numel()} expert ids; "
            "the program's gather and product disagree"
        )
    return x.transpose(1, 2).reshape(n * k, inputs), ids.reshape(-1).repeat_interleave(k)


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
