"""Parameters a program writes in place at every call: weights prepared on the first forward.

Some models finish preparing their weights on their first forward: transformers' RWKV divides
its output weights in place under ``torch.no_grad()`` and sets a Python flag so that it never
does it again. Exported before that first call, the flag is baked in as "not done yet": the
program records the write (a ``wrap_with_set_grad_enabled`` region whose subgraph calls
``weight.div_(...)``) and every run of it divides the weights once more. The eager model computes
with the divided weights on every call; the program drifts further from it at each one, and its
weights are no constants (they are quantized at run time, and ONNX Runtime folds them into
kernels quantplug cannot vouch for).

:func:`functionalize_parameter_writes` makes such a write functional in the working copy: the
region returns ``weight / k`` computed from the stored weight, which the program reads instead of
the written one. Every call then computes what the eager model computes after its first call,
calibration sees the same weights on every batch, and the weights are constants again (stored
quantized). Only writes whose result the program reads through the region's outputs are
rewritten; any other read of the parameter after the region would see a different value, and the
write is left as it is (and reported).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.fx import GraphModule, Node

from _quantplug.graph.attrs import fetch_attr, put_attr
from _quantplug.graph.constants import REGION_OPS
from _quantplug.graph.mutation import written_args
from _quantplug.graph.working_copy import written_parameters

logger = logging.getLogger("quantplug.flow.parameter_writes")


def functionalize_parameter_writes(gm: GraphModule, *, rewrite: bool = True) -> list[str]:
    """Rewrite in-place writes of parameters inside no-grad regions as functional ops (module
    docstring), in ``gm`` only (a region's subgraph is copied before it is changed). Returns the
    parameters rewritten, by qualified name, and warns about them and about any written
    parameter left as it was.

    Args:
        gm: a working copy (``_quantplug.graph.working_copy.working_copy``).
        rewrite: False only warns (quantization-aware training: a parameter written in place is
            still the one trained, where the functional value would carry no gradient).
    """
    done: list[str] = []
    regions = [n for n in gm.graph.nodes if getattr(n.target, "__name__", None) in REGION_OPS]
    order = {node: i for i, node in enumerate(gm.graph.nodes)} if regions and rewrite else {}
    for region in regions if rewrite else []:
        at = next((i for i, a in enumerate(region.args) if _is_subgraph(gm, a)), None)
        if at is None:
            continue
        body_node = cast(Node, region.args[at])
        operands = region.args[at + 1 :]
        original = fetch_attr(gm, str(body_node.target))
        chosen = [
            i
            for i, p in enumerate(_placeholders(original)[: len(operands)])
            if any(p in written_args(user) for user in p.users)
            and _read_only_through(region, operands[i], gm, order)
        ]
        if not chosen:
            continue  # most regions write nothing (rotary tables): no copy
        body = copy.deepcopy(original)
        placeholders = _placeholders(body)
        rewritten = []
        for i in chosen:
            placeholder, operand = placeholders[i], operands[i]
            if _make_writes_functional(body, placeholder):
                rewritten.append(str(operand.target))  # type: ignore[union-attr]
        if rewritten:
            body.graph.lint()
            body.recompile()
            put_attr(gm, str(body_node.target), body)
            done.extend(rewritten)
    left = written_parameters(gm)
    if done:
        logger.warning(
            "the program writes %s in place at every call (a model that prepares its weights on "
            "its first forward, such as transformers' RWKV, exported before that forward): each "
            "run of the program would apply the write again. quantplug applies it to the stored "
            "weights at every call instead, which is what the model computes after its first call; "
            "call the model once before torch.export and this goes away",
            _names(done),
        )
    if left:
        logger.warning(
            "the program writes its parameter(s) %s in place at every call, and quantplug leaves "
            "the write as it is (%s): each run changes the weights again (calibration works on "
            "private copies; your model is not touched). If the model prepares its weights on its "
            "first forward, call it once before torch.export",
            _names(left),
            "quantization-aware training trains the written parameter"
            if not rewrite
            else "outside a no-grad region, read apart from the write, or by an op with no functional form",
        )
    return done


def _placeholders(body: GraphModule) -> list[Node]:
    return [n for n in body.graph.nodes if n.op == "placeholder"]


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _is_subgraph(gm: GraphModule, arg: Any) -> bool:
    return (
        isinstance(arg, Node)
        and arg.op == "get_attr"
        and isinstance(fetch_attr(gm, str(arg.target)), GraphModule)
    )


def _read_only_through(region: Node, operand: Any, gm: GraphModule, order: dict[Node, int]) -> bool:
    """``operand`` is a parameter, and no node after ``region`` reads it other than through the
    region's outputs (those reads would see the written value)."""
    if not (
        isinstance(operand, Node)
        and operand.op == "get_attr"
        and isinstance(fetch_attr(gm, str(operand.target)), nn.Parameter)
    ):
        return False
    return all(order[user] <= order[region] for user in operand.users)


def _make_writes_functional(body: GraphModule, placeholder: Node) -> bool:
    """Replace each op of ``body`` that writes ``placeholder`` in place by its functional twin,
    later reads following the new value; False (and ``body`` unchanged) if any has none."""
    writes = [n for n in body.graph.nodes if placeholder in written_args(n)]
    twins = [_functional_twin(n.target) for n in writes]
    if not writes or any(t is None for t in twins):
        return False
    order = {node: i for i, node in enumerate(body.graph.nodes)}
    current = placeholder  # the parameter's value as of the node being rewritten
    for node, twin in zip(writes, twins):
        with body.graph.inserting_before(node):
            new = body.graph.call_function(twin, node.args, node.kwargs)  # type: ignore[arg-type]
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        current.replace_all_uses_with(new, delete_user_cb=_after(order, node))
        body.graph.erase_node(node)
        current = new
    return True


def _after(order: dict[Node, int], write: Node) -> Callable[[Node], bool]:
    """Reads of the parameter after ``write`` take the new value (nodes added since: none)."""
    at = order[write]
    return lambda user: order.get(user, -1) > at


def _functional_twin(target: Any) -> Any:
    """``aten.div.Tensor`` for ``aten.div_.Tensor``: the same op returning a new tensor, or None."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    twin = getattr(packet, target._overloadname, None) if packet is not None else None
    if not isinstance(twin, torch._ops.OpOverload) or twin._schema.is_mutable:
        return None
    if len(twin._schema.arguments) != len(target._schema.arguments):
        return None
    return twin
