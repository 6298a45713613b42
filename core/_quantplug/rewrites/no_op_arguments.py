"""Arguments that change nothing a program computes, taken out before annotation.

Each is a no-op in the program but not in what the ONNX exporter writes, and a quantized tensor
the exporter drops or splits is one a backend's encodings cannot name:

* **Empty ``cat`` inputs.** ``torch.cat`` skips 1-D tensors of shape ``(0,)`` whatever the other
  inputs' rank (legacy semantics models rely on: Hugging Face's Gemma 2 starts its
  sliding-window cache as ``torch.tensor([])`` and concatenates keys onto it). Annotated, such an
  input joins the concat's sharing group with a quantize node of its own, yet holds nothing to
  encode, and the exporter drops it from the ``Concat``: ``qnn_htp`` found the quantized tensor
  missing from the exported model and refused to lower.
* **A ``dtype`` that is the input's own.** ``softmax(x, -1, dtype=torch.float32)`` on a float32
  ``x`` (Hugging Face's eager attention) exports as a ``Cast`` and a ``Softmax``; the ``Cast``'s
  output is an intermediate tensor of a quantized op with no quantize/dequantize around it, which
  ``qnn_htp`` cannot encode.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

_CATS = frozenset({"aten.cat.default", "aten.concat.default", "aten.concatenate.default"})
#: ops whose optional dtype is positional argument ``index`` (or keyword ``dtype``)
_DTYPE_ARGUMENT = {"aten.softmax.int": 2, "aten.log_softmax.int": 2}


def _skipped_by_cat(value: Any) -> bool:
    """Whether ``cat`` skips this input: a node whose recorded value is a 1-D empty tensor."""
    if not isinstance(value, Node):
        return False
    val = value.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and val.dim() == 1
        and isinstance(val.shape[0], int)
        and val.shape[0] == 0
    )


def _drop_empty_concat_inputs(node: Node) -> bool:
    tensors = node.args[0] if node.args else None
    if not isinstance(tensors, (list, tuple)):
        return False
    kept = [t for t in tensors if not _skipped_by_cat(t)] or [tensors[0]]  # all empty: keep one
    if len(kept) == len(tensors):
        return False
    node.args = (kept, *node.args[1:])
    return True


def _drop_own_dtype(node: Node, index: int) -> bool:
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    if len(node.args) > index and node.args[index] == val.dtype:
        node.args = (*node.args[:index], None, *node.args[index + 1 :])
        return True
    if node.kwargs.get("dtype") == val.dtype:
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "dtype"}
        return True
    return False


def drop_no_op_arguments(gm: GraphModule) -> int:
    """Take the no-op arguments above out of ``gm``'s nodes (in place); returns how many nodes
    changed. Inputs left without readers are for dead-code removal."""
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target in _CATS:
            changed += _drop_empty_concat_inputs(node)
        elif target in _DTYPE_ARGUMENT:
            changed += _drop_own_dtype(node, _DTYPE_ARGUMENT[target])
    return changed
