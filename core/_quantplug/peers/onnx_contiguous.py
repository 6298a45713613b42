"""``contiguous()`` as the copy it stands for, before the ONNX export.

torch's ONNX exporter decomposes ``aten.contiguous`` with torch's reference, which returns its
input unchanged when its strides already say "contiguous"; with a dynamic batch that test can
come out wrong for a tensor that is not (HF BEiT's attention output, ``transpose(1, 2)`` after
its ``scaled_dot_product_attention``), and the ``view`` after it then fails inside the exporter:
"Cannot view a tensor with shape [s77, 17, 2, 16] and strides (544, 16, 272, 1)". The float
model exported by ``torch.onnx.export`` alone fails the same way; a quantized program fails only
where no quantize/dequantize pair sits between (weight-only presets).

``clone(x, memory_format=...)`` always copies, so the strides after it are the format's, and in
ONNX both are the identity: lowering's copy of the program says ``clone`` where it said
``contiguous``. What the program computes does not change.
"""

from __future__ import annotations

import torch
from torch.fx import Graph

aten = torch.ops.aten


def contiguous_as_clone(graph: Graph) -> int:
    """Rewrite every ``aten.contiguous`` of ``graph`` as a ``clone`` into the same memory format;
    returns how many were rewritten."""
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.contiguous.default:
            node.target = aten.clone.default
            node.kwargs = {"memory_format": node.kwargs.get("memory_format", torch.contiguous_format)}
            count += 1
    return count
