"""Weight sites: the quantized constant weights the algorithms choose for, found on the prepared graph.

Shared by both phases that meet a site: prepare taps each site's layer input for the collectors
(:mod:`_quantplug.algorithms.taps`), convert chooses each site's weight
(:mod:`_quantplug.algorithms.weight_choice`), both from :func:`weight_sites` on the same graph,
so they agree on every site, its layer and its bias.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from _quantplug.algorithms.experts import ExpertsLayer, experts_forward, experts_forward_in_out, experts_layer
from _quantplug.algorithms.spec import WeightSite
from _quantplug.annotation.spec_view import SpecKind, spec_kind
from _quantplug.graph.attrs import behind_parked, fetch_attr
from _quantplug.graph.op_names import LAYER_OPS
from _quantplug.graph.recurrent import RecurrentLayout, RecurrentRole, recurrent_layout
from _quantplug.meta import FOLDED_FROM


def _layer_call(gm: GraphModule, node: Node) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``f(x, w)`` re-running ``node`` with input ``x`` and weight ``w`` (other arguments constants)."""
    if str(node.target) not in LAYER_OPS or len(node.args) < 2:
        return None
    rest: list[Any] = []
    for arg in map(behind_parked, node.args[2:]):
        if isinstance(arg, Node):
            if arg.op != "get_attr":
                return None
            rest.append(fetch_attr(gm, str(arg.target)))
        else:
            rest.append(arg)
    if any(isinstance(v, Node) for v in node.kwargs.values()):
        return None
    target = node.target
    kwargs = dict(node.kwargs)

    def call(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return target(x, w, *rest, **kwargs)  # type: ignore[operator]

    return call


def _weight_call(
    gm: GraphModule, node: Node, weight: Node
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``node`` as ``f(x, w)`` when it multiplies ``weight`` as a layer's weight (its second
    argument), else None (an embedding's lookup, an operand of a plain product...)."""
    weight_index = next((i for i, a in enumerate(node.args) if behind_parked(a) is weight), None)
    return _layer_call(gm, node) if weight_index == 1 else None


def _same_layer(a: Node, b: Node) -> bool:
    """Whether ``a`` and ``b`` apply their (shared) weight as one layer: the same op with the same
    arguments after the input (the same bias node, stride, padding...)."""
    rest_a, rest_b = [behind_parked(x) for x in a.args[2:]], [behind_parked(x) for x in b.args[2:]]
    return (
        a.target == b.target
        and len(rest_a) == len(rest_b)
        and all(
            x is y if isinstance(x, Node) or isinstance(y, Node) else x == y for x, y in zip(rest_a, rest_b)
        )
        and a.kwargs == b.kwargs
    )


def _constant(gm: GraphModule, node: Any) -> tuple[str | None, torch.Tensor | None]:
    node = behind_parked(node)
    if isinstance(node, Node) and node.op == "get_attr":
        return str(node.target), fetch_attr(gm, str(node.target))
    return None, None


def _bias_of(gm: GraphModule, node: Node) -> tuple[str | None, torch.Tensor | None]:
    if str(node.target) not in LAYER_OPS or len(node.args) < 3:
        return None, None
    return _constant(gm, node.args[2])


@dataclass(frozen=True)
class RecurrentWeight:
    """A recurrent op's ``w_ih``/``w_hh`` as a linear layer over rows the op computes inside."""

    layout: RecurrentLayout
    role: RecurrentRole
    bias_target: str | None
    bias: torch.Tensor | None

    def call(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def _recurrent_weight(gm: GraphModule, node: Node, weight: Node) -> RecurrentWeight | None:
    """``weight`` as a linear layer of the recurrent op ``node`` (its ``w_ih``/``w_hh``), else None."""
    layout = recurrent_layout(node)
    if layout is None:
        return None
    params = [behind_parked(p) for p in node.args[2]]  # type: ignore[union-attr]
    index = next((i for i, p in enumerate(params) if p is weight), None)
    role = None if index is None else layout.role(index)
    if role is None:
        return None
    bias_index = layout.bias_index(role)
    bias_target, bias = (None, None) if bias_index is None else _constant(gm, params[bias_index])
    return RecurrentWeight(layout, role, bias_target, None if bias is None else bias.detach())


@dataclass(frozen=True)
class SiteRef:
    """A weight site and where it sits in the graph (what the taps and the choice need beyond it)."""

    site: WeightSite
    weight_node: str
    bias_target: str | None
    #: set for a recurrent op's weight: the tap computes its rows from the op's arguments
    recurrent: RecurrentWeight | None = None
    #: set for a mixture-of-experts weight: the tap packs each expert's rows
    experts: ExpertsLayer | None = None


def weight_sites(gm: GraphModule, state: Any) -> list[SiteRef]:
    """Every quantized constant weight (a plain-spec constant group, tensor of 2+ dims) and its op.

    Works on keys and specs only, so any backend's annotations (or a foreign quantizer's) yield
    the same sites. A weight consumed by several ops is one site: the first consumer (by node
    name) that multiplies it as a layer's weight, else its first consumer; the other consumers
    applying it as the same layer (an unrolled recurrence's steps) are its ``tied`` nodes, whose
    inputs the collectors see too. A language model's
    tied embedding and head is its head's layer, whose inputs the algorithms can measure: by
    name the lookup came first, and GPTQ, AdaRound and SeqMSE chose nothing for the weight that
    writes the logits (GPT-2 at reference weight_only_int4: +0.00 dB; +0.66 measured at the head).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    folded: dict[str, str] = gm.meta.get(FOLDED_FROM, {})
    result: list[SiteRef] = []
    for group in state.groups:
        if not group.constant or spec_kind(group.spec) is not SpecKind.PLAIN:
            continue
        edges = sorted(k for k in group.keys if isinstance(k, tuple))
        producers = sorted({k[0] for k in edges})
        for producer in producers:
            value = fetch_attr(gm, str(nodes[producer].target))
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or not value.is_floating_point():
                continue
            consumers = [nodes[c] for p, c in edges if p == producer]
            calls = ((c, _weight_call(gm, c, nodes[producer])) for c in consumers)
            layers = [(c, f) for c, f in calls if f is not None]
            node, call = layers[0] if layers else (consumers[0], None)
            tied = tuple(c.name for c, _ in layers[1:] if _same_layer(c, node))
            bias_target, bias = _bias_of(gm, node) if call is not None else (None, None)
            recurrent, experts = None, None
            if call is None:
                cells = ((c, _recurrent_weight(gm, c, nodes[producer])) for c in consumers)
                node, recurrent = next(((c, r) for c, r in cells if r is not None), (node, None))
                if recurrent is not None:
                    call, bias_target, bias = recurrent.call, recurrent.bias_target, recurrent.bias
            if call is None:
                gathers = (experts_layer(c, nodes[producer]) for c in consumers)
                experts = next((e for e in gathers if e is not None), None)
                if experts is not None:  # its layer: the gather, then the product reading it
                    node, tied = nodes[experts.gather], (experts.product,)
                    call = experts_forward_in_out if experts.in_out else experts_forward
            target = str(nodes[producer].target)
            others = tuple(str(nodes[p].target) for p in producers if p != producer)
            site = WeightSite(
                name=target,
                node=node.name,
                op=str(node.target),
                weight=value.detach(),
                bias=None if bias is None else bias.detach(),
                group=group.gid,
                shared_with=others,
                input_index=0 if call is not None and recurrent is None and experts is None else None,
                folded_from=folded.get(target),
                tied=tied,
                in_out=experts is not None and experts.in_out,
                _call=call,
            )
            result.append(SiteRef(site, producer, bias_target, recurrent, experts))
    return result
