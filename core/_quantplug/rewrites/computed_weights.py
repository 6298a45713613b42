"""Layer weights computed from parameters, made parameters of their own before the weight algorithms.

``nn.MultiheadAttention`` with a query other than its key and value (cross-attention, every
transformer decoder's second attention) exports its input projection as
``split_with_sizes(in_proj_weight, [E, 2E])`` and feeds the pieces to two ``linear`` ops; other
models feed a transposed or reshaped parameter. convert() already stores such constants as
integers (:mod:`_quantplug.graph.constants`), but the weight algorithms (AdaRound, SeqMSE, GPTQ,
bias correction, CLE) choose codes per *parameter* a layer reads: a computed weight is no
parameter, so those layers kept round-to-nearest, silently.

:func:`materialize_computed_weights` gives every such weight (and bias) of a conv/linear layer its
own parameter holding the computed value. The program computes the same function; the original
parameter stays for its other readers and is dropped from the graph when none is left. It runs
on prepare's private copy when algorithms are given, never in QAT (training must keep updating
the one parameter the pieces come from).

:func:`linear_from_addmm` does the same for transformers' ``Conv1D`` (GPT-2, OpenAI GPT, their
kin): ``addmm(bias, x, W)`` with ``W`` stored ``[in, out]``, which no algorithm took for a layer,
so every one of those models' layers kept round-to-nearest and only a linear head gained.
:func:`linear_from_matmul_in_out` does it for ``x @ W`` written by hand with ``W`` stored
``[in, out]`` (SwiftFormer's attention and MLP weights, research code that keeps
``nn.Parameter(torch.randn(d_in, d_out))``), folding a bias added after, as
:mod:`_quantplug.rewrites.hand_written_linear` does for ``x @ W.T``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from _quantplug.graph.constants import ConstantValues, constant_nodes, module_attr
from _quantplug.graph.op_names import LAYER_OPS as RERUNNABLE_OPS
from _quantplug.graph.working_copy import AttrNamer
from _quantplug.rewrites.hand_written_linear import fold_into_linear

aten = torch.ops.aten

#: the layers whose weights the algorithms choose (transposed convolutions keep the default)
LAYER_OPS = frozenset(op for op in RERUNNABLE_OPS if "conv_transpose" not in op)
_PRODUCTS = (aten.matmul.default, aten.mm.default)


def _source(node: Node) -> str:
    """The parameter a computed constant starts from (its first ``get_attr`` ancestor), for naming."""
    seen: set[Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "get_attr":
            return str(current.target)
        stack.extend(reversed(current.all_input_nodes))
    return node.name


def _parameter(gm: GraphModule, name: str, value: torch.Tensor, before: Node, val: Any) -> Node:
    """A new parameter ``name`` of ``gm`` holding a copy of ``value``, read by a ``get_attr``
    inserted before ``before`` (whose ``meta["val"]`` is ``val``, when known)."""
    gm.register_parameter(name, torch.nn.Parameter(value.detach().clone().contiguous(), requires_grad=False))
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(name)
    if val is not None:
        node.meta["val"] = val
    return node


def _transposed(gm: GraphModule, namer: AttrNamer, weight: Node, value: torch.Tensor, before: Node) -> Node:
    """A new parameter ``<weight>_t`` holding ``value^T`` (a ``[in, out]`` weight as a linear's)."""
    val = weight.meta["val"].t() if "val" in weight.meta else None
    return _parameter(gm, namer(f"{weight.target}_t"), value.t(), before, val)


def _finish(gm: GraphModule, changed: int) -> int:
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed


def materialize_computed_weights(gm: GraphModule) -> int:
    """Replace each conv/linear weight or bias computed from constants by a new parameter holding
    its value; returns how many were made. The graph is edited in place."""
    attr = module_attr(gm)
    constants = constant_nodes(gm.graph, attr)
    values = ConstantValues(attr)
    namer = AttrNamer(gm)
    made: dict[Node, Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or str(node.target) not in LAYER_OPS:
            continue
        for index in (1, 2):  # weight, bias
            arg = node.args[index] if len(node.args) > index else None
            if not isinstance(arg, Node) or arg.op == "get_attr" or arg not in constants:
                continue
            if arg not in made:
                value = values(arg)
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    continue
                name = namer(f"{_source(arg)}_part")  # mha.in_proj_weight -> mha_in_proj_weight_part0
                made[arg] = _parameter(gm, name, value, node, arg.meta.get("val"))
            node.update_arg(index, made[arg])
    return _finish(gm, len(made))


def linear_from_addmm(gm: GraphModule) -> int:
    """Rewrite every fully connected ``addmm(bias, x, W)`` (constant ``W [in, out]`` and bias,
    ``beta = alpha = 1``) as ``linear(x, W^T, bias)``, ``W^T`` a new parameter: the same function,
    in the form the weight algorithms take for a layer. Returns how many were rewritten."""
    attr = module_attr(gm)
    namer = AttrNamer(gm)
    transposed: dict[Node, Node] = {}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.addmm.default or len(node.args) != 3:
            continue
        bias, x, weight = node.args
        constant = all(isinstance(a, Node) and a.op == "get_attr" for a in (bias, weight))
        if not constant or any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
            continue
        value = attr(str(weight.target))
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.is_floating_point():
            continue
        if weight not in transposed:
            transposed[weight] = _transposed(gm, namer, weight, value, node)
        with gm.graph.inserting_before(node):
            linear = gm.graph.call_function(aten.linear.default, (x, transposed[weight], bias))
        linear.meta.update(node.meta)
        node.replace_all_uses_with(linear)
        gm.graph.erase_node(node)
        count += 1
    return _finish(gm, count)


def linear_from_matmul_in_out(gm: GraphModule) -> int:
    """Rewrite every ``matmul``/``mm(x, W)`` (``W`` a 2-D float constant ``[in, out]``, ``x`` of
    its dtype) as ``linear(x, W^T)``, ``W^T`` a new parameter, folding a bias add the product
    alone feeds into ``linear(x, W^T, b)``: the same function, in the form the weight algorithms
    take for a layer (a product of two constants is a computed constant, not a layer). Returns
    how many were rewritten."""
    attr = module_attr(gm)
    constants = constant_nodes(gm.graph, attr)
    namer = AttrNamer(gm)
    transposed: dict[Node, Node] = {}
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _PRODUCTS or len(node.args) != 2:
            continue
        x, weight = node.args
        if (
            not isinstance(weight, Node)
            or weight.op != "get_attr"
            or not isinstance(x, Node)
            or x in constants
        ):
            continue
        value, x_value = attr(str(weight.target)), x.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.is_floating_point():
            continue
        if not isinstance(x_value, torch.Tensor) or x_value.dtype != value.dtype:
            continue
        if weight not in transposed:
            transposed[weight] = _transposed(gm, namer, weight, value, node)
        fold_into_linear(gm, node, x, transposed[weight], value.t())
        count += 1
    return _finish(gm, count)
