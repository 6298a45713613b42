"""Checks that a converted program stores its quantized constants as integers (issue 11.5).

Written independently of quantplug's own notion of constants: a value is input-free when no
placeholder reaches it; a quantize op on an input-free value would quantize a weight (or
anything computed from weights only) again at every forward instead of once at convert.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from _quantplug.flow.inspect import encodings
from _quantplug.graph.attrs import fetch_attr


def _is_quantize(node: Node) -> bool:
    if node.op != "call_function":
        return False
    name = str(node.target)
    return "quantize_per" in name and "dequantize" not in name


def _is_dequantize(node: Node) -> bool:
    return node.op == "call_function" and "dequantize_per" in str(node.target)


def input_free(gm: GraphModule) -> set[Node]:
    """Nodes whose value no placeholder reaches (parameters, buffers and what is computed from them)."""
    free: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (
            node.op == "call_function" and all(n in free for n in node.all_input_nodes)
        ):
            free.add(node)
    return free


def constants_quantized_at_run_time(gm: GraphModule) -> list[str]:
    """Quantize ops whose input is input-free, as ``"<quantize node> <- <its input>"``."""
    free = input_free(gm)
    return [
        f"{n.name} <- {n.args[0].name}"
        for n in gm.graph.nodes
        if _is_quantize(n) and isinstance(n.args[0], Node) and n.args[0] in free
    ]


def float_quantized_constants(gm: GraphModule) -> list[str]:
    """Dequantize ops reading a stored tensor that is not integer, as ``"<node> <- <attr> <dtype>"``."""
    found = []
    for n in gm.graph.nodes:
        if _is_dequantize(n) and isinstance(n.args[0], Node) and n.args[0].op == "get_attr":
            value = fetch_attr(gm, str(n.args[0].target))
            if (
                not isinstance(value, torch.Tensor)
                or value.dtype.is_floating_point
                or value.dtype == torch.bool
            ):
                found.append(f"{n.name} <- {n.args[0].target} {getattr(value, 'dtype', type(value))}")
    return found


def integer_constants(gm: GraphModule) -> list[str]:
    """The get_attr targets read by dequantize ops (the stored integer tensors)."""
    return sorted(
        {
            str(n.args[0].target)
            for n in gm.graph.nodes
            if _is_dequantize(n) and isinstance(n.args[0], Node) and n.args[0].op == "get_attr"
        }
    )


def constants_not_labelled_constant(gm: GraphModule) -> list[str]:
    """Quantized constants that ``_quantplug.flow.inspect.encodings`` does not label ``constant``:
    stored integers read by a dequantize, and quantize ops on input-free values."""
    free = input_free(gm)
    kinds = {entry["node"]: entry["kind"] for entry in encodings(gm)}
    return [
        f"{n.name}: {kinds.get(n.name)}"
        for n in gm.graph.nodes
        if isinstance(n.args[0] if n.args else None, Node)
        and (
            (_is_dequantize(n) and n.args[0].op == "get_attr")  # type: ignore[union-attr]
            or (_is_quantize(n) and n.args[0] in free)
        )
        and kinds.get(n.name) != "constant"
    ]
