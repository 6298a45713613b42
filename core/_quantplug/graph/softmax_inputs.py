"""Which values of a graph reach a softmax as its scores, where an attention mask can be finite.

A softmax gives no weight to a score 1000 below its row's largest (``exp(-1000)`` is 0 even in
float64), so code that predates ``torch.finfo(dtype).min`` masks attention with -1e4 or -10000
(OpenAI GPT ``w * b + -1e4 * (1 - b)``, BigBird's ``attn_mask_penalty``, MarkupLM's and TAPAS'
extended masks). On a plain activation such a value is data, and the observers must keep it; on
the way into a softmax it is a mask, and a grid spanning it rounds every real score to one code
(the attention becomes a plain average). The observers take the lower threshold
(:data:`_quantplug.observers.nonfinite.SCORE_MASK_SENTINEL`) only for the values found here: a
softmax's input, and what reaches it through data movement, casts, scaling by a number, masking
(``masked_fill``, ``where``) and additions (an additive mask, a position bias).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten

#: op -> positions of the argument(s) that are the scores a softmax weighs
SOFTMAX_SCORES: dict[Any, tuple[int, ...]] = {
    aten.softmax.int: (0,),
    aten._softmax.default: (0,),
    aten._safe_softmax.default: (0,),
    aten.log_softmax.int: (0,),
    aten._log_softmax.default: (0,),
    aten.scaled_dot_product_attention.default: (3,),  # attn_mask: added to the scores
}
_SDPA_MASK_KWARG = "attn_mask"


def _movers() -> dict[Any, tuple[int, ...]]:
    """op -> positions whose values the output holds, moved, cast, shifted or scaled: a mask entry
    stays far below the scores through these."""
    first = (0,)
    table: dict[Any, tuple[int, ...]] = {
        op: first
        for op in (
            aten.view.default,
            aten._unsafe_view.default,
            aten.reshape.default,
            aten.permute.default,
            aten.transpose.int,
            aten.t.default,
            aten.contiguous.default,
            aten.clone.default,
            aten.alias.default,
            aten.expand.default,
            aten.unsqueeze.default,
            aten.squeeze.dim,
            aten.squeeze.dims,
            aten.squeeze.default,
            aten.flatten.using_ints,
            aten.slice.Tensor,
            aten.select.int,
            aten.to.dtype,
            aten._to_copy.default,
            aten.masked_fill.Scalar,
            aten.masked_fill.Tensor,
            aten.clamp.default,
            aten.clamp_min.default,
            aten.mul.Scalar,
            aten.div.Scalar,
            aten.sub.Scalar,
            aten.add.Scalar,
            aten.sub.Tensor,
        )
    }
    table[aten.add.Tensor] = (0, 1)
    table[aten.where.self] = (1, 2)
    table[aten.cat.default] = (0,)  # the list of tensors
    return table


_MOVERS = _movers()
#: tensor-by-tensor products and quotients pass the first factor on only when the other is a
#: number: a 0/1 multiplier (OpenAI GPT's ``w * b``) or a learned one is no mask carrier
_SCALERS = frozenset({aten.mul.Tensor, aten.div.Tensor})


def _arguments_at(node: Node, positions: tuple[int, ...]) -> list[Node]:
    found: list[Node] = []
    for i in positions:
        if i < len(node.args):
            arg = node.args[i]
            items = arg if isinstance(arg, list | tuple) else [arg]
            found.extend(a for a in items if isinstance(a, Node))
    return found


def _score_arguments(node: Node, scores: set[str]) -> list[Node]:
    """The arguments of ``node`` whose values become scores. ``scores``: the nodes found so far;
    ``node``'s users all come later in the graph, so whether ``node`` is one is settled."""
    target = node.target
    if target in SOFTMAX_SCORES:
        found = _arguments_at(node, SOFTMAX_SCORES[target])
        mask = node.kwargs.get(_SDPA_MASK_KWARG)
        return [*found, mask] if isinstance(mask, Node) else found
    if node.name not in scores:
        return []
    if target in _MOVERS:
        return _arguments_at(node, _MOVERS[target])
    if target in _SCALERS and len(node.args) > 1 and not isinstance(node.args[1], Node):
        return _arguments_at(node, (0,))
    return []


def score_values(graph: Graph) -> set[str]:
    """Names of the nodes whose output reaches a softmax as its scores (module docstring), in one
    pass from the outputs back."""
    scores: set[str] = set()
    for node in reversed(graph.nodes):
        if node.op == "call_function":
            scores.update(arg.name for arg in _score_arguments(node, scores))
    return scores
