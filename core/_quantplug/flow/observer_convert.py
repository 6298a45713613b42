"""Observers that convert themselves: PT2E's ``observer.convert(model, observer_node)`` hook.

torchao's convert hands an observer node to its module when the module has a ``convert`` method
and emits nothing itself. torchao's affine observers (``AffineQuantizedMinMaxObserver``,
``AffineQuantizedMovingAverageMinMaxObserver``, ``AffineFakeQuantize`` ...) use it: their
granularity (``PerGroup``, ``PerToken``, ``PerAxis``) becomes a ``block_size`` and they emit
torchao's ``choose_qparams_affine`` / ``quantize_affine`` / ``dequantize_affine`` ops, which is
what torchao's consumers (its lowering, ExecuTorch's torchao kernels) read. quantplug does the
same for such observers: it keeps their node through its own conversion and lets them write
their ops; the quantize of a constant (a grouped weight) is then computed once and stored as
integers, as torchao's ``fold_quantize`` does, under torchao's names (``_frozen_param0, 1, ...``):
these programs are torchao's ops throughout, read by torchao's consumers, and no quantplug
writer lowers them, so the names follow the ops. The Q/DQ programs quantplug writes itself name a
folded weight after the weight (``linear_weight_q0``), the name its encodings and artifacts carry
(docs/migrating-from-torchao.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule, Node

from _quantplug.graph.attrs import fetch_attr, module_getattr
from _quantplug.graph.working_copy import AttrNamer
from _quantplug.observers.base import ObserverBase


def converts_itself(observer: nn.Module) -> bool:
    """Whether ``observer`` writes its own ops at convert (a PT2E observer with ``convert``)."""
    return callable(module_getattr(observer, "convert", None)) and not isinstance(observer, ObserverBase)


def run_observer_converts(converted: GraphModule, nodes: list[Node], *, fold_quantize: bool) -> None:
    """Let each observer called by ``nodes`` (call_module nodes of ``converted``) convert itself,
    then drop the observer modules; with ``fold_quantize``, quantize ops on constants become the
    integers they compute. The caller generates ``converted``'s code afterwards (once)."""
    targets = {str(n.target) for n in nodes}
    for node in nodes:
        observer: Any = converted.get_submodule(str(node.target))
        observer.convert(converted, node)
    for target in targets:
        if not any(n.op == "call_module" and n.target == target for n in converted.graph.nodes):
            converted.delete_submodule(target)
    if fold_quantize:
        _fold_constant_quantizes(converted)
    converted.graph.lint()


def _quantize_ops() -> set[Any]:
    ops = getattr(torch.ops, "torchao", None)
    found = set()
    for name in ("quantize_affine",):
        packet = getattr(ops, name, None) if ops is not None else None
        if packet is not None:
            found |= {packet, packet.default}
    return found


def _fold_constant_quantizes(gm: GraphModule) -> None:
    """A quantize op whose tensor arguments are all constants becomes its integer result."""
    quantize = _quantize_ops()
    namer = AttrNamer(gm)  # torchao's constant_fold: _frozen_param0, 1, ... (the first free ones)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in quantize:
            continue
        tensors = [a for a in node.args if isinstance(a, Node)]
        if not tensors or any(a.op != "get_attr" for a in tensors):
            continue

        def value(arg: Any) -> Any:
            return fetch_attr(gm, str(arg.target)) if isinstance(arg, Node) else arg

        with torch.no_grad():
            result = node.target(*[value(a) for a in node.args], **node.kwargs)  # type: ignore[operator]
        name = namer("_frozen_param")
        gm.register_buffer(name, result)
        with graph.inserting_before(node):
            stored = graph.get_attr(name)
        stored.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        stored.meta["val"] = result
        node.replace_all_uses_with(stored)
        graph.erase_node(node)
        stored.name = node.name  # as torchao's constant folding: the node keeps the quantize's name
    graph.eliminate_dead_code()
