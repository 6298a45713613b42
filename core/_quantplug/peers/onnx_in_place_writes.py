"""In-place ops nobody reads the write of, as their out-of-place forms, before the ONNX export.

Models write in place where nothing else reads the tensor afterwards (Falcon's
``mlp_output += attention_output``, torchvision's ``ReLU(inplace=True)``); the converted program
keeps those ops, harmless there (``quantizer.mutation``). A lowering pass may then put a view
between the written tensor and its producer (``qnn_htp``'s ``linear_to_2d`` reshapes a linear's
output back to 3-D after its dequantize), and torch's ONNX exporter functionalizes a write into a
view as the op, a reshape back into the base and a reshape out again: the quantize after the op
then reads the last reshape, the op's own output has no encoding, and a strict backend refuses
the model.

Where no other reader sees the write, the out-of-place op computes what every reader reads:
lowering's copy of the program says ``add`` where it said ``add_``. What the program computes
does not change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Graph

from _quantplug.graph.mutation import own_aliases, read_after, written_args

_functional: dict[Any, Any] = {}


def _out_of_place(target: Any) -> Any:
    """``aten.add.Tensor`` for ``aten.add_.Tensor`` (same arguments, nothing written), else None."""
    if target not in _functional:
        _functional[target] = _twin(getattr(target, "_schema", None))
    return _functional[target]


def _twin(schema: Any) -> Any:
    if schema is None:
        return None
    namespace, _, name = str(schema.name).partition("::")
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(getattr(torch.ops, namespace, None), name[:-1], None)
    overload = getattr(packet, schema.overload_name or "default", None)
    twin = getattr(overload, "_schema", None)
    if twin is None or twin.is_mutable:
        return None
    return overload if [a.name for a in twin.arguments] == [a.name for a in schema.arguments] else None


def writes_out_of_place(graph: Graph) -> int:
    """Rewrite each in-place op of ``graph`` that writes only its first argument, a tensor the
    program makes itself that no other node reads afterwards (through any view), as its
    out-of-place form; returns how many were rewritten."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    count = 0
    for node in graph.nodes:
        if not node.args or written_args(node) != [node.args[0]]:
            continue
        functional = _out_of_place(node.target)
        aliases = None if functional is None else own_aliases(node.args[0])
        if aliases is None or read_after(node, aliases, order):
            continue
        node.target = functional
        count += 1
    return count
